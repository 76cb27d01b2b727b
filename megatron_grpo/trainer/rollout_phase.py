"""Rollout, rewards and group advantages for one step (run on global rank 0, then broadcast).

With DAPO dynamic sampling on, groups whose rewards all agree carry no signal and are dropped;
more prompts are generated until the batch holds `train_batch_size` informative groups (or the
generation-round limit is hit, which stops the run with a clear message).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from megatron_grpo.algo import AdvantageConfig, compute_advantages, filter_zero_variance_groups
from megatron_grpo.data.prompts import EncodedPrompt
from megatron_grpo.errors import MegatronGRPOError
from megatron_grpo.launch.cpu import cuda_redirect_paused
from megatron_grpo.rewards.runner import RewardRequest, RewardRunner
from megatron_grpo.rollout.engine import RolloutEngine
from megatron_grpo.rollout.types import GenerationRequest, Sample, SamplingParams
from megatron_grpo.trainer.batching import TrainSample


@dataclass(frozen=True)
class RolloutSettings:
    n: int
    sampling: SamplingParams
    adv_estimator: str
    advantage_config: AdvantageConfig
    filter_groups: bool = False
    max_generation_rounds: int = 0  # 0 = no limit


@dataclass
class RolloutBatch:
    samples: list[TrainSample]
    metrics: dict[str, float] = field(default_factory=dict)


def collect_rollout_batch(engine: RolloutEngine, next_prompts, tokenizer, rewards: RewardRunner,
                          settings: RolloutSettings, step: int, num_prompts: int) -> RolloutBatch:
    """Generates, scores and computes advantages for `num_prompts` prompt groups."""
    kept_samples: list[Sample] = []
    kept_scores: list[float] = []
    metrics: dict[str, float] = {}
    timings = {"time/rollout": 0.0, "time/reward": 0.0}
    rounds = 0
    first_round_stats: dict[str, float] | None = None
    while len(kept_samples) < num_prompts * settings.n:
        rounds += 1
        if settings.max_generation_rounds and rounds > settings.max_generation_rounds:
            raise MegatronGRPOError(
                f"dynamic sampling: only {len(kept_samples) // settings.n} of {num_prompts} prompt groups had "
                f"non-zero reward variance after {settings.max_generation_rounds} generation rounds "
                f"(algorithm.filter_groups.max_num_gen_batches); the task may be too easy or too hard")
        prompts: list[EncodedPrompt] = next_prompts()
        start = time.perf_counter()
        requests = [GenerationRequest(prompt_ids=p.input_ids, sampling=_seeded(settings.sampling, step, rounds, i),
                                      group_id=f"{step}:{rounds}:{i}") for i, p in enumerate(prompts)]
        with cuda_redirect_paused():  # the local HF engine needs no megatron CPU shims
            samples = engine.generate(requests)
        timings["time/rollout"] += time.perf_counter() - start

        start = time.perf_counter()
        by_group = {f"{step}:{rounds}:{i}": p for i, p in enumerate(prompts)}
        result = rewards.score([reward_request(s, by_group[s.group_id], tokenizer) for s in samples])
        timings["time/reward"] += time.perf_counter() - start
        scores = torch.tensor(result.scores, dtype=torch.float64)
        if first_round_stats is None:
            first_round_stats = _reward_stats(scores, [s.group_id for s in samples], settings.n)
            metrics.update({k: v for k, v in result.metrics.items()})
            metrics.update(_response_stats(samples, settings.sampling.max_new_tokens))
        if settings.filter_groups:
            keep = filter_zero_variance_groups(scores, [s.group_id for s in samples]).keep.tolist()
        else:
            keep = [True] * len(samples)
        for sample, score, kept in zip(samples, result.scores, keep):
            if kept:
                kept_samples.append(sample)
                kept_scores.append(score)
    # Over-sampling may overshoot: keep whole groups up to the batch size.
    kept_samples = kept_samples[: num_prompts * settings.n]
    kept_scores = kept_scores[: num_prompts * settings.n]
    scores = torch.tensor(kept_scores, dtype=torch.float64)
    group_ids = [s.group_id for s in kept_samples]
    advantages = compute_advantages(settings.adv_estimator, scores, group_ids, config=settings.advantage_config)
    metrics.update(first_round_stats or {})
    metrics.update(timings)
    metrics["rollout/generation_rounds"] = float(rounds)
    # Which policy sampled the batch: every sample of step k comes from weights version k - 1.
    metrics["rollout/weight_version_min"] = float(min(s.weight_version for s in kept_samples))
    metrics["rollout/weight_version_max"] = float(max(s.weight_version for s in kept_samples))
    metrics["advantage/mean"] = float(advantages.mean())
    metrics["advantage/std"] = float(advantages.std()) if len(advantages) > 1 else 0.0
    metrics["advantage/max"] = float(advantages.max())
    metrics["advantage/min"] = float(advantages.min())
    train_samples = [TrainSample(prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids),
                                 advantage=float(a), rollout_logprobs=list(s.logprobs))
                     for s, a in zip(kept_samples, advantages.tolist())]
    return RolloutBatch(samples=train_samples, metrics=metrics)


def _seeded(sampling: SamplingParams, step: int, round_index: int, prompt_index: int) -> SamplingParams:
    """A reproducible seed per (step, round, prompt): reruns and resumed runs sample the same."""
    seed = (0 if sampling.seed is None else sampling.seed) * 1_000_003 + step * 10_007 + round_index * 101 + prompt_index
    return dataclasses.replace(sampling, seed=seed)


def reward_request(sample: Sample, prompt: EncodedPrompt, tokenizer) -> RewardRequest:
    """What the reward function sees of one sample, in training and in eval alike."""
    response = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return RewardRequest(prompt=prompt.text, response=response, ground_truth=prompt.record.ground_truth,
                         extra=dict(prompt.record.extra_info, data_source=prompt.record.data_source))


def _reward_stats(scores: torch.Tensor, group_ids: list[str], n: int) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for gid, score in zip(group_ids, scores.tolist()):
        groups.setdefault(gid, []).append(score)
    group_stds = [torch.tensor(v).std().item() if len(v) > 1 else 0.0 for v in groups.values()]
    return {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "reward/group_std_mean": sum(group_stds) / len(group_stds),
        "reward/zero_variance_group_frac": sum(1 for v in groups.values() if max(v) == min(v)) / len(groups),
    }


def _response_stats(samples: list[Sample], max_new_tokens: int) -> dict[str, float]:
    lengths = [len(s.response_ids) for s in samples]
    return {
        "response/length_mean": sum(lengths) / len(lengths),
        "response/length_max": float(max(lengths)),
        "response/truncation_ratio": sum(1 for s in samples if s.finish_reason == "length") / len(samples),
    }

