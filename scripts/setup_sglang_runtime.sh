#!/usr/bin/env bash
# Creates build/sglang-runtime-venv: SGLang 0.5.23's own runtime (scheduler, model runner, radix
# cache, torch-native attention, sampler, weight updater) for engines on a CPU
# (rollout.sglang.device=cpu): recipes/tiny_cpu_sglang.yaml and the real-engine tests.
# It is a venv layered on the clusters' .venv312 (Python 3.12, torch 2.14.1, megatron-core 0.19.2,
# made first by scripts/setup_env.sh; ~6 GB, most of it torch's CUDA libraries, which torch 2.14.1
# needs to import) that adds tools/sglang_cpu/requirements.txt --no-deps (~1.5 GB, ~2 min) and,
# through a .pth line, tools/sglang_cpu's stand-in for SGLang's CPU kernel package.
# Idempotent: a finished install leaves a stamp of the requirements and this script; a venv without
# it, or one that fails tools/sglang_cpu/verify_install.py, is deleted and built again.
# MEGATRON_GRPO_PYTHON312 names the 3.12 interpreter (default: pyenv's 3.12.1).
set -euo pipefail
cd "$(dirname "$0")/.."
base=.venv312
venv=build/sglang-runtime-venv
reqs=tools/sglang_cpu/requirements.txt
MEGATRON_GRPO_VENV="$base" MEGATRON_GRPO_TORCH=2.14.1 MEGATRON_GRPO_MCORE=0.19.2 \
  MEGATRON_GRPO_PYTHON="${MEGATRON_GRPO_PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python3.12}" \
  bash scripts/setup_env.sh dev
torch_version=$("$base/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
stamp="$venv/.complete-$(cat "$reqs" "$0" tools/sglang_cpu/verify_install.py | sha1sum | cut -c1-12)"
verify() { "$venv/bin/python" tools/sglang_cpu/verify_install.py "$torch_version"; }
if [ -f "$stamp" ] && verify; then
  exit 0
fi
echo "setup_sglang_runtime: building $venv (SGLang 0.5.23 on CPU, ~2 min)"
rm -rf "$venv"
"$base/bin/python" -m venv "$venv"
base_site=$("$base/bin/python" -c "import site; print(site.getsitepackages()[0])")
child_site=$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
# after the child's own packages: its pins (transformers 5.19.0, numpy < 2.4) win over the base's
echo "import site; site.addsitedir('$base_site')" > "$child_site/_mgrpo_base_venv.pth"
echo "$(pwd)/tools/sglang_cpu" > "$child_site/_mgrpo_sgl_kernel_stand_in.pth"
"$venv/bin/pip" install -q --no-deps -r "$reqs"
verify
touch "$stamp"
