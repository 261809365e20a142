#!/usr/bin/env bash
# The GPU checks of issue #16 on a machine with a CUDA GPU: tests/test_gpu.py, then scripts/bench_gpu.py.
# Writes REPORT_DIR/gpu_report.txt (REPORT_DIR: $OUT
# where set, else ./gpu_report). Runs on that machine's own torch (any 2.x with CUDA); Hydra and
# OmegaConf may travel as wheels in .whl/ (the accelerator machines have no package index).
#
#   scripts/gpu_check.sh                 # tests + benchmarks
#   scripts/gpu_check.sh --tests-only
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT_DIR=${OUT:-gpu_report}
mkdir -p "$REPORT_DIR"
REPORT="$REPORT_DIR/gpu_report.txt"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
if [ -d .whl ] && ! $PY -c "import hydra, omegaconf" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ef-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/ef-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  echo "# elasticflow GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
  $PY -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', torch.cuda.device_count())"
} | tee "$REPORT"
rc=0
$PY -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py 2> tests/test_gpu.py tests/test_precision.py 2>&11 | tee -a "$REPORT" || rc=1
if [ "${1:-}" != "--tests-only" ]; then
  $PY scripts/bench_gpu.py 2>&1 | tee -a "$REPORT" || rc=1
fi
echo "gpu_check: exit $rc; report in $REPORT" | tee -a "$REPORT"
exit $rc
