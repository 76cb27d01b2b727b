"""Group ids (prompt uids) -> a dense index, with vectorised per-group sums."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence, Union

import torch

GroupIds = Union[torch.Tensor, Sequence[Hashable]]


@dataclass(frozen=True)
class GroupIndex:
    """index[i] in [0, num_groups) is the group of sample i; counts[g] is the size of group g."""

    index: torch.Tensor  # [B] int64
    num_groups: int
    counts: torch.Tensor  # [G] int64

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        """[B] -> [G]: the sum of `values` over each group."""
        out = torch.zeros(self.num_groups, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.index, values)

    def group_amax(self, values: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.num_groups, dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(0, self.index, values, reduce="amax", include_self=False)

    def group_amin(self, values: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.num_groups, dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(0, self.index, values, reduce="amin", include_self=False)

    def expand(self, group_values: torch.Tensor) -> torch.Tensor:
        """[G] -> [B]: each sample gets its group's value."""
        return group_values[self.index]


def make_group_index(group_ids: GroupIds, device: torch.device | str | None = None) -> GroupIndex:
    """Dense group index from a LongTensor of ids or a sequence of hashables (str uids, numpy objects)."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.is_floating_point():
            raise ValueError(f"group ids must be a 1-D integer tensor, got {group_ids.dtype} of shape "
                             f"{tuple(group_ids.shape)}")
        _, index = torch.unique(group_ids, return_inverse=True)
        index = index.to(device=device if device is not None else group_ids.device, dtype=torch.long)
    else:
        dense: dict[Hashable, int] = {}
        # One dict lookup per sample (not per-group arithmetic): uids are arbitrary Python objects.
        index = torch.tensor([dense.setdefault(uid, len(dense)) for uid in group_ids], dtype=torch.long,
                             device=device)
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    counts = torch.bincount(index, minlength=num_groups)
    return GroupIndex(index=index, num_groups=num_groups, counts=counts)
