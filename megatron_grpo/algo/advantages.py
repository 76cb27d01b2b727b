"""Outcome advantages per sequence, grouped by prompt uid (verl 0.9.x semantics), and a registry.

Every estimator maps sequence scores r [B] (e.g. `token_level_rewards.sum(-1)`) to advantages A [B];
`broadcast_to_tokens` turns them into the per-token tensor A[i] * mask[i, t] that the policy loss reads.

    grpo                           A = (r - mean_g) / (std_g + eps), std unbiased (N-1), eps 1e-6;
                                   a one-sample group has mean 0 and std 1 (A = r / (1 + eps)).
    grpo, norm_adv_by_std=False    Dr.GRPO: A = r - mean_g (singleton: A = r).
    rloo                           A = r - mean of the other samples = (r - mean_g) * n / (n - 1);
                                   a singleton keeps A = r (as verl's `rloo`; `rloo_vectorized` gives 0).
    reinforce_plus_plus_baseline   c = r - mean_g (singleton mean 0), then whitened over the valid
                                   tokens of the whole batch: (c - mu) / sqrt(var + 1e-8), var unbiased.

Computed with scatter/index_add in float64 (no Python loop over groups), returned in the scores' dtype.
Add your own with `@register_advantage_estimator("name")`; the function has the signature of `AdvantageFn`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_grpo.algo.groups import GroupIds, GroupIndex, make_group_index
from megatron_grpo.algo.registry import Registry


@dataclass(frozen=True)
class AdvantageConfig:
    norm_adv_by_std: bool = True  # False: Dr.GRPO (verl's algorithm.norm_adv_by_std_in_grpo)
    epsilon: float = 1e-6  # added to the group std (not the variance), as verl
    whiten_epsilon: float = 1e-8  # added to the variance in batch whitening, as verl's masked_whiten


AdvantageFn = Callable[[torch.Tensor, GroupIndex, Optional[torch.Tensor], AdvantageConfig], torch.Tensor]
"""(scores [B] float64, groups, response_mask [B, T] or None, config) -> advantages [B] float64."""

ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def register_advantage_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    return ADVANTAGE_ESTIMATORS.register(name)


def get_advantage_estimator(name: str) -> AdvantageFn:
    return ADVANTAGE_ESTIMATORS.get(name)


def compute_advantages(name: str, scores: torch.Tensor, group_ids: GroupIds,
                       response_mask: Optional[torch.Tensor] = None,
                       config: AdvantageConfig = AdvantageConfig()) -> torch.Tensor:
    """Advantages [B] of the sequences with scores [B], grouped by `group_ids` (LongTensor or hashables)."""
    estimator = get_advantage_estimator(name)
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B] (one scalar per sequence), got shape {tuple(scores.shape)}")
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"{len(group_ids)} group ids for {scores.shape[0]} scores")
    if response_mask is not None and response_mask.shape[0] != scores.shape[0]:
        raise ValueError(f"response_mask has {response_mask.shape[0]} rows for {scores.shape[0]} scores")
    groups = make_group_index(group_ids, device=scores.device)
    out_dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    advantages = estimator(scores.detach().to(torch.float64), groups, response_mask, config)
    return advantages.to(out_dtype)


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: A[i] on the valid tokens of row i, 0 elsewhere."""
    return torch.where(response_mask.bool(), advantages.unsqueeze(-1), torch.zeros((), dtype=advantages.dtype,
                                                                                   device=advantages.device))


def group_mean_std(scores: torch.Tensor, groups: GroupIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and unbiased std; one-sample groups get mean 0 and std 1 (verl)."""
    counts = groups.counts.to(scores.dtype)
    mean = groups.group_sum(scores) / counts
    # Two-pass variance (sum of squared deviations) is exact enough in float64 and never negative.
    squared_dev = groups.group_sum((scores - groups.expand(mean)) ** 2)
    std = (squared_dev / (counts - 1).clamp(min=1)).sqrt()
    singleton = groups.counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    return groups.expand(mean), groups.expand(std)


@register_advantage_estimator("grpo")
def grpo_advantage(scores: torch.Tensor, groups: GroupIndex, response_mask: Optional[torch.Tensor],
                   config: AdvantageConfig) -> torch.Tensor:
    mean, std = group_mean_std(scores, groups)
    if config.norm_adv_by_std:
        return (scores - mean) / (std + config.epsilon)
    return scores - mean


@register_advantage_estimator("rloo")
def rloo_advantage(scores: torch.Tensor, groups: GroupIndex, response_mask: Optional[torch.Tensor],
                   config: AdvantageConfig) -> torch.Tensor:
    n = groups.expand(groups.counts.to(scores.dtype))
    mean = groups.expand(groups.group_sum(scores)) / n
    leave_one_out = (scores - mean) * n / (n - 1).clamp(min=1)
    return torch.where(n > 1, leave_one_out, scores)


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(scores: torch.Tensor, groups: GroupIndex,
                                           response_mask: Optional[torch.Tensor],
                                           config: AdvantageConfig) -> torch.Tensor:
    if response_mask is None:
        raise ValueError("reinforce_plus_plus_baseline whitens over valid tokens: pass response_mask")
    mean, _ = group_mean_std(scores, groups)
    centred = scores - mean
    # Every valid token of row i carries centred[i]: token statistics are row statistics weighted by length.
    lengths = response_mask.bool().sum(-1).to(scores.dtype)
    num_tokens = lengths.sum()
    if num_tokens < 2:
        raise ValueError(f"reinforce_plus_plus_baseline needs at least 2 valid tokens to whiten, got "
                         f"{int(num_tokens)}")
    mu = (lengths * centred).sum() / num_tokens
    var = (lengths * (centred - mu) ** 2).sum() / (num_tokens - 1)
    whitened = (centred - mu) * torch.rsqrt(var + config.whiten_epsilon)
    return torch.where(lengths > 0, whitened, torch.zeros_like(whitened))  # empty rows have no tokens
