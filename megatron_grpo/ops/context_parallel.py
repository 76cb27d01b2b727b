"""Context parallelism for megatron-core's local layer spec (no Transformer Engine).

megatron's DotProductAttention asserts context_parallel_size == 1; TE's attention is the only
upstream CP implementation. This module fills the gap with the same sequence layout as
megatron / TE, so batches, RoPE and losses line up with the TE path:

  * the sequence is cut into 2*CP equal chunks and CP rank i holds chunks i and 2*CP-1-i
    (load balancing for causal attention: every rank gets one early and one late chunk);
  * attention all-gathers K and V over the CP group (backward: the K/V gradients are summed over
    the group and each rank keeps its own part), masks causally by GLOBAL positions, and
    supports GQA;
  * split_for_context_parallel / gather_from_context_parallel cut a batch for this rank and put
    per-token outputs (log-probs, losses) back in sequence order;
  * packed rows (THD, PackedSeqParams) are split per sequence the same way, every sequence's
    segment in 2*CP chunks (packed_local_positions, megatron's / TE's thd_get_partitioned_indices);
    their attention is ops.varlen_attention.context_parallel_packed_attention.

Memory is O(s_local * s) per head, fine for CPU tests and moderate lengths; on GPUs TE's ring
attention (model.attention_backend=te) or, for packed rows, torch's varlen_attn over the same
gathered K / V (ops/torch_varlen.py, torch_varlen) is the production path.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_grpo.errors import ConfigError
from megatron_grpo.ops.sequence_gather import all_gather_sequence
from megatron_grpo.ops.varlen_attention import attention_dropout, context_parallel_packed_attention, is_thd


def _group_info(group) -> tuple[int, int]:
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
    return dist.get_rank(group), dist.get_world_size(group)


def local_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions of the tokens CP rank `cp_rank` holds, in its local order."""
    if seq_len % (2 * cp_size):
        raise ConfigError(f"sequence length {seq_len} is not divisible by 2 * context_parallel_size = {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def split_for_context_parallel(tensor: torch.Tensor, seq_dim: int = 1, cp_rank: int | None = None,
                               cp_size: int | None = None, group=None) -> torch.Tensor:
    """This CP rank's part of a full-sequence tensor (input ids, labels, masks, [b, s, ...] by
    default). Rank and size default to megatron's context-parallel group."""
    if cp_rank is None or cp_size is None:
        cp_rank, cp_size = _group_info(group)
    if cp_size == 1:
        return tensor
    index = local_positions(tensor.size(seq_dim), cp_rank, cp_size, tensor.device)
    return tensor.index_select(seq_dim, index)


