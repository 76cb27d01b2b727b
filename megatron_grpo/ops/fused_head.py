"""Output layer + vocab-parallel log-probs (and entropy) in one pass, chunk by chunk over tokens.

    logits = hidden @ weight.T    hidden [..., H] (full sequence, replicated over TP), weight [V/tp, H]

is never materialised for all tokens: each chunk of `chunk_size` rows computes its logits shard,
folds it into the per-token statistics of ops.vocab_parallel and is dropped; the backward
recomputes the chunk's logits, forms its logit gradient (in the hidden dtype, as the unfused
backward would) and accumulates
    grad_hidden[chunk] = grad_logits @ weight            (all_reduced over TP at the end, as
                                                          megatron's ColumnParallelLinear does)
    grad_weight       += grad_logits.T @ hidden[chunk]    (fp32 accumulator, cast at the end)
Peak memory is therefore the inputs, their gradients, the fp32 weight-grad accumulator and one
chunk of logits, independent of the number of tokens.

`fused_head_support_logprobs(_and_entropy)` do the same for sampling-support replay
(ops.support_logprobs): each chunk's logits are computed in full (in the hidden dtype), only the
support columns are gathered and upcast, and the logit gradient is scattered into those columns of
a zero chunk before the same two matmuls.

Not handled here: sequence parallelism (hidden must be the full sequence on every TP rank) and an
output-layer bias (GPT output layers have none).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.ops.vocab_parallel import (
    CPU_CHUNK_ELEMENTS, CUDA_CHUNK_ELEMENTS, _prepare_upstream, accumulate_chunk_stats, chunk_grad,
    VocabShard, combine_stats, default_chunk_size, empty_stats, flatten_ignored, local_targets_and_ownership,
    outputs_from_stats, resolve_vocab_shard, scaled_chunk)
from megatron_grpo.ops.support_logprobs import SupportBatch, prepare_support, shaped, support_forward

# The head's matmuls want more rows per chunk than the softmax alone (a small chunk re-reads the
# whole weight shard for few tokens), so its default chunk is 16x the vocab_parallel one.
FUSED_CHUNK_FACTOR = 16


def _chunk_logits(hidden_chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden_chunk @ weight.t()


class _FusedHeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignored, temperature, shard, chunk_size, with_entropy):
        h = hidden.reshape(-1, hidden.shape[-1])
        n = h.shape[0]
        local, owned = local_targets_and_ownership(targets.reshape(-1), ignored, shard)
        stats = empty_stats(n, h.device, with_entropy)
        if shard.valid > 0:
            buffer = torch.empty(min(chunk_size, max(n, 1)), shard.local_size, dtype=torch.float32, device=h.device)
            for r0 in range(0, n, chunk_size):
                rows = slice(r0, min(r0 + chunk_size, n))
                z = scaled_chunk(_chunk_logits(h[rows], weight), shard, temperature, buffer)
                accumulate_chunk_stats(z, rows, local, owned, stats)
            del buffer
        stats = combine_stats(stats, shard)
        logp, lse, entropy, mean_z = outputs_from_stats(stats, ignored)
        ctx.save_for_backward(hidden, weight, local, owned, ignored, lse, mean_z)
        ctx.meta = (temperature, shard, chunk_size)
        shape = targets.shape
        if with_entropy:
            return logp.view(shape), entropy.view(shape)
        return logp.view(shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, local, owned, ignored, lse, mean_z = ctx.saved_tensors
        temperature, shard, chunk_size = ctx.meta
        g_lp, g_h = _prepare_upstream(grad_logp, grad_entropy, ignored, temperature, lse)
        h = hidden.reshape(-1, hidden.shape[-1])
        n = h.shape[0]
        grad_hidden, grad_weight = _zero_head_grads(h, weight, ctx.needs_input_grad)
        if shard.valid > 0:
            buffer = torch.empty(min(chunk_size, max(n, 1)), shard.local_size, dtype=torch.float32, device=h.device)
            grad_logits = torch.zeros(buffer.shape, dtype=hidden.dtype, device=h.device)  # padded columns stay 0
            for r0 in range(0, n, chunk_size):
                rows = slice(r0, min(r0 + chunk_size, n))
                z = scaled_chunk(_chunk_logits(h[rows], weight), shard, temperature, buffer)
                g = grad_logits[: rows.stop - rows.start]
                g[:, : shard.valid] = chunk_grad(z, rows, lse, mean_z, g_lp, g_h, local, owned)
                _accumulate_head_grads(g, h, weight, rows, grad_hidden, grad_weight)
        return (*_finish_head_grads(grad_hidden, grad_weight, hidden, weight, shard), None, None, None, None, None,
                None)


def _zero_head_grads(h: torch.Tensor, weight: torch.Tensor,
                     needs_input_grad: tuple[bool, ...]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """grad_hidden [N, H] in the hidden dtype, grad_weight as an fp32 accumulator; None if not wanted."""
    grad_hidden = torch.zeros(h.shape, dtype=h.dtype, device=h.device) if needs_input_grad[0] else None
    grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_input_grad[1]
                   else None)
    return grad_hidden, grad_weight


def _accumulate_head_grads(grad_logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rows: slice,
                           grad_hidden: Optional[torch.Tensor], grad_weight: Optional[torch.Tensor]) -> None:
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        grad_weight += grad_logits.t() @ h[rows]


def _finish_head_grads(grad_hidden: Optional[torch.Tensor], grad_weight: Optional[torch.Tensor],
                       hidden: torch.Tensor, weight: torch.Tensor,
                       shard: VocabShard) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if grad_hidden is not None:
        if shard.group is not None:
            dist.all_reduce(grad_hidden, group=shard.group)  # hidden is replicated over the TP group
        grad_hidden = grad_hidden.view(hidden.shape)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight


def _check_head_args(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be targets {tuple(targets.shape)} + [H]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V/tp, H={hidden.shape[-1]}]")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _head_chunk_size(chunk_size: Optional[int], shard: VocabShard, device: torch.device) -> int:
    if chunk_size is None:
        elements = (CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CPU_CHUNK_ELEMENTS) * FUSED_CHUNK_FACTOR
        chunk_size = default_chunk_size(shard.local_size, device, elements)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def _run(hidden, weight, targets, temperature, vocab_size, ignore_mask, ignore_index, tp_group, chunk_size,
         with_entropy):
    _check_head_args(hidden, weight, targets, temperature)
    shard = resolve_vocab_shard(weight.shape[0], vocab_size, tp_group)
    ignored = flatten_ignored(targets, ignore_mask, ignore_index,
                              shard.local_size * shard.world_size if vocab_size is None else vocab_size)
    chunk_size = _head_chunk_size(chunk_size, shard, hidden.device)
    return _FusedHeadLogProbs.apply(hidden, weight, targets, ignored, float(temperature), shard, int(chunk_size),
                                    with_entropy)


def fused_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                        temperature: float = 1.0, vocab_size: Optional[int] = None,
                        ignore_mask: Optional[torch.Tensor] = None, ignore_index: int = -100,
                        tp_group: Optional[dist.ProcessGroup] = None,
                        chunk_size: Optional[int] = None) -> torch.Tensor:
    """log softmax((hidden @ weight.T) / temperature)[target], fp32, shape of targets, without
    materialising the logits of all tokens. hidden [..., H], weight [V/tp, H] this rank's shard;
    other arguments as ops.vocab_parallel.vocab_parallel_logprobs. Grads flow to hidden and weight."""
    return _run(hidden, weight, targets, temperature, vocab_size, ignore_mask, ignore_index, tp_group,
                chunk_size, False)


def fused_head_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                    temperature: float = 1.0, vocab_size: Optional[int] = None,
                                    ignore_mask: Optional[torch.Tensor] = None, ignore_index: int = -100,
                                    tp_group: Optional[dist.ProcessGroup] = None,
                                    chunk_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy), both differentiable; arguments as `fused_head_logprobs`."""
    return _run(hidden, weight, targets, temperature, vocab_size, ignore_mask, ignore_index, tp_group,
                chunk_size, True)


