#!/usr/bin/env bash
# Create .venv with a CPU build of torch, tensorflow-cpu and elasticflow (editable, with dev extras).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first and pinned: an unpinned torch (or one pulled in by a dependency) is the multi-GB CUDA build.
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  "${PIP[@]}" "torch==2.13.0"
fi
# The TensorFlow backend is optional at run time; install it so every test runs.
if ! .venv/bin/python -c 'import tensorflow' 2>/dev/null; then
  "${PIP[@]}" "tensorflow-cpu==2.21.*"
fi
"${PIP[@]}" -e ".[dev]"
# MLflow's sqlite store lives in the full mlflow package, whose graphene (for MLflow's server, never run here)
# pins python-dateutil<3 where the kubernetes client needs >=3: the package alone, at the skinny client's version.
if ! .venv/bin/python -c 'import mlflow.store.tracking.sqlalchemy_store' 2>/dev/null; then
  "${PIP[@]}" --no-deps "mlflow==$(.venv/bin/python -c 'import mlflow; print(mlflow.__version__)')"
fi
.venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' \
  || { echo "setup: a dependency replaced torch 2.13.0" >&2; exit 1; }
.venv/bin/elasticflow --version
