"""Step batch -> mini-batches -> this data-parallel rank's share -> token-balanced micro-batches.

Every rank computes the same plan from the same (broadcast) samples and keeps its own share, so
no communication is needed. Ranks of one pipeline (same DP rank) get identical micro-batches, as
megatron's schedule requires; with PP > 1 all micro-batches are padded to one shape because the
pipeline's p2p buffers have a fixed shape.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.trainer.batching import MicroBatch, TrainSample, balance_into_micro_batches, collate


def split_over_ranks(lengths: list[int], indices: list[int], num_ranks: int) -> list[list[int]]:
    """Greedy token balancing: longest sequence first, to the rank with the fewest tokens."""
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        target = min(range(num_ranks), key=lambda r: (loads[r], r))
        shares[target].append(index)
        loads[target] += lengths[index]
    return [sorted(share) for share in shares]


def plan_micro_batches(samples: list[TrainSample], cfg: Config) -> list[list[MicroBatch]]:
    """This rank's micro-batches for each mini-batch of the step."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mini_size = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    lengths = [s.length for s in samples]
    cp_size = ps.get_context_parallel_world_size()
    # Sequence parallel splits the sequence over TP ranks; context parallel into 2*CP chunks.
    pad_multiple = ps.get_tensor_model_parallel_world_size() if cfg.parallel.sequence_parallel else 1
    pad_multiple *= 2 * cp_size if cp_size > 1 else 1
    plan = []
    for start in range(0, len(samples), mini_size):
        mini = list(range(start, min(start + mini_size, len(samples))))
        mine = split_over_ranks(lengths, mini, dp_size)[dp_rank]
        if not mine:
            raise ValueError(f"mini-batch of {len(mini)} sequences leaves data-parallel rank {dp_rank} empty")
        if cfg.actor.ppo_micro_batch_size_per_gpu:
            size = cfg.actor.ppo_micro_batch_size_per_gpu
            groups = [mine[i:i + size] for i in range(0, len(mine), size)]
        else:
            local = balance_into_micro_batches([lengths[i] for i in mine], cfg.actor.max_tokens_per_micro_batch)
            groups = [[mine[j] for j in group] for group in local]
        micro_batches = [collate(samples, group, pad_to_multiple=pad_multiple) for group in groups]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            micro_batches = pad_to_common_shape(micro_batches)
        if cp_size > 1:
            micro_batches = [split_for_context_parallel_rank(mb) for mb in micro_batches]
        plan.append(micro_batches)
    return plan


def split_for_context_parallel_rank(mb: MicroBatch) -> MicroBatch:
    """This CP rank's positions of every [b, s] tensor (megatron's load-balanced chunk order);
    row_token_counts keep the full-row counts."""
    from megatron_grpo.ops.context_parallel import split_for_context_parallel

    return mb.map_positions(split_for_context_parallel)


def pad_to_common_shape(micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    """Pads rows (fully masked) and columns so every micro-batch has the same [b, s]."""
    rows = max(mb.tokens.shape[0] for mb in micro_batches)
    cols = max(mb.tokens.shape[1] for mb in micro_batches)
    return [_pad(mb, rows, cols) for mb in micro_batches]


def _pad(mb: MicroBatch, rows: int, cols: int) -> MicroBatch:
    def grow(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((rows, cols), dtype=t.dtype)
        out[: t.shape[0], : t.shape[1]] = t
        return out

    positions = torch.arange(cols).unsqueeze(0).expand(rows, cols).contiguous()
    extra_rows = torch.zeros(rows - mb.tokens.shape[0], dtype=torch.long)
    return dataclasses.replace(mb.map_positions(grow), position_ids=positions,
                               row_token_counts=torch.cat([mb.row_token_counts, extra_rows]))
