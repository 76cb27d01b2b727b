"""all_gather_sequence: the context-parallel all-gather along the sequence, autograd-correct (used by
ops/context_parallel.py and ops/varlen_attention.py, which both import it from here)."""
from __future__ import annotations

import torch
import torch.distributed as dist


class _AllGatherSequence(torch.autograd.Function):
    """all_gather along dim 0 over a group; backward sums the gradient over the group and returns
    this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group):
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(grad.chunk(size, dim=0)[rank])
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce_scatter
        return grad.chunk(size, dim=0)[rank].contiguous(), None


def all_gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """[s_local, ...] on every rank -> [size * s_local, ...] in rank order (autograd-correct)."""
    return _AllGatherSequence.apply(local, group)
