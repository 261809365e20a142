#!/usr/bin/env bash
# The full test suite (unit + end-to-end CLI runs in subprocesses). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 "$@"
