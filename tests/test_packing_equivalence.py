"""A packed step equals the padded step (trainer/batches/micro_batches.py, ops/varlen_attention.py).

The same batch of very uneven sequences (2 to 48 tokens: prompts of 1..16, responses of 1..32)
goes through the trainer's own pieces twice from the same weights, padded and packed, at
single process, TP2xPP2, TP2xDP2, CP2xTP2 (+ sequence parallel) and CP2xDP2 (the TP2xPP2 and
CP2xTP2 batches with sampling supports: every pass over the support, as sampling replay does): the reference
log-prob pass (its own token budget, ref.max_tokens_per_micro_batch), the old-log-prob pass of
the second mini-batch (actor.logprob_max_tokens_per_micro_batch), then two updates (loss with KL
and entropy terms). Compared: every sample's reference log-probs, each update's loss / policy loss
/ entropy / KL / grad norm, and every weight after the two updates.

Tolerance. Both layouts run the same fp32 operations on the same values; only the lengths of
some reductions differ (attention over a sequence vs over a padded row, the log-softmax chunks, the
sums of the loss), so the results differ by fp32 rounding: a few units of fp32's epsilon (1.19e-7)
relative. We allow 8 eps (9.5e-7, under the issue's 1e-6) relative to each quantity's scale: its
magnitude (the largest element for tensors); for the total loss, a sum of terms of both signs, the
sum of its terms' magnitudes. Advantages are positive so that the policy loss is a sum of terms of
one sign (its magnitude is then the scale of its rounding). Measured: at most 5e-7 (the -s output
prints the largest relative differences of each layout).
Adam's first step divides by |g| + eps and turns rounding noise on near-zero gradients into
full-size sign(g) updates, so the optimizer here uses eps = 1 (the update is then smooth in g,
about lr * g / (|g| + 1)) and the weights compare like the gradients they came from.
"""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed

FP32_EPS = float(torch.finfo(torch.float32).eps)
TOLERANCE = 8 * FP32_EPS
METRICS = ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm")
KL_COEF, ENTROPY_COEF = 0.5, 0.01


def uneven_samples(count: int, vocab: int, seed: int = 0, supports: bool = False):
    """Sequences from 2 to 48 tokens, the extremes included; with `supports`, each response token
    has a sampling support of 1 to 40 ids around it (sampling replay: log-probs over the support)."""
    from megatron_grpo.trainer.batches.batching import TrainSample

    rng = random.Random(seed)
    shapes = [(1, 1), (16, 32), (1, 32), (16, 1)] + [(rng.randint(1, 16), rng.randint(1, 32)) for _ in range(count - 4)]
    rng.shuffle(shapes)
    samples = [TrainSample(prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                           response_ids=[rng.randrange(vocab) for _ in range(r)],
                           advantage=rng.uniform(0.25, 1.5),
                           rollout_logprobs=[-rng.uniform(0.1, 6.0) for _ in range(r)]) for p, r in shapes]
    if supports:
        support_rng = random.Random(seed + 1)
        for sample in samples:
            sample.sampling_support = [sorted({token, *support_rng.sample(range(vocab), support_rng.randint(0, 39))})
                                       for token in sample.response_ids]
    return samples


def _packed_and_padded(rank, world_size, policy_path, ref_path, parallel, overrides, samples):
    import dataclasses

    from megatron_grpo.config import load_config
    from megatron_grpo.convert import export_hf_weights, load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model, build_reference_model
    from megatron_grpo.trainer.step_settings import global_batch_info, grpo_loss_config
    from megatron_grpo.trainer.batches.micro_batches import padding_metrics, plan_micro_batches
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.step.train_step import fill_logprobs, train_on_mini_batch

    cfg = load_config("tiny_cpu", [f"parallel.{key}={value}" for key, value in parallel.items()] + [
        "rollout.n=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "data.max_prompt_length=16",
        "data.max_response_length=32", "actor.max_tokens_per_micro_batch=64", "ref.max_tokens_per_micro_batch=160",
        "actor.logprob_max_tokens_per_micro_batch=96", "actor.use_kl_loss=true", f"actor.kl_loss_coef={KL_COEF}",
        "actor.kl_loss_type=low_var_kl", f"actor.entropy_coeff={ENTROPY_COEF}", "actor.tis_cap=2.0", *overrides])
    layout = ParallelLayout(**parallel)
    initialize_model_parallel(layout, seed=1)
    mc = ModelArchitecture.from_hf(policy_path, tensor_parallel=layout.tensor, vocab_multiple=8)
    cpu = torch.device("cpu")
    out = {}
    for packing in (False, True):
        run_cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, packing=packing))
        chunks = build_model(mc, layout)
        load_hf_weights(chunks, mc, policy_path)
        policy = wrap_with_ddp(chunks, use_distributed_optimizer=True)
        optimizer, _ = build_optimizer(policy, OptimizerSettings(lr=1e-2, eps=1.0, grad_clip=1.0,
                                                                 use_distributed_optimizer=True))
        reference = build_reference_model(mc, layout)
        load_hf_weights(reference, mc, ref_path)
        batch = copy.deepcopy(samples)
        kwargs = dict(model_config=mc, temperature=1.0, device=cpu)
        fill_logprobs(reference, batch, run_cfg, "ref_logprobs", **kwargs)
        ref_logprobs = {i: s.ref_logprobs for i, s in enumerate(batch) if s.ref_logprobs is not None}
        mini_batches = plan_micro_batches(batch, run_cfg, model_config=mc)
        updates = []
        for number, micro_batches in enumerate(mini_batches):
            if number == 1:  # after the first update: the second mini-batch's old log-probs
                fill_logprobs(policy, batch, run_cfg, "old_logprobs", skip_mini_batches=1, **kwargs)
                micro_batches = plan_micro_batches(batch, run_cfg, model_config=mc, skip_mini_batches=1)[0]
            updates.append(train_on_mini_batch(policy, optimizer, micro_batches, loss_config=grpo_loss_config(run_cfg),
                                               batch_info=global_batch_info(micro_batches, run_cfg), temperature=1.0,
                                               vocab_size=mc.vocab_size, device=cpu, need_entropy=True))
        weights = {name: tensor.numpy().copy() for name, tensor in export_hf_weights(chunks, mc)}
        out[packing] = dict(updates=updates, weights=weights, ref_logprobs=ref_logprobs,
                            padding=padding_metrics(mini_batches))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packing")
    return (str(save_tiny_hf_model("qwen3", folder / "policy", seed=3)),
            str(save_tiny_hf_model("qwen3", folder / "reference", seed=4)))


