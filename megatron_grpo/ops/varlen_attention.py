"""Variable-length causal attention over packed sequences (megatron's "thd" layout) for
megatron-core's local layer spec, with and without context parallelism.

megatron's local DotProductAttention refuses PackedSeqParams (only Transformer Engine's attention
takes them). Here every sequence of a packed row attends only to itself, causally, so a packed
micro-batch computes what the padded one computes for each sequence, and its cost is
sum_i len_i^2 rather than rows x longest^2:

  * CP = 1 (`packed_causal_attention`): segment i of the row is [cu_padded[i], cu_padded[i+1]);
    its first len_i = cu[i+1] - cu[i] tokens attend causally among themselves, the padding after
    them gets zeros (as Transformer Engine leaves it). Sequences of similar length run together as
    one batched, masked attention call (length_buckets), so many short sequences cost a few
    kernels, not one each.
  * CP > 1 (`context_parallel_packed_attention`): as megatron / Transformer Engine split THD
    batches (tex.thd_get_partitioned_indices), every segment is cut into 2*CP chunks and CP rank r
    holds chunks r and 2*CP-1-r of each one (load balance for causal attention, per sequence). K
    and V are all-gathered over the CP group (backward: summed and scattered back, see
    ops.sequence_gather.all_gather_sequence); each local query sees the keys of its own sequence
    up to its own global position.

Scores are [heads, len, len] per sequence (a group's longest under CP = 1), in fp32 (softmax in
fp32, as megatron's attention_softmax_in_fp32): memory O(len^2) per sequence, never O(T^2).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_grpo.errors import ConfigError
from megatron_grpo.ops.sequence_gather import all_gather_sequence

Dropout = Optional[Callable[[torch.Tensor], torch.Tensor]]
# Sequences whose lengths are within this factor share one batched attention call (at most
# 1 - 0.875^2 = 23% of a group's score entries are padding).
BUCKET_RATIO = 0.875


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, scale: float, dropout: Dropout = None) -> torch.Tensor:
    """query [sq, h, d], key / value [sk, g, d] (GQA: h a multiple of g) -> [sq, h, d]; query i
    attends to key j where k_pos[j] <= q_pos[i]."""
    heads, groups = query.size(1), key.size(1)
    if heads != groups:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
    scores = torch.matmul(query.float().transpose(0, 1), key.float().permute(1, 2, 0)) * scale  # [h, sq, sk]
    scores = scores.masked_fill(k_pos.unsqueeze(0) > q_pos.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    if dropout is not None:
        probs = dropout(probs)
    return torch.matmul(probs, value.transpose(0, 1)).transpose(0, 1)  # [sq, h, d]


def _bounds(packed_seq_params) -> tuple[list[int], list[int]]:
    """(real lengths, padded segment bounds) of a PackedSeqParams."""
    cu = packed_seq_params.cu_seqlens_q
    padded = packed_seq_params.cu_seqlens_q_padded
    padded = cu if padded is None else padded
    cu, padded = cu.tolist(), padded.tolist()
    return [b - a for a, b in zip(cu, cu[1:])], padded


def batched_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor,
                             scale: float, dropout: Dropout = None) -> torch.Tensor:
    """query [G, L, h, d], key / value [G, L, g, d]: G sequences padded to L, sequence i's first
    lengths[i] tokens real -> [G, L, h, d]; causal, keys past a sequence's end masked (its padding
    queries give values nobody reads)."""
    heads, groups = query.size(2), key.size(2)
    if heads != groups:
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
    scores = torch.matmul(query.float().transpose(1, 2), key.float().permute(0, 2, 3, 1)) * scale  # [G, h, L, L]
    pos = torch.arange(query.size(1), device=query.device)
    masked = (pos.unsqueeze(0) > pos.unsqueeze(1)).unsqueeze(0) | (pos.view(1, 1, -1) >= lengths.view(-1, 1, 1))
    probs = torch.softmax(scores.masked_fill(masked.unsqueeze(1), float("-inf")), dim=-1).to(query.dtype)
    if dropout is not None:
        probs = dropout(probs)
    return torch.matmul(probs, value.transpose(1, 2)).transpose(1, 2)


def length_buckets(lengths: list[int], ratio: float = BUCKET_RATIO) -> list[list[int]]:
    """Indices of the non-empty sequences in groups of similar length (longest first; each member
    at least `ratio` x its group's longest), so a group runs as one batched attention."""
    order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: (-lengths[i], i))
    buckets: list[list[int]] = []
    for index in order:
        if not buckets or lengths[index] < ratio * lengths[buckets[-1][0]]:
            buckets.append([])
        buckets[-1].append(index)
    return buckets


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed_seq_params,
                            scale: float, dropout: Dropout = None) -> torch.Tensor:
    """CP = 1. query / key [T, h or g, d], value [T, g, dv] -> [T, h, dv] (zeros on padding).

    Sequences of similar length (length_buckets) run as one batched attention each, padded to the
    group's longest inside the attention only (masked keys get exactly zero weight): a few large
    kernels instead of one small one per sequence. One gather brings every group's tokens
    together and one gather puts the outputs back (their backwards are one scatter each, not a
    whole-row tensor per sequence)."""
    lengths, bounds = _bounds(packed_seq_params)
    total = query.size(0)
    if bounds[-1] != total:
        raise ValueError(f"packed attention: cu_seqlens end at {bounds[-1]} but the row has {total} tokens")
    buckets = length_buckets(lengths)
    out_shape = (*query.shape[:-1], value.size(-1))  # the value head (MLA: != the q/k head)
    if not buckets:
        return query.new_zeros(out_shape)
    device = query.device
    gather, sizes = [], []
    for bucket in buckets:
        width = lengths[bucket[0]]
        for i in bucket:  # a group member's padding slots read row `total`: a zero row appended below
            gather.append(torch.cat([torch.arange(bounds[i], bounds[i] + lengths[i]),
                                     torch.full((width - lengths[i],), total)]))
        sizes.append(len(bucket) * width)
    layout = torch.cat(gather)                     # bucket layout slot -> row position
    back = torch.full((total,), layout.numel(), dtype=torch.long)  # row position -> slot (padding: a zero row)
    real = layout < total
    back[layout[real]] = torch.nonzero(real).squeeze(1)
    layout, back = layout.to(device), back.to(device)

    def grouped(x: torch.Tensor) -> list[torch.Tensor]:
        extended = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        return list(extended.index_select(0, layout).split(sizes))

    outputs = []
    for bucket, q, k, v in zip(buckets, grouped(query), grouped(key), grouped(value)):
        width = lengths[bucket[0]]
        shape = (len(bucket), width)
        member_lengths = torch.tensor([lengths[i] for i in bucket], device=device)
        out = batched_causal_attention(q.view(*shape, *q.shape[1:]), k.view(*shape, *k.shape[1:]),
                                       v.view(*shape, *v.shape[1:]), member_lengths, scale, dropout)
        outputs.append(out.reshape(-1, *out.shape[2:]))
    outputs.append(query.new_zeros(1, *out_shape[1:]))
    return torch.cat(outputs).index_select(0, back)


