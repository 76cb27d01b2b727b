#!/usr/bin/env bash
# The test command: sets up ./.venv if missing, then runs the whole suite (slow tests included).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
exec .venv/bin/python -m pytest "$@"
