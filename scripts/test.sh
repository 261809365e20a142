#!/usr/bin/env bash
# The full test suite (unit + end-to-end CLI runs in subprocesses). Extra arguments go to pytest.
# --durations: CI prints the slowest tests, so the 30-minute budget is watched where it is spent.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 --durations=30 "$@"
