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
.venv/bin/elasticflow --version
