#!/usr/bin/env bash
# The full test suite (unit + end-to-end CLI runs in subprocesses). Extra arguments go to pytest.
# --quick: the inner loop, a few minutes: the unit tests and one end-to-end kill per backend (tests/conftest.py's
# QUICK_FILES and QUICK_TESTS); CI runs the whole suite.
# Two pytest-xdist workers by default (EF_TEST_WORKERS=0: one process). tests/conftest.py groups them: a file
# in one worker, and the files that use machine-wide resources (SLURM's daemons, network namespaces) together,
# one at a time, first. The serial suite leaves ~a third of the 2 cores idle while jobs wait on timeouts.
# (Until 2026-11-27 the groups were ignored -- pytest 9.2 and xdist 3.8 disagree on where a test's id lives,
# setup.cfg pins pytest<9 -- so the namespace-host tests ran in both workers at once and collided.)
# --durations: CI prints the slowest tests, so the time budget is watched where it is spent.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode for our own sources, once: with PYTHONDONTWRITEBYTECODE set (as here and in CI) every process of
# the suite would compile elasticflow again (~0.2 s each, over a thousand processes).
.venv/bin/python -m compileall -q elasticflow models tests scripts >/dev/null
workers=${EF_TEST_WORKERS:-2}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadgroup)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 --durations=80 "${parallel[@]}" "$@"
