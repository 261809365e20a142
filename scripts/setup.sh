#!/usr/bin/env bash
# Create .venv with a CPU build of torch, tensorflow-cpu and elasticflow (editable, with dev extras).
# Idempotent: re-running only installs what is missing. A line per phase says what it is doing.
#
#   ./scripts/setup.sh                 # torch, TensorFlow and elasticflow: every test runs
#   ./scripts/setup.sh --torch-only    # without TensorFlow (~600 MB less; backend=tensorflow then says what to install)
#   ./scripts/setup.sh --dry-run       # print the phases and what each would do; install nothing
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/setup.sh [--torch-only] [--dry-run] [--help]

Creates .venv (python3, or $PYTHON) with CPU torch 2.13, tensorflow-cpu and elasticflow (editable, dev extras).
Re-running installs only what is missing; each phase prints one line.

  --torch-only   skip TensorFlow (backend=tensorflow and its tests need it: run again without the flag)
  --dry-run      print the phases and what each would do, install nothing
  -h, --help     this text
EOF
}

TORCH_ONLY=0
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --torch-only) TORCH_ONLY=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: setup.sh: unknown option '$arg' (expected --torch-only, --dry-run or --help)" >&2
       echo "hint: ./scripts/setup.sh --torch-only to skip TensorFlow; ./scripts/setup.sh --help for the options" >&2
       exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
PHASES=6
PHASE=0
STARTED=$SECONDS

# phase TEXT: the next phase's line, with the seconds since setup started.
phase() {
  PHASE=$((PHASE + 1))
  printf 'setup [%d/%d, %3ds] %s\n' "$PHASE" "$PHASES" "$((SECONDS - STARTED))" "$1"
}

# run CMD...: run it, or with --dry-run only say it.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "  would run: $*"
  else
    "$@"
  fi
}

has() { [ -x .venv/bin/python ] && .venv/bin/python -c "$1" 2>/dev/null; }
TORCH_OK='import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")'

if [ -x .venv/bin/python ]; then
  phase ".venv: already there"
else
  phase ".venv: creating it with $PYTHON"
  run "$PYTHON" -m venv .venv
fi

# torch first and pinned: an unpinned torch (or one pulled in by a dependency) is the multi-GB CUDA build.
if has "$TORCH_OK"; then
  phase "torch 2.13.0: already installed"
else
  phase "torch 2.13.0 (CPU): installing, ~200 MB, a minute or more"
  run "${PIP[@]}" "torch==2.13.0"
fi

# The TensorFlow backend is optional at run time; install it so every test runs.
if [ "$TORCH_ONLY" = 1 ]; then
  phase "tensorflow-cpu: skipped (--torch-only)"
elif has 'import tensorflow'; then
  phase "tensorflow-cpu: already installed"
else
  phase "tensorflow-cpu 2.21: installing, ~600 MB, a few minutes (--torch-only skips it)"
  run "${PIP[@]}" "tensorflow-cpu==2.21.*"
fi

phase "elasticflow (editable) and its dev extras: pytest, scikit-learn, datasets, transformers, MkDocs, ..."
run "${PIP[@]}" -e ".[dev]"

# MLflow's sqlite store lives in the full mlflow package, whose graphene (for MLflow's server, never run here)
# pins python-dateutil<3 where the kubernetes client needs >=3: the package alone, at the skinny client's version.
if has 'import mlflow.store.tracking.sqlalchemy_store'; then
  phase "mlflow's sqlite store: already installed"
else
  phase "mlflow's sqlite store: installing the full mlflow package, without its dependencies"
  if [ "$DRY_RUN" = 1 ]; then
    echo "  would run: ${PIP[*]} --no-deps mlflow==<the installed mlflow-skinny's version>"
  else
    "${PIP[@]}" --no-deps "mlflow==$(.venv/bin/python -c 'import mlflow; print(mlflow.__version__)')"
  fi
fi

phase "checking: torch still 2.13.0, the elasticflow command runs"
if [ "$DRY_RUN" = 1 ]; then
  echo "  would run: .venv/bin/elasticflow --version"
  exit 0
fi
has "$TORCH_OK" || { echo "error: setup: a dependency replaced torch 2.13.0" >&2; exit 1; }
.venv/bin/elasticflow --version
echo "setup: done in $((SECONDS - STARTED)) s. Run: source .venv/bin/activate (then elasticflow ...), or .venv/bin/elasticflow ..."
