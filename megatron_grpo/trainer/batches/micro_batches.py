"""Step batch -> mini-batches -> this data-parallel rank's share -> micro-batches (packed or padded).

Every rank computes the same plan from the same (broadcast) samples and keeps its own share, so
no communication is needed. Ranks of one pipeline (same DP rank) get identical micro-batches, as
megatron's schedule requires.

Planning (verl's use_dynamic_bsz / ppo_max_token_len_per_gpu, for packed micro-batches):
  1. each mini-batch is split over the DP ranks by cost, longest first to the cheapest rank; a
     sequence of L tokens costs L + w * L^2, w weighing attention (quadratic in L) against the
     linear layers (attention_cost_weight). The split does not depend on the pass, so the
     old / reference log-prob passes and the update see the same share on every rank;
  2. each share is packed into as few micro-batches of at most `max_tokens` tokens as fit
     (pack_into_micro_batches: equal costs), or fixed `micro_batch_size` sequences;
  3. with pipeline parallelism every DP rank runs the same number of micro-batches (the largest
     any rank needs; under the interleaved schedule (virtual pipeline) rounded up to a multiple
     of PP, megatron's micro-batch group), all of one shape within the mini-batch (p2p buffers
     have a fixed shape);
     with expert parallelism too (every rank of an EP group, which spans DP ranks, joins each
     forward's token all-to-all: unequal counts would hang), but of their own shapes;
  4. padding is added only where a kernel needs a multiple: 2*CP chunks per sequence under context
     parallelism, a total divisible by TP (x CP) under sequence parallelism, the common pipeline
     shape; `padding_metrics` counts it.
The padded layout (`actor.packing: false`) pads every row to the micro-batch's longest, with
micro-batches of rows x longest <= max_tokens (balance_into_micro_batches).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.trainer.batches.batching import MicroBatch, TrainSample, collate, collate_packed

Purpose = Literal["train", "old_logprobs", "ref_logprobs"]


@dataclass(frozen=True)
class ParallelShape:
    """The parts of the parallel layout that shape micro-batches."""

    dp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    cp_rank: int = 0
    cp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    vpp_size: int = 1  # model chunks per pipeline rank (interleaved schedule)

    @classmethod
    def current(cls, sequence_parallel: bool) -> "ParallelShape":
        from megatron.core import parallel_state as ps

        return cls(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                   tp_size=ps.get_tensor_model_parallel_world_size(), sequence_parallel=sequence_parallel,
                   cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
                   pp_size=ps.get_pipeline_model_parallel_world_size(),
                   ep_size=ps.get_expert_model_parallel_world_size(),
                   vpp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 1)

    @property
    def sequence_multiple(self) -> int:
        """Packed: every sequence's segment is a multiple of this (2*CP equal chunks)."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    @property
    def total_multiple(self) -> int:
        """Packed: a row's length is a multiple of this (each CP rank's part divisible by TP under SP)."""
        tp = self.tp_size if self.sequence_parallel else 1
        return math.lcm(self.sequence_multiple, self.cp_size * tp)

    @property
    def padded_multiple(self) -> int:
        """Padded: a row's length is a multiple of this (SP splits it over TP, CP into 2*CP chunks)."""
        return (self.tp_size if self.sequence_parallel else 1) * self.sequence_multiple


