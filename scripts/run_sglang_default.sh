#!/usr/bin/env bash
# recipes/tiny_cpu_sglang.yaml in one command: sets up SGLang 0.5.23's own runtime for a CPU
# (scripts/setup_sglang_runtime.sh: ~3 min the first time) and trains the embedded default's task
# with one real SGLang engine. The trainer runs in that venv too (Python 3.12, the clusters' torch,
# megatron-core and transformers). Extra arguments are overrides, e.g. trainer.total_steps=20.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_sglang_runtime.sh
exec build/sglang-runtime-venv/bin/python -m megatron_grpo.cli train recipes/tiny_cpu_sglang.yaml "$@"
