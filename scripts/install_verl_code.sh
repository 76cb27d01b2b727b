#!/usr/bin/env bash
# Installs verl 0.9.1's Python code (--no-deps: none of its runtime, torch untouched) into
# build/verl-0.9.1 for tests/test_verl_scorers.py, which loads verl's own reward scorers from
# there by file path, as a verl user names them in custom_reward_function.path. The version is
# the one the verl key table follows (megatron_grpo/config/verl_keys.py VERL_VERSION).
# Idempotent: an existing install is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
target=build/verl-0.9.1
[ -f "$target/verl/utils/reward_score/gsm8k.py" ] && exit 0
rm -rf "$target.tmp"
.venv/bin/python -m pip install -q --no-deps --no-compile --target "$target.tmp" verl==0.9.1
rm -rf "$target"
mv "$target.tmp" "$target"
