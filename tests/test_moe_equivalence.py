"""The first GRPO step of the tiny Qwen3-MoE under expert parallelism equals the single process.

The trainer's own pieces (micro_batches.plan_micro_batches, train_step.train_on_mini_batch, the
distributed optimizer, whose expert parameters megatron shards over the expert-data-parallel
group) run one update on the same 16 uneven sequences from the same HF weights at:
  EP2        2 ranks: dense part DP2, experts 4 + 4 (expert-DP 1)
  EP2xTP2    4 ranks: TP2 x DP2 (sequence parallel: megatron's MoE layer trains with TP only so),
             experts EP2 x ETP1 (expert-DP 2)
  EP2xPP2    4 ranks: PP2 x DP2, experts EP2 per stage
  EP2xDP2    4 ranks: DP4, experts EP2 x expert-DP 2
  EP2xTP2xETP2  4 ranks: TP2 (sequence parallel) x DP2, experts EP2 x ETP2 (expert-DP 1): ETP = TP,
             megatron's default; the dispatcher all-gathers the TP ranks' tokens in uneven counts (on gloo
             through launch/cpu.py's uneven-ag patch)
Compared with the single process: loss, policy loss, entropy, grad norm, and every weight's update
(after minus before; the weights exported as HF tensors, experts gathered over EP). Capacity factor off: no token is
dropped, so the layouts compute the same sums in different orders.

Tolerance: fp32 rounding of reductions of different lengths and orders (DP all-reduce of
gradients, the token dispatcher's permuted expert batches, TP partial sums): a few fp32 eps per
reduction; the issue's 1e-5 relative to each quantity's magnitude (the largest element for
tensors) is ~80 eps; the optimizer settings that make updates comparable, and the rounding
allowance of each update, are tests/first_step.py's.
"""
from __future__ import annotations

import pytest

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed
from tests.first_step import STEP_METRICS, check_step_equals_single, first_step, uneven_samples

TOLERANCE = 1e-5
# The routers' statistics, reduced over all ranks (models/moe_metrics.py): the same wherever the
# layout adds no padding positions (the routers route padding too; TP's SP multiple and PP's common
# shape add some, so those layouts see other positions).
MOE_METRICS = ("moe/load_max_over_mean", "moe/load_max_over_mean_worst", "moe/router_entropy", "moe/aux_loss",
               "moe/dropped_frac")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe_eq") / "policy", seed=3))


@pytest.fixture(scope="module")
def single(policy):
    return run_distributed(first_step, 1, args=(policy, {}, uneven_samples(16, 250)), timeout=300)[0]


LAYOUTS = {
    "ep2": (2, dict(expert=2)),
    "ep2-tp2": (4, dict(expert=2, tensor=2, expert_tensor=1, sequence_parallel=True)),
    "ep2-pp2": (4, dict(expert=2, pipeline=2)),
    "ep2-dp2": (4, dict(expert=2)),
    "ep2-tp2-etp2": (4, dict(expert=2, tensor=2, expert_tensor=2, sequence_parallel=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_first_grpo_step_at_expert_parallel_equals_single_process(policy, single, layout):
    world, parallel = LAYOUTS[layout]
    step = run_distributed(first_step, world, args=(policy, parallel, uneven_samples(16, 250)), timeout=600)[0]
    compared = STEP_METRICS + (MOE_METRICS if layout in ("ep2", "ep2-dp2") else ())
    check_step_equals_single(layout, step, single, policy, TOLERANCE, metrics=compared)  # every expert got tokens