class _FusedHeadSupportLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, support, ignored, temperature, shard, chunk_size, with_entropy):
        h = hidden.reshape(-1, hidden.shape[-1])
        batch = SupportBatch.of(targets, support, ignored, shard, temperature, chunk_size)
        logp, lse, entropy, mean_z = support_forward(batch, lambda rows: _chunk_logits(h[rows], weight), h.shape[0],
                                                     h.device, with_entropy)
        ctx.save_for_backward(hidden, weight, batch.support, batch.targets, ignored, lse, mean_z)
        ctx.meta = (shard, temperature, chunk_size)  # SupportBatch's order
        return shaped(logp, entropy, targets.shape, with_entropy)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, support, targets, ignored, lse, mean_z = ctx.saved_tensors
        batch = SupportBatch(support, targets, ignored, *ctx.meta)
        g_lp, g_h = _prepare_upstream(grad_logp, grad_entropy, ignored, batch.temperature, lse)
        h = hidden.reshape(-1, hidden.shape[-1])
        grad_hidden, grad_weight = _zero_head_grads(h, weight, ctx.needs_input_grad)
        chunks = batch.chunks()
        if chunks:
            grad_logits = torch.empty(min(batch.chunk_size, h.shape[0]), batch.shard.local_size, dtype=hidden.dtype,
                                      device=h.device)
        for rows in chunks:
            g = grad_logits[: rows.stop - rows.start].zero_()  # only the support columns get a gradient
            batch.add_grad(_chunk_logits(h[rows], weight), rows, lse, mean_z, g_lp, g_h, g)
            _accumulate_head_grads(g, h, weight, rows, grad_hidden, grad_weight)
        return (*_finish_head_grads(grad_hidden, grad_weight, hidden, weight, batch.shard), None, None, None, None,
                None, None, None)