@dataclass(frozen=True)
class MicroBatching:
    """How one pass cuts its share into micro-batches."""

    packing: bool = True
    max_tokens: int | None = None        # per micro-batch (packed: tokens; padded: rows x longest)
    micro_batch_size: int | None = None  # fixed sequences per micro-batch, when max_tokens is None
    mini_batch_size: int = 1             # sequences per mini-batch (all DP ranks)
    attention_weight: float = 0.0        # w of the cost L + w * L^2

    def __post_init__(self):
        if (self.max_tokens is None) == (self.micro_batch_size is None):
            raise ValueError(f"set exactly one of max_tokens and micro_batch_size, got {self}")

    @classmethod
    def from_config(cls, cfg: Config, purpose: Purpose = "train", attention_weight: float = 0.0) -> "MicroBatching":
        """The update's micro-batching, or a log-prob pass's: its own token budget
        (actor.logprob_max_tokens_per_micro_batch / ref.max_tokens_per_micro_batch), else the update's."""
        a = cfg.actor
        budget = a.max_tokens_per_micro_batch
        own = {"train": None, "old_logprobs": a.logprob_max_tokens_per_micro_batch,
               "ref_logprobs": cfg.ref.max_tokens_per_micro_batch}[purpose]
        if own is not None:
            budget = own
        return cls(packing=a.packing, max_tokens=budget,
                   micro_batch_size=None if budget is not None else a.ppo_micro_batch_size_per_gpu,
                   mini_batch_size=a.ppo_mini_batch_size * cfg.rollout.n, attention_weight=attention_weight)


def attention_cost_weight(model_config) -> float:
    """w such that L + w * L^2 is proportional to a sequence's forward FLOPs (trainer/step/flops.py):
    the linear layers cost 2 * params per token, causal attention pair_flops per pair over L^2 / 2 pairs."""
    from megatron_grpo.trainer.step.flops import attention_pair_flops, dense_parameter_count

    return attention_pair_flops(model_config) / (4 * dense_parameter_count(model_config))


def sequence_costs(samples: list[TrainSample], attention_weight: float) -> list[float]:
    return [s.length + attention_weight * s.length ** 2 for s in samples]


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


def split_over_ranks(costs: list[float], indices: list[int], num_ranks: int) -> list[list[int]]:
    """Greedy balancing: most expensive sequence first, to the rank with the lowest total cost."""
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    for index in sorted(indices, key=lambda i: (-costs[i], i)):
        target = min(range(num_ranks), key=lambda r: (loads[r], len(shares[r]), r))
        shares[target].append(index)
        loads[target] += costs[index]
    return [sorted(share) for share in shares]


def plan_micro_batches(samples: list[TrainSample], cfg: Config, *, purpose: Purpose = "train",
                       model_config=None, skip_mini_batches: int = 0) -> list[list[MicroBatch]]:
    """This rank's micro-batches for each mini-batch of the step (from `skip_mini_batches` on),
    under megatron's current parallel state. `model_config` (models.ModelArchitecture) weighs attention
    in the balancing; without it sequences cost their length."""
    weight = attention_cost_weight(model_config) if model_config is not None else 0.0
    return plan(samples, MicroBatching.from_config(cfg, purpose, weight),
                ParallelShape.current(cfg.parallel.sequence_parallel), skip_mini_batches)


