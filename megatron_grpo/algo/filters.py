"""DAPO dynamic sampling: find prompt groups whose rewards all agree (zero variance, zero GRPO signal)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_grpo.algo.groups import GroupIds, make_group_index


@dataclass(frozen=True)
class GroupFilterResult:
    keep: torch.Tensor  # [B] bool: the sample belongs to a kept group
    num_kept_groups: int
    num_dropped_groups: int
    num_kept_samples: int


def filter_zero_variance_groups(scores: torch.Tensor, group_ids: GroupIds,
                                keep_singletons: bool = True) -> GroupFilterResult:
    """Drops groups whose scores are all equal (max == min exactly).

    One-sample groups are kept by default, as verl's DAPO trainer does (`std > 0 or len == 1`):
    their GRPO advantage r/(1+eps) is not zero. The trainer drops the rest and samples more prompts.
    """
    if scores.dim() != 1 or len(group_ids) != scores.shape[0]:
        raise ValueError(f"scores must be [B] with one group id each; got shape {tuple(scores.shape)} "
                         f"and {len(group_ids)} ids")
    groups = make_group_index(group_ids, device=scores.device)
    varies = groups.group_amax(scores) > groups.group_amin(scores)
    if keep_singletons:
        varies = varies | (groups.counts == 1)
    keep = groups.expand(varies)
    num_kept = int(varies.sum().item())
    return GroupFilterResult(keep=keep, num_kept_groups=num_kept, num_dropped_groups=groups.num_groups - num_kept,
                             num_kept_samples=int(keep.sum().item()))
