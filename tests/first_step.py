"""One GRPO update of a tiny HF model at a parallel layout, with the trainer's own pieces
(micro_batches.plan_micro_batches, train_step.train_on_mini_batch, megatron DDP and the
distributed optimizer), for tests that compare a layout with the single process: the metrics and
every HF tensor after the update (gathered over TP / PP / EP on rank 0).

Adam's first step turns rounding noise on near-zero gradients into full sign(g) updates, so the
optimizer uses eps = 1 (update about lr * g / (|g| + 1)), and lr = 5 so that the updates (about 5 g)
are large next to the rounding of w + update: an update compares like the gradient it came from,
within the tolerance plus that rounding (compare_updates)."""
from __future__ import annotations

import copy
import random

import numpy as np
import torch

FP32_EPS = float(torch.finfo(torch.float32).eps)


def uneven_samples(count: int, vocab: int, seed: int = 0):
    from megatron_grpo.trainer.batches.batching import TrainSample

    rng = random.Random(seed)
    return [TrainSample(prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 12))],
                        response_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 20))],
                        advantage=rng.uniform(0.25, 1.5)) for _ in range(count)]


def first_step(rank, world_size, policy_path, parallel, samples, overrides=(), recompute=None):
    """Rank 0 returns (metrics, {HF name: numpy array after the update}); other ranks too (the
    metrics are identical, the weights empty). `recompute`: models.builder.Recompute's fields."""
    from megatron_grpo.config import load_config
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.models.builder import Recompute
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.batches.micro_batches import plan_micro_batches
    from megatron_grpo.trainer.step_settings import global_batch_info, grpo_loss_config
    from megatron_grpo.trainer.step.train_step import train_on_mini_batch

    cfg = load_config("tiny_cpu", [f"parallel.sequence_parallel={parallel.get('sequence_parallel', False)}",
                                   f"parallel.tensor={parallel.get('tensor', 1)}", "rollout.n=4",
                                   "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                                   "actor.max_tokens_per_micro_batch=48", "actor.entropy_coeff=0.01",
                                   *overrides])
    layout = ParallelLayout(**parallel)
    initialize_model_parallel(layout, seed=1)
    mc = ModelArchitecture.from_hf(policy_path, tensor_parallel=layout.tensor, vocab_multiple=8)
    chunks = build_model(mc, layout, recompute=Recompute(**(recompute or {})))
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
    metrics["micro_batches"] = len(micro_batches)
    return metrics, weights


class SingleProcessSteps:
    """Tiny model name -> (policy folder, samples, overrides, the single process's first step), each
    run once (a module fixture holds one): 32 sequences of 4 prompts x 8, rollout.n=8 (with 16, one
    of glm4_moe's 16 experts got no token and no update)."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory, self.done = tmp_path_factory, {}

    def __call__(self, family: str):
        from megatron_grpo.models.tiny import TINY_CONFIGS, save_tiny_hf_model
        from megatron_grpo.testing.distributed import run_distributed

        if family not in self.done:
            folder = self.tmp_path_factory.mktemp(f"step_{family}") / "policy"
            policy = str(save_tiny_hf_model(family, folder, seed=3))
            samples, n8 = uneven_samples(32, TINY_CONFIGS[family]["vocab_size"]), ("rollout.n=8",)
            single = run_distributed(first_step, 1, args=(policy, {}, samples, n8), timeout=300)[0]
            self.done[family] = policy, samples, n8, single
        return self.done[family]


def relative_difference(a, b) -> float:
    """max |a - b| over max |b| (float64)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def compare_updates(policy_path: str, weights: dict, ref_weights: dict, tolerance: float,
                    frozen: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(worst relative difference, allowed) per HF tensor's update (after minus the HF file's
    before): the tolerance plus 2 ulp of the tensor's largest |w| over its largest update. Tensors
    whose names end with one of `frozen` (not trained, e.g. GLM-4.5's e_score_correction_bias) must
    come back bitwise unchanged in both instead."""
    from safetensors.torch import load_file

    assert sorted(weights) == sorted(ref_weights)
    before = {name: tensor.numpy() for name, tensor in load_file(f"{policy_path}/model.safetensors").items()}
    worst, allowed = {}, {}
    for name in ref_weights:
        if frozen and name.endswith(frozen):
            assert np.array_equal(weights[name], before[name]) and np.array_equal(ref_weights[name], before[name]), \
                f"{name} is frozen but changed"
            continue
        ref_update = ref_weights[name] - before[name]
        assert np.abs(ref_update).max() > 1e-4, f"{name} did not move"
        rounding = 2 * FP32_EPS * np.abs(before[name]).max() / np.abs(ref_update).max()
        worst[f"update {name}"] = relative_difference(weights[name] - before[name], ref_update)
        allowed[f"update {name}"] = tolerance + rounding
    return worst, allowed


STEP_METRICS = ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm")


def check_step_equals_single(label: str, step: tuple, single: tuple, policy_path: str, tolerance: float,
                             metrics: tuple[str, ...] = STEP_METRICS, frozen: tuple[str, ...] = ()) -> None:
    """A parallel first step ((metrics, weights) of first_step's rank 0) against the single process's:
    each metric within `tolerance` relative, each tensor's update within compare_updates' allowance;
    prints the three worst."""
    worst = {key: relative_difference(step[0][key], single[0][key]) for key in metrics}
    update_worst, allowed = compare_updates(policy_path, step[1], single[1], tolerance, frozen=frozen)
    worst.update(update_worst)
    print(label, {k: f"{v:.1e} of {allowed.get(k, tolerance):.1e}"
                  for k, v in sorted(worst.items(), key=lambda kv: -kv[1])[:3]})
    bad = {k: v for k, v in worst.items() if v > allowed.get(k, tolerance)}
    assert not bad, f"{label}: differs from the single process beyond {tolerance:.0e}: {bad}"