def plan(samples: list[TrainSample], batching: MicroBatching, shape: ParallelShape,
         skip_mini_batches: int = 0) -> list[list[MicroBatch]]:
    """plan_micro_batches for an explicit layout (pure: no communication)."""
    costs = sequence_costs(samples, batching.attention_weight)
    out = []
    starts = range(0, len(samples), batching.mini_batch_size)
    for start in list(starts)[skip_mini_batches:]:
        mini = list(range(start, min(start + batching.mini_batch_size, len(samples))))
        shares = split_over_ranks(costs, mini, shape.dp_size)
        if any(not share for share in shares):
            raise ValueError(f"mini-batch of {len(mini)} sequences leaves a data-parallel rank of "
                             f"{shape.dp_size} empty")
        if shape.pp_size > 1 or shape.ep_size > 1:  # the same number of micro-batches on every DP rank
            count = max(len(_group(samples, share, costs, batching, shape)) for share in shares)
            if shape.vpp_size > 1:  # megatron's interleaved schedule runs micro-batches in groups of PP
                count = -(-count // shape.pp_size) * shape.pp_size
        else:
            count = 1
        groups = _group(samples, shares[shape.dp_rank], costs, batching, shape, count)
        out.append(_collate_all(samples, groups, batching.packing, shape))
    return out


def _group(samples, share: list[int], costs: list[float], batching: MicroBatching, shape: ParallelShape,
           min_count: int = 1) -> list[list[int]]:
    """Index groups of one rank's share, at least `min_count` of them."""
    if batching.micro_batch_size is not None:
        size = batching.micro_batch_size
        groups = [share[i:i + size] for i in range(0, len(share), size)]
        while len(groups) < min_count:
            largest = max(range(len(groups)), key=lambda g: len(groups[g]))
            if len(groups[largest]) < 2:
                groups.append([])
                continue
            members = groups.pop(largest)
            groups[largest:largest] = [members[: len(members) // 2], members[len(members) // 2:]]
        return groups
    if batching.packing:
        multiple = shape.total_multiple
        budget = max(batching.max_tokens // multiple * multiple, multiple)
        tokens = [-(-samples[i].length // shape.sequence_multiple) * shape.sequence_multiple for i in share]
        local = pack_into_micro_batches(tokens, [costs[i] for i in share], budget, min_count)
    else:
        local = balance_into_micro_batches([samples[i].length for i in share], batching.max_tokens, min_count)
        local += [[] for _ in range(min_count - len(local))]
    return [[share[j] for j in group] for group in local]


def _collate_all(samples, groups: list[list[int]], packing: bool, shape: ParallelShape) -> list[MicroBatch]:
    if packing:
        micro_batches = [collate_packed(samples, g, shape.sequence_multiple, shape.total_multiple) for g in groups]
        if shape.pp_size > 1:
            longest = max(mb.processed_tokens for mb in micro_batches)
            micro_batches = [collate_packed(samples, g, shape.sequence_multiple, shape.total_multiple, longest)
                             for g in groups]
    else:
        micro_batches = [collate(samples, g, pad_to_multiple=shape.padded_multiple) for g in groups]
        if shape.pp_size > 1:
            micro_batches = pad_to_common_shape(micro_batches)
    if shape.cp_size > 1:
        micro_batches = [split_for_context_parallel_rank(mb, shape.cp_rank, shape.cp_size) for mb in micro_batches]
    return micro_batches


def split_for_context_parallel_rank(mb: MicroBatch, cp_rank: int | None = None,
                                    cp_size: int | None = None) -> MicroBatch:
    """This CP rank's positions of every per-position tensor (megatron's load-balanced chunk
    order; per sequence when packed); row_token_counts keep the full-sequence counts."""
    from megatron_grpo.ops.context_parallel import split_for_context_parallel, split_packed_for_context_parallel

    if cp_rank is None or cp_size is None:
        from megatron.core import parallel_state as ps

        cp_rank, cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    if mb.packed is None:
        return mb.map_positions(lambda t: split_for_context_parallel(t, 1, cp_rank, cp_size))
    bounds = mb.packed.cu_seqlens_padded
    split = mb.map_positions(lambda t: split_packed_for_context_parallel(t, bounds, cp_rank, cp_size))
    return dataclasses.replace(split, packed=dataclasses.replace(mb.packed, cp_size=cp_size))


def pad_to_common_shape(micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    """Padded layout: pads rows (fully masked) and columns so every micro-batch has the same [b, s]."""
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
                               row_token_counts=torch.cat([mb.row_token_counts, extra_rows]),
                               processed_tokens=rows * cols)


def padding_metrics(mini_batches: list[list[MicroBatch]]) -> dict[str, float]:
    """Tokens the update runs over that belong to no sequence, over all DP ranks (one pass over
    the mini-batches): perf/pad_tokens and perf/useful_token_frac."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    counts = torch.tensor([sum(mb.useful_tokens for mbs in mini_batches for mb in mbs),
                           sum(mb.processed_tokens for mbs in mini_batches for mb in mbs)], dtype=torch.float64)
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
    useful, processed = float(counts[0]), float(counts[1])
    return {"perf/pad_tokens": processed - useful, "perf/useful_token_frac": useful / max(processed, 1.0)}