def _run_support(hidden, weight, targets, support, temperature, vocab_size, ignore_mask, ignore_index, tp_group,
                 chunk_size, with_entropy):
    _check_head_args(hidden, weight, targets, temperature)
    shard = resolve_vocab_shard(weight.shape[0], vocab_size, tp_group)
    chunk_size = _head_chunk_size(chunk_size, shard, hidden.device)
    ignored = prepare_support(targets, support, ignore_mask, ignore_index, vocab_size, shard, chunk_size)
    return _FusedHeadSupportLogProbs.apply(hidden, weight, targets, support, ignored, float(temperature), shard,
                                           chunk_size, with_entropy)


def fused_head_support_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                support: torch.Tensor, *, temperature: float = 1.0, vocab_size: Optional[int] = None,
                                ignore_mask: Optional[torch.Tensor] = None, ignore_index: int = -100,
                                tp_group: Optional[dist.ProcessGroup] = None,
                                chunk_size: Optional[int] = None) -> torch.Tensor:
    """log p(target) under softmax((hidden @ weight.T) / temperature) renormalised over each token's
    support (ops.support_logprobs), without materialising the logits of all tokens. support:
    integer [..., K] global ids padded with -1; other arguments as `fused_head_logprobs`."""
    return _run_support(hidden, weight, targets, support, temperature, vocab_size, ignore_mask, ignore_index,
                        tp_group, chunk_size, False)


def fused_head_support_logprobs_and_entropy(
        hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, support: torch.Tensor, *,
        temperature: float = 1.0, vocab_size: Optional[int] = None, ignore_mask: Optional[torch.Tensor] = None,
        ignore_index: int = -100, tp_group: Optional[dist.ProcessGroup] = None,
        chunk_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of the truncated distribution, both differentiable; arguments as
    `fused_head_support_logprobs`."""
    return _run_support(hidden, weight, targets, support, temperature, vocab_size, ignore_mask, ignore_index,
                        tp_group, chunk_size, True)
