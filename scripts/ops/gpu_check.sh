#!/usr/bin/env bash
# The GPU checks of issues #16 and #46 on a machine with a CUDA GPU: tests/test_gpu.py and tests/test_precision.py,
# then scripts/bench/bench_gpu.py. Writes REPORT_DIR/gpu_report.txt (REPORT_DIR: $OUT where set, else ./gpu_report,
# which .gitignore ignores). Runs on that machine's own torch (any 2.x with CUDA); Hydra and OmegaConf may
# travel as wheels in .whl/ (scripts/ops/fetch_gpu_wheels.sh; the accelerator machines have no package index).
#
#   scripts/ops/gpu_check.sh                          # tests + benchmarks
#   scripts/ops/gpu_check.sh --tests-only             # tests only
#   scripts/ops/gpu_check.sh --tests-only -- -k bf16  # after --: more pytest arguments
#
# Exit status: pytest's own (5, "no tests ran", is a failure: test_precision.py always has tests that run, so
# 5 means a -k filter or a collection problem left nothing checked), else 1 where the benchmarks failed.
# It writes nothing inside the checkout but ./gpu_report: no pytest cache, no bytecode.
set -uo pipefail
cd "$(dirname "$0")/../.."
tests_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --tests-only) tests_only=1; shift ;;
    --) shift; break ;;
    *) echo "gpu_check.sh: unknown argument '$1'; expected --tests-only, then -- and pytest arguments" >&2; exit 2 ;;
  esac
done
REPORT_DIR=${OUT:-gpu_report}
mkdir -p "$REPORT_DIR"
REPORT="$REPORT_DIR/gpu_report.txt"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
if [ -d .whl ] && ! $PY -c "import hydra, omegaconf" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ef-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/ef-site
fi
# No __pycache__/ beside the sources (ignored by git, but a write in tests/ all the same). It costs each
# process ~0.2 s of compiling elasticflow; PYTHONPYCACHEPREFIX would instead make every process recompile
# torch (~8 s) where the environment already turns writing bytecode off (PYTHONDONTWRITEBYTECODE=1).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{
  echo "# elasticflow GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
  $PY -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', torch.cuda.device_count())" 2>&1
} | tee "$REPORT"
$PY -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_precision.py "$@" 2>&1 | tee -a "$REPORT"
rc=${PIPESTATUS[0]}  # pytest's status, not tee's
if [ "$tests_only" = 0 ]; then
  $PY scripts/bench/bench_gpu.py 2>&1 | tee -a "$REPORT"
  [ "${PIPESTATUS[0]}" = 0 ] || [ "$rc" != 0 ] || rc=1
fi
echo "gpu_check: exit $rc; report in $REPORT" | tee -a "$REPORT"
exit "$rc"
