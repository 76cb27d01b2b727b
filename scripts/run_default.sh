#!/usr/bin/env bash
# Sets up ./.venv if missing and runs the embedded default recipe on this machine (CPU, no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
exec .venv/bin/megatron-grpo train recipes/tiny_cpu.yaml "$@"
