#!/usr/bin/env bash
#SBATCH --job-name=grpo-tiny-cpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:15:00
#SBATCH --signal=B:USR1@120
#SBATCH --output=slurm-%x-%j.out
#
# The tiny CPU recipe (recipes/tiny_cpu.yaml) through the SAME launcher as the GPU scripts
# (slurm/lib/grpo_common.sh): no GPUs, no SGLang (rollout.engine=local on rank 0), gloo;
# the 2 tasks run data parallel (DP=2). The CI test of the Slurm path (tests/test_slurm.py):
#
#   sbatch --wait slurm/grpo_tiny_cpu.sh trainer.total_steps=3             one node, 2 tasks
#   sbatch --wait --nodes=2 --ntasks-per-node=1 slurm/grpo_tiny_cpu.sh     two nodes, 1 task each
#
# Needs: the environment with megatron-grpo active when submitting (or GRPO_PYTHON).
# Environment: OUTPUT_ROOT, GRPO_RUN_DIR, RECIPE [tiny_cpu], and the rest of grpo_common.sh's list.
set -uo pipefail
: "${RECIPE:=tiny_cpu}"
GRPO_DEFAULT_NODES=1 GRPO_DEFAULT_GPUS_PER_NODE=0   # = the #SBATCH header, for DRY_RUN without Slurm

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