def _chunk_positions(segment: int, cp_rank: int, cp_size: int, device) -> torch.Tensor:
    """Positions within a segment of the two chunks CP rank `cp_rank` holds, in its local order."""
    chunk = segment // (2 * cp_size)
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def _gathered_key_index(num_keys: int, local_start: int, local_rows: int, segment: int, cp_size: int,
                        device) -> torch.Tensor:
    """Where positions 0..num_keys-1 of one segment lie in the rank-ordered all-gather of the
    local rows (rank s's rows at s * local_rows; its part of the segment at local_start)."""
    chunk = segment // (2 * cp_size)
    pos = torch.arange(num_keys, device=device)
    index = pos // chunk
    early = index < cp_size
    owner = torch.where(early, index, 2 * cp_size - 1 - index)
    offset = pos % chunk + torch.where(early, 0, chunk)
    return owner * local_rows + local_start + offset


def context_parallel_packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                      packed_seq_params, scale: float, cp_group,
                                      dropout: Dropout = None) -> torch.Tensor:
    """CP > 1. query [T/cp, h, d], key / value [T/cp, g, d]: this rank's chunks of every segment
    (segment lengths multiples of 2*CP); returns [T/cp, h, d]."""
    cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    lengths, bounds = _bounds(packed_seq_params)
    local_rows = query.size(0)
    if bounds[-1] != local_rows * cp_size:
        raise ValueError(f"packed attention: cu_seqlens end at {bounds[-1]} but the CP ranks hold "
                         f"{cp_size} x {local_rows} tokens")
    keys = all_gather_sequence(key, cp_group)      # [cp * T/cp, g, d], rank order
    values = all_gather_sequence(value, cp_group)
    q_sizes, k_sizes, k_index, positions = [], [], [], []
    for length, start, end in zip(lengths, bounds, bounds[1:]):
        segment = end - start
        if segment % (2 * cp_size):
            raise ConfigError(f"packed sequence segment of {segment} tokens is not divisible by 2 * "
                              f"context_parallel_size = {2 * cp_size}")
        q_pos = _chunk_positions(segment, cp_rank, cp_size, query.device)
        # Keys a local query can see: the sequence's real tokens up to the last local position.
        num_keys = min(length, int(q_pos.max()) + 1)
        q_sizes.append(segment // cp_size)
        k_sizes.append(num_keys)
        k_index.append(_gathered_key_index(num_keys, start // cp_size, local_rows, segment, cp_size, query.device))
        positions.append(q_pos)
    # One gather and one split for all sequences (their backwards are one scatter and one concatenation).
    k_index = torch.cat(k_index)
    seq_keys = keys.index_select(0, k_index).split(k_sizes)
    seq_values = values.index_select(0, k_index).split(k_sizes)
    pieces = []
    for q, k, v, q_pos in zip(query.split(q_sizes), seq_keys, seq_values, positions):
        if k.size(0) == 0:  # a segment of padding only
            pieces.append(q.new_zeros(q.size(0), q.size(1), q.size(2)))
            continue
        k_pos = torch.arange(k.size(0), device=query.device)
        pieces.append(causal_attention(q, k, v, q_pos, k_pos, scale, dropout))
    return torch.cat(pieces, dim=0)


def check_packed_supported(config, attn_mask_type) -> None:
    """The variants the packed kernels implement (causal, no window, vanilla softmax)."""
    from megatron.core.transformer.enums import AttnMaskType

    if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
        raise ConfigError(f"packed attention supports causal masks only, got {attn_mask_type}")
    if config.window_size is not None or config.softmax_type != "vanilla":
        raise ConfigError("packed attention: sliding windows / softmax offsets are not supported")


def is_thd(packed_seq_params) -> bool:
    return packed_seq_params is not None and packed_seq_params.qkv_format == "thd"


def attention_dropout(module, probs_dropout: torch.nn.Dropout) -> Dropout:
    """megatron's attention dropout (under the model-parallel RNG tracker unless sequence
    parallel, as DotProductAttention does), or None when inactive."""
    if not (module.training and probs_dropout.p > 0):
        return None
    if module.config.sequence_parallel:
        return probs_dropout
    from megatron.core import tensor_parallel

    def apply(probs: torch.Tensor) -> torch.Tensor:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return probs_dropout(probs)
    return apply


def _dot_product_attention_base():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class PackedDotProductAttention(_dot_product_attention_base()):
    """megatron's local DotProductAttention (CP = 1) that also takes packed sequences
    (PackedSeqParams, qkv_format "thd"); padded batches take megatron's own code unchanged.

    Multi-head latent attention (megatron-core's MLASelfAttention) builds its core attention with
    k_channels (the q/k head: nope + rope dims) and v_channels (the value head), which megatron's local
    DotProductAttention does not take (only TE's does); its math needs neither (scores use q and k's own
    last dim, the context v's), only the padded batch's output width heads x v_channels, set here."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not is_thd(packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if attention_bias is not None:
            raise NotImplementedError("packed attention: attention bias is not supported")
        check_packed_supported(self.config, self.attn_mask_type)
        # megatron's attention squeezed THD inputs to [t, heads, d] (batch dimension 1)
        context = self.packed_attention(query, key, value, packed_seq_params)
        # heads x the value's width: megatron-core >= 0.19's MLA pads a packed batch's value head to the q/k
        # head and trims the output itself
        return context.reshape(context.size(0), -1)

    def packed_attention(self, query, key, value, packed_seq_params):
        """[t, heads, d] -> [t, heads, d]; ops.torch_varlen's subclass runs torch's varlen_attn instead."""
        return packed_causal_attention(query, key, value, packed_seq_params, self.softmax_scale,
                                       attention_dropout(self, self.attention_dropout))
