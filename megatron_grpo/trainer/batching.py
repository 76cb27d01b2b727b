"""Rollout samples -> padded, token-balanced micro-batches for megatron's forward_backward_func.

A sample is one prompt+response sequence. Tensors are laid out for next-token prediction: at
position t the model predicts token t+1, so `targets[t] = tokens[t+1]` and `loss_mask[t]` is True
where token t+1 belongs to the response. Per-token values that the loss needs (advantages,
old / reference / rollout log-probs) are placed at the same positions. Sequences are right-padded:
with a causal mask, padding after a sequence cannot influence its valid positions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


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

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    tokens: torch.Tensor          # [b, s] long
    position_ids: torch.Tensor    # [b, s] long
    targets: torch.Tensor         # [b, s] long, token t+1 (0 where masked)
    loss_mask: torch.Tensor       # [b, s] bool, True where targets[t] is a response token
    advantages: torch.Tensor      # [b, s] float
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # old/ref/rollout log-probs [b, s]
    sample_indices: list[int] = field(default_factory=list)           # rows -> index in the batch
    # Response tokens per row of the whole sequence: under context parallelism a rank holds only
    # part of each row, but seq-mean modes and the global token count need the full counts.
    row_token_counts: torch.Tensor | None = None                      # [b] long

    def map_positions(self, fn) -> "MicroBatch":
        """A copy with `fn` applied to every per-position [b, s] tensor (row metadata kept)."""
        return dataclasses.replace(
            self, tokens=fn(self.tokens), position_ids=fn(self.position_ids), targets=fn(self.targets),
            loss_mask=fn(self.loss_mask), advantages=fn(self.advantages),
            per_token={name: fn(values) for name, values in self.per_token.items()})


def balance_into_micro_batches(lengths: list[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Partitions sample indices into micro-batches whose padded size (rows x longest row) stays
    within `max_tokens`, greedily in order of decreasing length so that similar lengths share a
    micro-batch (little padding). A single sequence longer than max_tokens gets its own micro-batch.
    At least `min_micro_batches` bins are made (needed so that every DP rank runs the same number).
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


def collate(samples: list[TrainSample], indices: list[int], pad_to_multiple: int = 1) -> MicroBatch:
    """Builds one right-padded micro-batch from samples[indices]."""
    rows = [samples[i] for i in indices]
    longest = max(row.length for row in rows)
    seq_len = -(-longest // pad_to_multiple) * pad_to_multiple
    batch = len(rows)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    advantages = torch.zeros(batch, seq_len)
    per_token_names = [name for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs")
                       if getattr(rows[0], name) is not None]
    per_token = {name: torch.zeros(batch, seq_len) for name in per_token_names}
    for r, row in enumerate(rows):
        sequence = row.prompt_ids + row.response_ids
        tokens[r, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        # Response token j sits at sequence position len(prompt)+j and is predicted at position-1.
        start = len(row.prompt_ids) - 1
        end = start + len(row.response_ids)
        loss_mask[r, start:end] = True
        advantages[r, start:end] = row.advantage
        for name in per_token_names:
            values = getattr(row, name)
            per_token[name][r, start:end] = torch.tensor(values, dtype=torch.float32)
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch, seq_len).contiguous()
    return MicroBatch(tokens=tokens, position_ids=position_ids, targets=targets, loss_mask=loss_mask,
                      advantages=advantages, per_token=per_token, sample_indices=list(indices),
                      row_token_counts=loss_mask.sum(-1))

