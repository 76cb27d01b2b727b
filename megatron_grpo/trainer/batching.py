"""Rollout samples -> micro-batches for megatron's forward_backward_func: packed (THD) or padded.

A sample is one prompt+response sequence. Tensors are laid out for next-token prediction: at
position t the model predicts token t+1, so `targets[t] = tokens[t+1]` and `loss_mask[t]` is True
where token t+1 belongs to the response. Per-token values that the loss needs (advantages,
old / reference / rollout log-probs) are placed at the same positions.

Two layouts, the same per-token values:
  * packed (`collate_packed`, the default): the sequences of a micro-batch concatenated into one
    row [1, T] (megatron's "thd" format), `cu_seqlens` marking where each starts; position ids
    restart at 0 for every sequence and attention never crosses a boundary (PackedSequences ->
    megatron's PackedSeqParams). A sequence is followed by padding only where a kernel needs a
    multiple: 2*CP chunks per sequence under context parallelism, a total divisible by TP under
    sequence parallelism, one shape for all micro-batches under pipeline parallelism.
  * padded (`collate`): one row per sequence, right-padded to the longest row; with a causal mask
    padding after a sequence cannot influence its valid positions.
The loss works on rows either way: `MicroBatch.rows` turns a packed [1, T] tensor into [n, w]
(sequence i in row i, masked beyond its end), so sequence-level terms (seq-mean modes, GSPO) see
the same rows as in the padded layout.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

PER_TOKEN_NAMES = ("old_logprobs", "ref_logprobs", "rollout_logprobs")


@dataclass
class TrainSample:
    """One sequence of the training batch, as the loop hands it to the train step."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_logprobs: list[float] | None = None
    # Filled by the log-prob passes (one value per response token), when needed.
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    # MoE routing replay: the engine's experts per position, [length - 1, layers, k] (models/routing_replay.py)
    routed_experts: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class PackedSequences:
    """Where the sequences of a packed micro-batch lie (global positions, before any CP split).

    Segment i of the row is [cu_seqlens_padded[i], cu_seqlens_padded[i+1]): sequence i's
    cu_seqlens[i+1] - cu_seqlens[i] tokens, then its padding. `cp_size` says how the micro-batch's
    tensors are split: under context parallelism a rank holds 1/cp of every segment (two of its
    2*CP chunks, ops.context_parallel.packed_local_positions), so its local segment i is
    [cu_seqlens_padded[i] / cp, cu_seqlens_padded[i+1] / cp)."""

    cu_seqlens: torch.Tensor          # [n+1] int32
    cu_seqlens_padded: torch.Tensor   # [n+1] int32
    cp_size: int = 1

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def total_length(self) -> int:
        """Processed tokens of the whole row (all CP ranks together)."""
        return int(self.cu_seqlens_padded[-1])

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max())

    @functools.cached_property
    def _row_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        bounds = (self.cu_seqlens_padded.long() // self.cp_size).tolist()
        widths = [b - a for a, b in zip(bounds, bounds[1:])]
        width = max(widths)
        index = torch.zeros(len(widths), width, dtype=torch.long)
        valid = torch.zeros(len(widths), width, dtype=torch.bool)
        for i, (start, size) in enumerate(zip(bounds, widths)):
            index[i, :size] = torch.arange(start, start + size)
            valid[i, :size] = True
        return index, valid

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """[1, T_local] -> [n, w]: local segment i in row i, zeros (False) past its end."""
        index, valid = (t.to(tensor.device) for t in self._row_index)
        out = tensor.reshape(-1)[index]
        return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def to(self, device: torch.device) -> "PackedSequences":
        return dataclasses.replace(self, cu_seqlens=self.cu_seqlens.to(device),
                                   cu_seqlens_padded=self.cu_seqlens_padded.to(device))

    def packed_seq_params(self, context_parallel_size: int):
        """megatron-core's PackedSeqParams (qkv_format "thd") for this row: read by our local
        attention (ops.varlen_attention) and by Transformer Engine's, and by megatron's RoPE."""
        from megatron.core.packed_seq_params import PackedSeqParams

        max_seqlen = self.max_seqlen
        # megatron's unfused THD RoPE takes a table of max_seqlen * CP rows whose length equals
        # the total as meaning "positions run across the whole pack" (its VLM mode); positions
        # must restart per sequence here, so keep the table one row longer in that case.
        if max_seqlen * context_parallel_size == self.total_length and self.num_sequences > 1:
            max_seqlen += 1
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               cu_seqlens_q_padded=self.cu_seqlens_padded,
                               cu_seqlens_kv_padded=self.cu_seqlens_padded,
                               max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


@dataclass
class MicroBatch:
    tokens: torch.Tensor          # [b, s] long (packed: b = 1)
    position_ids: torch.Tensor    # [b, s] long
    targets: torch.Tensor         # [b, s] long, token t+1 (0 where masked)
    loss_mask: torch.Tensor       # [b, s] bool, True where targets[t] is a response token
    advantages: torch.Tensor      # [b, s] float
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # old/ref/rollout log-probs [b, s]
    sample_indices: list[int] = field(default_factory=list)           # rows (sequences) -> index in the batch
    # Response tokens per sequence of the whole micro-batch: under context parallelism a rank holds
    # only part of each sequence, but seq-mean modes and the global token count need the full counts.
    row_token_counts: torch.Tensor | None = None                      # [n] long
    packed: PackedSequences | None = None                             # None: padded rows
    useful_tokens: int = 0       # prompt + response tokens of the sequences
    processed_tokens: int = 0    # tokens the model runs over (all CP ranks together), padding included
    routed_experts: torch.Tensor | None = None  # [b, s, layers, k] engine expert id + 1, 0 = none (replay)

    def map_positions(self, fn) -> "MicroBatch":
        """A copy with `fn` applied to every per-position [b, s] tensor (row metadata kept)."""
        return dataclasses.replace(
            self, tokens=fn(self.tokens), position_ids=fn(self.position_ids), targets=fn(self.targets),
            loss_mask=fn(self.loss_mask), advantages=fn(self.advantages),
            per_token={name: fn(values) for name, values in self.per_token.items()},
            routed_experts=None if self.routed_experts is None else _per_slot(fn, self.routed_experts))

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-position tensor as one row per sequence (what the loss aggregates over)."""
        return tensor if self.packed is None else self.packed.rows(tensor)

    def sequence_starts(self) -> list[int]:
        """Global flat offset of each sequence's first token in the full (un-split) layout."""
        if self.packed is not None:
            return self.packed.cu_seqlens_padded[:-1].tolist()
        width = self.processed_tokens // max(self.tokens.shape[0], 1)
        return [r * width for r in range(self.tokens.shape[0])]


def _per_slot(fn, routes: torch.Tensor) -> torch.Tensor:
    """`fn` (made for [b, s] tensors) applied to each [b, s] slice of [b, s, layers, k] routes."""
    flat = routes.reshape(*routes.shape[:2], -1)
    out = torch.stack([fn(flat[..., j]) for j in range(flat.shape[-1])], dim=-1)
    return out.reshape(*out.shape[:2], *routes.shape[2:])


def _routes(rows: list[TrainSample], shape: tuple[int, int], starts: list[int]) -> torch.Tensor | None:
    """[b, s, layers, k] routes (expert id + 1, 0 = none) of rows placed at (row, start) of a
    [b, s] layout: row i at shape row i (padded) or at column starts[i] of row 0 (packed)."""
    if not rows or rows[0].routed_experts is None:
        return None
    out = torch.zeros(*shape, *torch.as_tensor(rows[0].routed_experts).shape[1:], dtype=torch.int32)
    for i, (row, start) in enumerate(zip(rows, starts)):
        routes = torch.as_tensor(row.routed_experts)[: row.length - 1] + 1
        target = out[0] if shape[0] == 1 else out[i]
        target[start:start + routes.shape[0]] = routes.to(out.dtype)
    return out


def balance_into_micro_batches(lengths: list[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Padded layout: partitions sample indices into micro-batches whose padded size (rows x
    longest row) stays within `max_tokens`, greedily in order of decreasing length so that similar
    lengths share a micro-batch (little padding). A single sequence longer than max_tokens gets its
    own micro-batch. At least `min_micro_batches` bins are made when there are enough samples.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for index in order:
        placed = False
        for members in bins:
            longest = max(lengths[m] for m in members + [index])
            if longest * (len(members) + 1) <= max_tokens:
                members.append(index)
                placed = True
                break
        if not placed:
            bins.append([index])
    # Split the largest bins until there are enough (each split keeps the token budget).
    while len(bins) < min_micro_batches:
        largest = max(range(len(bins)), key=lambda b: len(bins[b]))
        if len(bins[largest]) < 2:
            break
        members = bins.pop(largest)
        bins.extend([members[: len(members) // 2], members[len(members) // 2:]])
    return [sorted(members) for members in bins]


def pack_into_micro_batches(tokens: list[int], costs: list[float], max_tokens: int,
                            min_micro_batches: int = 1) -> list[list[int]]:
    """Packed layout: partitions item indices into micro-batches of at most `max_tokens` tokens
    each (sum of `tokens`; an item larger than the budget gets a micro-batch of its own) with
    balanced `costs`: as few micro-batches as the budget allows (at least `min_micro_batches`; empty
    ones when there are fewer items), filled largest cost first into the cheapest one it fits.
    """
    count = max(min_micro_batches, -(-sum(tokens) // max_tokens), 1)
    order = sorted(range(len(tokens)), key=lambda i: (-costs[i], -tokens[i], i))
    while True:
        bins: list[list[int]] = [[] for _ in range(count)]
        loads, sizes = [0.0] * count, [0] * count
        for index in order:
            fits = [b for b in range(count) if sizes[b] + tokens[index] <= max_tokens or not bins[b]]
            if not fits:
                break
            target = min(fits, key=lambda b: (loads[b], sizes[b], b))
            bins[target].append(index)
            loads[target] += costs[index]
            sizes[target] += tokens[index]
        else:
            return [sorted(members) for members in bins]
        count += 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _per_token_names(rows: list[TrainSample]) -> list[str]:
    return [name for name in PER_TOKEN_NAMES if rows and getattr(rows[0], name) is not None]


def collate(samples: list[TrainSample], indices: list[int], pad_to_multiple: int = 1) -> MicroBatch:
    """Builds one right-padded micro-batch from samples[indices] (none: one fully masked row)."""
    rows = [samples[i] for i in indices]
    longest = max((row.length for row in rows), default=1)
    seq_len = _round_up(longest, pad_to_multiple)
    batch = max(len(rows), 1)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    advantages = torch.zeros(batch, seq_len)
    per_token_names = _per_token_names(rows)
    per_token = {name: torch.zeros(batch, seq_len) for name in per_token_names}
    for r, row in enumerate(rows):
        _place(row, tokens[r], loss_mask[r], advantages[r], {n: v[r] for n, v in per_token.items()})
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch, seq_len).contiguous()
    return MicroBatch(tokens=tokens, position_ids=position_ids, targets=targets, loss_mask=loss_mask,
                      advantages=advantages, per_token=per_token, sample_indices=list(indices),
                      row_token_counts=loss_mask.sum(-1).long(), useful_tokens=sum(row.length for row in rows),
                      processed_tokens=batch * seq_len, routed_experts=_routes(rows, (batch, seq_len), [0] * len(rows)))


def collate_packed(samples: list[TrainSample], indices: list[int], sequence_multiple: int = 1,
                   total_multiple: int = 1, total_length: int | None = None) -> MicroBatch:
    """Builds one packed micro-batch [1, T] from samples[indices] (possibly none).

    Each sequence's segment is its length rounded up to `sequence_multiple` (2*CP: every CP rank
    takes two equal chunks of each sequence); T is rounded up to `total_multiple` (CP x TP under
    sequence parallelism) or set to `total_length` (one shape for the pipeline); that padding is
    appended to the last segment (an empty micro-batch is one segment of padding only)."""
    if total_multiple % sequence_multiple:
        raise ValueError(f"total_multiple {total_multiple} is not a multiple of sequence_multiple {sequence_multiple}")
    rows = [samples[i] for i in indices]
    lengths = [row.length for row in rows] or [0]
    segments = [_round_up(length, sequence_multiple) for length in lengths]
    total = max(_round_up(sum(segments), total_multiple), total_multiple)
    if total_length is not None:
        if total_length < total or total_length % total_multiple:
            raise ValueError(f"total_length {total_length}: below the packed {total} tokens or not a "
                             f"multiple of {total_multiple}")
        total = total_length
    segments[-1] += total - sum(segments)  # a multiple of sequence_multiple (both totals are)
    bounds = [0]
    for size in segments:
        bounds.append(bounds[-1] + size)
    tokens = torch.zeros(1, total, dtype=torch.long)
    targets = torch.zeros(1, total, dtype=torch.long)
    loss_mask = torch.zeros(1, total, dtype=torch.bool)
    advantages = torch.zeros(1, total)
    per_token = {name: torch.zeros(1, total) for name in _per_token_names(rows)}
    position_ids = torch.cat([torch.arange(size) for size in segments]).unsqueeze(0)
    for row, start, length in zip(rows, bounds, lengths):
        segment = slice(start, start + length)
        _place(row, tokens[0, segment], loss_mask[0, segment], advantages[0, segment],
               {name: values[0, segment] for name, values in per_token.items()})
        targets[0, start:start + length - 1] = tokens[0, start + 1:start + length]
    cu_seqlens = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    if not rows:
        cu_seqlens = torch.zeros(2, dtype=torch.int32)
    return MicroBatch(tokens=tokens, position_ids=position_ids, targets=targets, loss_mask=loss_mask,
                      advantages=advantages, per_token=per_token, sample_indices=list(indices),
                      row_token_counts=torch.tensor([len(row.response_ids) for row in rows] or [0]),
                      packed=PackedSequences(cu_seqlens=cu_seqlens,
                                             cu_seqlens_padded=torch.tensor(bounds, dtype=torch.int32)),
                      useful_tokens=sum(row.length for row in rows), processed_tokens=total,
                      routed_experts=_routes(rows, (1, total), bounds[:len(rows)]))


def _place(row: TrainSample, tokens: torch.Tensor, loss_mask: torch.Tensor, advantages: torch.Tensor,
           per_token: dict[str, torch.Tensor]) -> None:
    """Writes one sequence into 1-D views starting at its first token."""
    sequence = row.prompt_ids + row.response_ids
    tokens[: len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    # Response token j sits at sequence position len(prompt)+j and is predicted at position-1.
    start = len(row.prompt_ids) - 1
    end = start + len(row.response_ids)
    loss_mask[start:end] = True
    advantages[start:end] = row.advantage
    for name, values in per_token.items():
        values[start:end] = torch.tensor(getattr(row, name), dtype=torch.float32)
