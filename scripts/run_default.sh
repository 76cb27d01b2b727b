#!/usr/bin/env bash
# Sets up the venv if missing and runs the embedded default recipe on this machine (CPU, no downloads).
# MEGATRON_GRPO_VENV (default .venv) picks the venv, with the other settings of scripts/setup_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
exec "${MEGATRON_GRPO_VENV:-.venv}/bin/megatron-grpo" train recipes/tiny_cpu.yaml "$@"
