#!/usr/bin/env bash
# The full test suite (unit + end-to-end CLI runs in subprocesses). Extra arguments go to pytest.
# One pytest process by default. EF_TEST_WORKERS=2 runs two pytest-xdist workers (tests/conftest.py groups
# them: a file in one worker, the SLURM and network-namespace files together, first): on the 2-core machine
# that was 25 min against ~29 serially, but the namespace-host tests failed beside the other worker's jobs
# (2026-11-27; the closing note of that stop has the list), so CI stays serial until that is understood.
# --durations: CI prints the slowest tests, so the time budget is watched where it is spent.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode for our own sources, once: with PYTHONDONTWRITEBYTECODE set (as here and in CI) every process of
# the suite would compile elasticflow again (~0.2 s each, over a thousand processes).
.venv/bin/python -m compileall -q elasticflow models tests scripts >/dev/null
workers=${EF_TEST_WORKERS:-0}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadgroup)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 --durations=30 "${parallel[@]}" "$@"