def packed_local_positions(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Positions of a packed row that CP rank `cp_rank` holds, in its local order: for every
    segment [cu[i], cu[i+1]) (a multiple of 2*CP long) its chunks cp_rank and 2*CP-1-cp_rank."""
    bounds = cu_seqlens_padded.tolist()
    parts = []
    for start, end in zip(bounds, bounds[1:]):
        if (end - start) % (2 * cp_size):
            raise ConfigError(f"packed segment of {end - start} tokens is not divisible by 2 * "
                              f"context_parallel_size = {2 * cp_size}")
        parts.append(start + local_positions(end - start, cp_rank, cp_size))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def split_packed_for_context_parallel(tensor: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_rank: int,
                                      cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's part of a packed full-row tensor ([1, T, ...] by default)."""
    if cp_size == 1:
        return tensor
    index = packed_local_positions(cu_seqlens_padded, cp_rank, cp_size).to(tensor.device)
    return tensor.index_select(seq_dim, index)


def gather_packed_from_context_parallel(tensor: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                                        seq_dim: int = 1, group=None) -> torch.Tensor:
    """Inverse of split_packed_for_context_parallel (every rank gets the full row in order)."""
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
    cp_size = dist.get_world_size(group)
    if cp_size == 1:
        return tensor
    moved = tensor.movedim(seq_dim, 0)
    gathered = all_gather_sequence(moved, group)
    positions = torch.cat([packed_local_positions(cu_seqlens_padded, r, cp_size) for r in range(cp_size)])
    order = torch.argsort(positions).to(gathered.device)
    return gathered.index_select(0, order).movedim(0, seq_dim)


def gather_from_context_parallel(tensor: torch.Tensor, seq_dim: int = 1, group=None) -> torch.Tensor:
    """Inverse of split_for_context_parallel: every rank gets the full sequence in order.
    Differentiable (the gradient of each rank's part flows back to that rank)."""
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
    cp_size = dist.get_world_size(group)
    if cp_size == 1:
        return tensor
    moved = tensor.movedim(seq_dim, 0)
    gathered = all_gather_sequence(moved, group)
    positions = torch.cat([local_positions(moved.size(0) * cp_size, r, cp_size) for r in range(cp_size)])
    order = torch.argsort(positions).to(gathered.device)
    return gathered.index_select(0, order).movedim(0, seq_dim)


def _core_attention_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class ContextParallelDotProductAttention(_core_attention_base()):
    """Drop-in core_attention for megatron's local spec (same constructor and forward signature
    as megatron.core.transformer.dot_product_attention.DotProductAttention) that supports CP.
    Inputs are this rank's tokens: query [sq, b, heads/tp, d], key/value [sq, b, groups/tp, d]."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ConfigError(f"context-parallel attention supports causal masks only, got {attn_mask_type}")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ConfigError("context-parallel attention: sliding windows / softmax offsets are not supported")
        if pg_collection is not None and hasattr(pg_collection, "cp"):
            self.cp_group, tp_size = pg_collection.cp, dist.get_world_size(pg_collection.tp)
        else:
            self.cp_group, tp_size = ps.get_context_parallel_group(), ps.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp_size
        self.groups = config.num_query_groups // tp_size
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("context-parallel attention: attention bias needs Transformer Engine")
        from megatron.core import tensor_parallel

        if is_thd(packed_seq_params):
            # megatron's attention squeezed THD inputs to [t, heads, d] (batch dimension 1)
            context = self.packed_attention(query, key, value, packed_seq_params)
            return context.reshape(context.size(0), self.heads * query.size(-1))
        if packed_seq_params is not None:
            raise NotImplementedError(f"context-parallel attention: qkv_format {packed_seq_params.qkv_format!r}")

        cp_rank, cp_size = dist.get_rank(self.cp_group), dist.get_world_size(self.cp_group)
        sq = query.size(0)
        keys = all_gather_sequence(key, self.cp_group)      # [cp*sq, b, g, d], rank order
        values = all_gather_sequence(value, self.cp_group)
        q_pos = local_positions(sq * cp_size, cp_rank, cp_size, query.device)
        k_pos = torch.cat([local_positions(sq * cp_size, r, cp_size, query.device) for r in range(cp_size)])
        masked = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)    # [sq, sk]; True = not attended
        if attention_mask is not None:
            # Caller's extra mask must already be laid out as [b|1, 1, sq_local, sk_global in rank order].
            masked = masked | attention_mask.to(torch.bool)
        if self.heads != self.groups:
            keys = keys.repeat_interleave(self.heads // self.groups, dim=2)
            values = values.repeat_interleave(self.heads // self.groups, dim=2)
        # [b, h, sq, sk]
        scores = torch.einsum("qbhd,kbhd->bhqk", query.float(), keys.float()) * self.softmax_scale
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(query.dtype)
        if self.training and self.dropout.p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
        context = torch.einsum("bhqk,kbhd->qbhd", probs, values)
        return context.reshape(sq, query.size(1), self.heads * query.size(3))


    def packed_attention(self, query, key, value, packed_seq_params):
        """This rank's [t, heads, d] -> [t, heads, d]; ops.torch_varlen's subclass runs torch's varlen_attn."""
        return context_parallel_packed_attention(query, key, value, packed_seq_params, self.softmax_scale,
                                                 self.cp_group, attention_dropout(self, self.dropout))


def _rotary_base():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding


class ContextParallelRotaryEmbedding(_rotary_base()):
    """megatron's RotaryEmbedding, with the per-CP-rank slice done by split_for_context_parallel
    (megatron's version pins host memory, which a CPU-only torch cannot do)."""

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        emb = self.get_emb(max_seq_len, offset)
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and dist.get_world_size(group) > 1 and not packed_seq:
            emb = split_for_context_parallel(emb, seq_dim=0, group=group)
        return emb
