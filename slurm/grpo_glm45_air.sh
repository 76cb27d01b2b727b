#!/usr/bin/env bash
#SBATCH --job-name=grpo-glm45-air
#SBATCH --nodes=6
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --output=slurm-%x-%j.out
#
# GRPO on GLM-4.5-Air (glm4_moe: 106.9 B parameters, 128 experts of which 8 active, sigmoid router)
# with GSM8K: six nodes of 8 x H100/H200; nodes 1-4 train (recipes/glm45_air_gsm8k.yaml: TP=4 x PP=2
# x DP=4 for the dense part, EP=16 x ETP=1 for the experts of each pipeline stage; ~65 GB resident,
# 64.6 GiB planned peak per H100: the arithmetic and the memory plan are in the recipe), nodes 5-6
# run 2 SGLang engines (tp_size 8, one per node: 26.7 GB of weights + ~46 GB KV per GPU) behind the
# router on the batch node (dedicated placement, weight_sync=distributed: NCCL broadcast).
#
#   sbatch slurm/grpo_glm45_air.sh [key.sub=value ...]      e.g. actor.optim.lr=2e-6
#   DRY_RUN=1 sbatch slurm/grpo_glm45_air.sh                 print every node's commands, start nothing
#   DRY_RUN=1 bash slurm/grpo_glm45_air.sh                   the same without Slurm (nodes node1..)
#
# Needs: the environment with megatron-grpo and sglang[all] + sglang-router active when submitting
# (the job inherits PATH), or GRPO_PYTHON=/path/to/python; the model and data on a shared filesystem.
#
# Environment (defaults in brackets; the full list is at the top of slurm/lib/grpo_common.sh):
#   HF_MODEL        HF folder of GLM-4.5-Air (config.json + safetensors) [recipe: zai-org/GLM-4.5-Air]
#   TRAIN_FILES     comma-separated prompt files (verl layout; tools/prepare_gsm8k.py)
#                                                 [recipe: data/gsm8k_rl/train.parquet]
#   VAL_FILES       [recipe: data/gsm8k_rl/test.parquet]
#   OUTPUT_ROOT     run folders go to OUTPUT_ROOT/<job name>-<job id>  [$SLURM_SUBMIT_DIR/outputs]
#   SGLANG_EXTRA_ARGS  extra sglang.launch_server flags, e.g. "--attention-backend fa3"  []
#   ENGINE_PLACEMENT   auto (from the recipe) | colocated | dedicated | none            [auto]
#   GRPO_NET_IFNAME    NCCL/GLOO socket interface                      [auto-detected]
#   GRPO_RESUBMIT=1    resubmit after the time-limit/preemption signal, resuming from the checkpoint
#   RECIPE             [glm45_air_gsm8k]
set -uo pipefail
: "${RECIPE:=glm45_air_gsm8k}"
GRPO_DEFAULT_NODES=6 GRPO_DEFAULT_GPUS_PER_NODE=8   # = the #SBATCH header, for DRY_RUN without Slurm

# The helper: GRPO_REPO, else next to this file (bash slurm/...), else next to the submitted
# script (sbatch runs a copy in the spool folder), else the submit folder.
grpo_repo() {
    local d cmd
    cmd=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
    for d in "${GRPO_REPO:-}" "$(dirname "${BASH_SOURCE[0]}")/.." "${cmd:+$(dirname "$cmd")/..}" "${SLURM_SUBMIT_DIR:-}"; do
        [ -n "$d" ] && [ -f "$d/slurm/lib/grpo_common.sh" ] && { (cd "$d" && pwd); return 0; }
    done
    echo "cannot find slurm/lib/grpo_common.sh: set GRPO_REPO=/path/to/megatron-grpo" >&2; return 1
}
GRPO_REPO=$(grpo_repo) || exit 1
# shellcheck source-path=SCRIPTDIR source=lib/grpo_common.sh
source "$GRPO_REPO/slurm/lib/grpo_common.sh"
grpo_main "$@"
