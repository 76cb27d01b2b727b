"""Loss aggregation with GLOBAL denominators, so micro-batches and data-parallel ranks add up exactly.

The mini-batch of one optimizer step is split over D data-parallel ranks and, on each rank, over
K micro-batches (sizes and padded lengths may differ). Let l[i, t] be a per-token loss and m[i, t]
its mask, over all B sequences of the mini-batch. The mini-batch losses (verl 0.9.1 `agg_loss`):

    token-mean               L = sum_{i,t} l m / N                 N  = number of valid tokens
    seq-mean-token-sum       L = sum_i seq_i / S                   seq_i = sum_t l[i,t] m[i,t]
    seq-mean-token-mean      L = sum_i (seq_i / n_i) / S           n_i = sum_t m[i,t]
    seq-mean-token-sum-norm  L = (sum_i seq_i / S) / F             F = loss_scale_factor
                             S = number of sequences with at least one valid token (empty rows add 0)

Each is a sum over sequences of a term that needs only the row itself plus the global constants N, S,
F. So a micro-batch k computes its share c_k = (the same sums over its own rows) / (global constants),
and sum_{ranks r} sum_{k on r} c_k = L exactly (`aggregate` returns c_k).

Gradients. Each rank back-propagates the sum of its micro-batch losses; DDP then AVERAGES gradients
over the D ranks (megatron's DDP scales by 1/D). Back-propagating x_k = c_k * D on every rank gives

    (1/D) sum_r grad(sum_{k on r} c_k * D) = grad(sum_r sum_k c_k) = grad(L).

If the framework also divides the returned loss by some factor q before backward (megatron's
`forward_backward_func` does loss * cp_size / num_microbatches when the loss function returns the
2-tuple (loss, metrics)), back-propagate c_k * D * q instead. `GlobalBatchInfo.backward_scale` is
D * q: set `dp_size` to the size of the group gradients are averaged over and
`framework_loss_divisor` to q (num_microbatches / cp_size for megatron's 2-tuple path, 1 when you
call backward yourself). With context parallelism megatron averages over the DP x CP group, so use
dp_size = dp * cp and q = num_microbatches / cp, or equivalently dp_size = dp and q = num_microbatches.
Do not use megatron's 3-tuple (loss, num_tokens, metrics) path with these losses: it divides by its
own token count. Under CP a sequence is split over ranks: pass `seq_token_counts` (its full length)
for seq-mean-token-mean and count each sequence once in `num_sequences`.

Metrics use the token-mean share sum(x m) / N, so summing them over micro-batches and ranks (an
all-reduce SUM) gives the mini-batch mean.

seq-mean-token-sum-norm: verl 0.8.0.dev computed sum_i seq_i / F (no division by the number of
sequences; its golden 5.25), verl 0.9.1 computes (sum_i seq_i / S) / F (2.625); we follow 0.9.1.
verl's default F is the padded length of the local micro-batch, which differs between micro-batches
and has no global meaning; here F must be given (e.g. max_response_length, as Dr.GRPO prescribes).
seq-mean-token-mean divides by max(n_i, 1) where verl adds 1e-8 (same value to ~1e-8 relative).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_grpo.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_loss_agg_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"unknown loss_agg_mode {mode!r}; valid names: {', '.join(LOSS_AGG_MODES)}")


@dataclass(frozen=True)
class GlobalBatchInfo:
    """Denominators of the whole mini-batch (all micro-batches, all DP ranks), computed once per mini-batch."""

    num_valid_tokens: int
    num_sequences: int  # sequences with at least one valid token
    dp_size: int = 1  # ranks over which DDP averages gradients
    loss_scale_factor: Optional[float] = None  # F of seq-mean-token-sum-norm
    framework_loss_divisor: float = 1.0  # what the framework divides the returned loss by before backward

    def __post_init__(self):
        if self.num_valid_tokens < 0 or self.num_sequences < 0:
            raise ValueError(f"negative counts in {self}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            raise ConfigError(f"loss_scale_factor must be > 0, got {self.loss_scale_factor}")
        if not self.framework_loss_divisor > 0:
            raise ValueError(f"framework_loss_divisor must be > 0, got {self.framework_loss_divisor}")

    @property
    def backward_scale(self) -> float:
        """Multiply a micro-batch's share c_k by this before backward (see the module docstring)."""
        return self.dp_size * self.framework_loss_divisor

    @classmethod
    def from_row_token_counts(cls, row_token_counts: Sequence[torch.Tensor], *, data_parallel: int = 1,
                              context_parallel: int = 1, num_micro_batches: int = 1,
                              loss_scale_factor: Optional[float] = None, process_group=None) -> "GlobalBatchInfo":
        """The denominators of a mini-batch from this rank's micro-batches: per micro-batch, the
        loss-mask token count of each of its rows (whole rows, so context-parallel ranks, which
        hold parts of rows, agree), summed over `process_group` (the data-parallel group) when
        data_parallel > 1. The framework terms are megatron's (the module docstring): DDP averages
        over DP x CP and the schedule divides a 2-tuple loss by num_micro_batches / CP."""
        counts = torch.cat([c.reshape(-1) for c in row_token_counts]).cpu() if row_token_counts else torch.zeros(0)
        totals = torch.tensor([int(counts.sum()), int((counts > 0).sum())], dtype=torch.int64)
        if data_parallel > 1:
            if process_group is None:
                raise ValueError("data_parallel > 1: pass the data-parallel process_group so the counts are global")
            import torch.distributed as dist

            if dist.get_world_size(process_group) != data_parallel:
                raise ValueError(f"process_group has {dist.get_world_size(process_group)} ranks, "
                                 f"data_parallel is {data_parallel}")
            dist.all_reduce(totals, group=process_group)
        return cls(num_valid_tokens=int(totals[0]), num_sequences=int(totals[1]),
                   dp_size=data_parallel * context_parallel, loss_scale_factor=loss_scale_factor,
                   framework_loss_divisor=num_micro_batches / context_parallel)


def token_mean_share(values: torch.Tensor, mask: torch.Tensor, info: GlobalBatchInfo) -> torch.Tensor:
    """sum(values * mask) / N: this micro-batch's share of the mini-batch token mean."""
    masked = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum() / max(info.num_valid_tokens, 1)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, info: GlobalBatchInfo,
              seq_token_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This micro-batch's share c_k of the mini-batch aggregate of `values` [B, T] (see the module docstring).

    Masked positions are excluded with `where`, so garbage (inf, nan) there never reaches the result.
    `seq_token_counts` [B] overrides the local row lengths n_i (needed when a row is split across CP ranks).
    """
    check_loss_agg_mode(mode)
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    if mode == "token-mean":
        return token_mean_share(values, mask, info)
    valid = mask.bool()
    seq = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(-1)
    num_sequences = max(info.num_sequences, 1)
    if mode == "seq-mean-token-sum":
        return seq.sum() / num_sequences
    if mode == "seq-mean-token-mean":
        lengths = valid.sum(-1) if seq_token_counts is None else seq_token_counts
        return (seq / lengths.clamp(min=1).to(seq.dtype)).sum() / num_sequences
    if info.loss_scale_factor is None:
        raise ConfigError("loss_agg_mode seq-mean-token-sum-norm needs loss_scale_factor (a global constant, "
                          "e.g. max_response_length); verl's per-micro-batch padded length is not global")
    return seq.sum() / num_sequences / info.loss_scale_factor