def _rel(a, b, scale=None) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.abs(b).max() if scale is None else scale
    return float(np.abs(a - b).max() / max(scale, 1e-30))


def _scale(update: dict, key: str) -> float:
    if key == "actor/loss":  # pg + coef * kl - coef * entropy
        return (abs(update["actor/pg_loss"]) + KL_COEF * abs(update["actor/kl_loss"])
                + ENTROPY_COEF * abs(update["actor/entropy"]))
    return abs(update[key])


def check_packed_equals_padded(results, label: str) -> None:
    worst: dict[str, float] = {}
    merged = {packing: {} for packing in (False, True)}
    for rank_result in results:
        for packing in (False, True):
            merged[packing].update(rank_result[packing]["weights"])
    padded, packed = results[0][False], results[0][True]
    assert packed["padding"]["perf/useful_token_frac"] > padded["padding"]["perf/useful_token_frac"]
    # the first mini-batch's ratio is exactly 1 (old = detached current log-probs)
    assert packed["updates"][0]["actor/ratio_max_abs_dev"] == 0.0
    for number, (a, b) in enumerate(zip(packed["updates"], padded["updates"])):
        for key in METRICS:
            worst[f"{key}[{number}]"] = _rel(a[key], b[key], _scale(b, key))
    ref_a = {i: v for r in results for i, v in r[True]["ref_logprobs"].items()}
    ref_b = {i: v for r in results for i, v in r[False]["ref_logprobs"].items()}
    assert sorted(ref_a) == sorted(ref_b) and ref_a
    worst["ref_logprobs"] = _rel(np.concatenate([ref_a[i] for i in sorted(ref_a)]),
                                 np.concatenate([ref_b[i] for i in sorted(ref_b)]))
    assert sorted(merged[True]) == sorted(merged[False])
    for name in merged[False]:
        worst[f"weight {name}"] = _rel(merged[True][name], merged[False][name])
    print(label, {k: f"{v:.1e}" for k, v in sorted(worst.items(), key=lambda kv: -kv[1])[:6]})
    bad = {k: v for k, v in worst.items() if v > TOLERANCE}
    assert not bad, f"{label}: packed differs from padded beyond {TOLERANCE:.2e}: {bad}"


# (parallel layout, overrides, sampling supports): the supports make every log-prob pass the
# sampling-replay one (ops/support_logprobs.py), at a pipeline and at a context-parallel layout.
LAYOUTS = {
    "single": (dict(), [], False),
    "tp2-pp2-replay": (dict(tensor=2, pipeline=2), ["actor.loss_agg_mode=seq-mean-token-sum-norm"], True),
    "tp2-dp2": (dict(tensor=2), [], False),
    "cp2-tp2-sp-replay": (dict(context=2, tensor=2, sequence_parallel=True),
                          ["actor.loss_agg_mode=seq-mean-token-mean"], True),
    "cp2-dp2": (dict(context=2), ["actor.loss_agg_mode=seq-mean-token-mean"], False),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_step_equals_padded_step(models, layout):
    parallel, overrides, supports = LAYOUTS[layout]
    world_size = 1 if not parallel else 4
    samples = uneven_samples(16, vocab=250, supports=supports)
    results = run_distributed(_packed_and_padded, world_size, args=(*models, parallel, overrides, samples),
                              timeout=600)
    check_packed_equals_padded(results, layout)
