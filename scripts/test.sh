#!/usr/bin/env bash
# The full test suite (unit + end-to-end CLI runs in subprocesses). Extra arguments go to pytest.
# Two pytest-xdist workers share the 2 cores (tests/conftest.py groups the tests: a file in one worker, the
# SLURM and network-namespace files together, first); much of an end-to-end test is waiting on its job, which
# the other worker fills. EF_TEST_WORKERS=0 runs one process (for -x, --pdb, or reading one failure in order).
# --durations: CI prints the slowest tests, so the 20-minute budget is watched where it is spent.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=${EF_TEST_WORKERS:-2}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadgroup)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 --durations=30 "${parallel[@]}" "$@"
