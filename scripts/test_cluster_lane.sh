#!/usr/bin/env bash
# The clusters' versions lane (CI runs it beside scripts/test.sh, .ci/run): Python 3.12, torch 2.14.1,
# megatron-core 0.19.2, transformers 5.19.0 and SGLang 0.5.23's own runtime on CPU, all in
# build/sglang-runtime-venv (scripts/setup_sglang_runtime.sh, layered on .venv312).
#   1. the embedded default's task with one real SGLang engine learns (recipes/tiny_cpu_sglang.yaml,
#      scripts/run_sglang_default.sh), in 125 of the recipe's 150 steps (unseeded engine sampling varies
#      the curve: a full run passed 0.8 at step 79; clean-clone CI runs ended at 0.991 over steps
#      101-110 and at 0.829 over steps 91-100): mean reward <= 0.3 at step 1, >= 0.8 over the last 10 steps, and every weight sync
#      verified by the engine's /weights_checker checksums;
#   2. ruff;
#   3. pytest in that interpreter: the tests marked `versions` (their outcome can change with these
#      versions, tests/conftest.py) and not slow, and every test marked `sglang_runtime` (real engines).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
phase() { echo "cluster lane: $1 after $(( $(date +%s) - started ))s"; }
bash scripts/setup_sglang_runtime.sh
phase "set up"
python=build/sglang-runtime-venv/bin/python
out=build/ci-lane2-sglang-default
rm -rf "$out"
bash scripts/run_sglang_default.sh "logging.output_dir=$out" logging.console=false trainer.total_steps=125
phase "learning run done"
"$python" - "$out/metrics.jsonl" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = [r for r in records if "reward/mean" in r]  # a record may be an eval only
rewards = [r["reward/mean"] for r in steps]
last = sum(rewards[-10:]) / 10
verified = sum(1 for r in steps if r.get("sync/verified") == 1.0 and r.get("sync/verified_tensors", 0) > 0)
print(f"cluster lane: tiny_cpu_sglang (real SGLang engine): {len(rewards)} steps, reward {rewards[0]:.3f} -> "
      f"{last:.3f} (last 10), {verified} of {len(steps)} syncs verified by checksum")
sys.exit(0 if rewards[0] <= 0.3 and last >= 0.8 and verified == len(steps) else 1)
PY
.venv312/bin/ruff check .
phase "ruff done"
MEGATRON_GRPO_REQUIRE_TEST_DEPS=1 "$python" -m pytest -p no:cacheprovider -m "(versions and not slow) or sglang_runtime" "$@"
