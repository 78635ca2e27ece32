#!/usr/bin/env bash
# The test suite on a fresh machine: set up everything it needs, then run pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/test_shm.py -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
exec .venv/bin/python -m pytest -q "$@"
