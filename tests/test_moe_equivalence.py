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
tensors) is ~80 eps. Adam's first step turns rounding noise on near-zero gradients into full
sign(g) updates, so the optimizer uses eps = 1 (update about lr * g / (|g| + 1)), as
tests/test_packing_equivalence.py does, and lr = 5 so that the updates (about 5 g) are large next
to the rounding of w + update: an update compares like the gradient it came from, within 1e-5 plus
that rounding (2 ulp of the tensor's largest |w|, over its largest update; norm weights, |w| ~ 1,
measured 7e-6 of it).
"""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed

TOLERANCE = 1e-5
FP32_EPS = float(torch.finfo(torch.float32).eps)
METRICS = ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm")
# The routers' statistics, reduced over all ranks (models/moe_metrics.py): the same wherever the
# layout adds no padding positions (the routers route padding too; TP's SP multiple and PP's common
# shape add some, so those layouts see other positions).
MOE_METRICS = ("moe/load_max_over_mean", "moe/load_max_over_mean_worst", "moe/router_entropy", "moe/aux_loss",
               "moe/dropped_frac")


def uneven_samples(count: int, vocab: int, seed: int = 0):
    from megatron_grpo.trainer.batches.batching import TrainSample

    rng = random.Random(seed)
    return [TrainSample(prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 12))],
                        response_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 20))],
                        advantage=rng.uniform(0.25, 1.5)) for _ in range(count)]


def _first_step(rank, world_size, policy_path, parallel, samples):
    from megatron_grpo.config import load_config
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.trainer.loop import global_batch_info, grpo_loss_config
    from megatron_grpo.trainer.batches.micro_batches import plan_micro_batches
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.step.train_step import train_on_mini_batch

    cfg = load_config("tiny_cpu", [f"parallel.sequence_parallel={parallel.get('sequence_parallel', False)}",
                                   f"parallel.tensor={parallel.get('tensor', 1)}", "rollout.n=4",
                                   "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                                   "actor.max_tokens_per_micro_batch=48", "actor.entropy_coeff=0.01"])
    layout = ParallelLayout(**parallel)
    initialize_model_parallel(layout, seed=1)
    mc = ModelArchitecture.from_hf(policy_path, tensor_parallel=layout.tensor, vocab_multiple=8)
    chunks = build_model(mc, layout)
    load_hf_weights(chunks, mc, policy_path)
    policy = wrap_with_ddp(chunks, use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(policy, OptimizerSettings(lr=5.0, eps=1.0, grad_clip=1e6,
                                                             use_distributed_optimizer=True))
    batch = copy.deepcopy(samples)
    (micro_batches,) = plan_micro_batches(batch, cfg, model_config=mc)
    metrics = train_on_mini_batch(policy, optimizer, micro_batches, loss_config=grpo_loss_config(cfg),
                                  batch_info=global_batch_info(micro_batches, cfg), temperature=1.0,
                                  vocab_size=mc.vocab_size, device=torch.device("cpu"), need_entropy=True)
    weights = {name: tensor.numpy().copy() for name, tensor in gather_hf_weights_on_rank0(chunks, mc)}
    return metrics, weights


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe_eq") / "policy", seed=3))


@pytest.fixture(scope="module")
def single(policy):
    return run_distributed(_first_step, 1, args=(policy, {}, uneven_samples(16, 250)), timeout=300)[0]


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


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
    results = run_distributed(_first_step, world, args=(policy, parallel, uneven_samples(16, 250)), timeout=600)
    ref_metrics, ref_weights = single
    metrics, weights = results[0]
    compared = METRICS + (MOE_METRICS if layout in ("ep2", "ep2-dp2") else ())
    worst = {key: _rel(metrics[key], ref_metrics[key]) for key in compared}
    allowed: dict[str, float] = {}
    assert sorted(weights) == sorted(ref_weights)
    from safetensors.torch import load_file

    before = {name: tensor.numpy() for name, tensor in load_file(f"{policy}/model.safetensors").items()}
    for name in ref_weights:
        ref_update = ref_weights[name] - before[name]
        assert np.abs(ref_update).max() > 1e-4, f"{name} did not move"  # every expert got tokens
        rounding = 2 * FP32_EPS * np.abs(before[name]).max() / np.abs(ref_update).max()
        worst[f"update {name}"] = _rel(weights[name] - before[name], ref_update)
        allowed[f"update {name}"] = TOLERANCE + rounding
    print(layout, {k: f"{v:.1e}" for k, v in sorted(worst.items(), key=lambda kv: -kv[1])[:5]})
    bad = {k: v for k, v in worst.items() if v > allowed.get(k, TOLERANCE)}
    assert not bad, f"{layout}: differs from the single process beyond {TOLERANCE:.0e}: {bad}"
