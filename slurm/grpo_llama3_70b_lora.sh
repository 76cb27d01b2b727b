#!/usr/bin/env bash
#SBATCH --job-name=grpo-llama3-70b-lora
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --output=slurm-%x-%j.out
#
# GRPO with LoRA on Llama-3-70B-Instruct with GSM8K: three nodes of 8 x H100/H200 (the full-parameter
# slurm/grpo_llama3_70b.sh takes eight); node 1 trains rank-32 adapters over the frozen bf16 base
# (recipes/llama3_70b_lora_gsm8k.yaml: TP=8, no gradients or optimizer state for the base), nodes 2-3 run
# 4 SGLang engines (tp_size 4, two per node) that receive the merged weights (dedicated, weight_sync=distributed).
#
#   sbatch slurm/grpo_llama3_70b_lora.sh [key.sub=value ...]      e.g. actor.optim.lr=2e-6
#   DRY_RUN=1 sbatch slurm/grpo_llama3_70b_lora.sh                 print every node's commands, start nothing
#   DRY_RUN=1 bash slurm/grpo_llama3_70b_lora.sh                   the same without Slurm (nodes node1..)
#
# Needs: the environment with megatron-grpo and sglang[all] + sglang-router active when submitting
# (the job inherits PATH), or GRPO_PYTHON=/path/to/python; the model and data on a shared filesystem.
#
# Environment (defaults in brackets; the full list is at the top of slurm/lib/grpo_common.sh):
#   HF_MODEL        HF folder of Llama-3-70B-Instruct [recipe: meta-llama/Meta-Llama-3-70B-Instruct]
#   TRAIN_FILES     comma-separated prompt files (verl layout; tools/prepare_gsm8k.py)
#                                                 [recipe: data/gsm8k_rl/train.parquet]
#   VAL_FILES       [recipe: data/gsm8k_rl/test.parquet]
#   OUTPUT_ROOT     run folders go to OUTPUT_ROOT/<job name>-<job id>  [$SLURM_SUBMIT_DIR/outputs]
#   SGLANG_EXTRA_ARGS  extra sglang.launch_server flags, e.g. "--attention-backend fa3"  []
#   ENGINE_PLACEMENT   auto (from the recipe) | colocated | dedicated | none            [auto]
#   GRPO_NET_IFNAME    NCCL/GLOO socket interface                      [auto-detected]
#   GRPO_RESUBMIT=1    resubmit after the time-limit/preemption signal, resuming from the checkpoint
#   RECIPE             [llama3_70b_lora_gsm8k]
set -uo pipefail
: "${RECIPE:=llama3_70b_lora_gsm8k}"
GRPO_DEFAULT_NODES=3 GRPO_DEFAULT_GPUS_PER_NODE=8   # = the #SBATCH header, for DRY_RUN without Slurm

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
