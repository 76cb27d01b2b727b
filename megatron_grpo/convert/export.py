"""Stream the sharded Megatron model out as full HF-named tensors, moved in buckets.

export_hf_weights(chunks, cfg)
    Per pipeline stage. A collective over this rank's TP group: every TP rank of the stage must
    iterate it in lockstep, and EVERY TP rank yields the same (hf_name, full tensor) pairs.
    Each stage yields only its own layers (with their global HF layer indices), the first stage
    the embedding, the last the final norm and (untied) lm_head. Tensors split over TP are
    all-gathered in buckets (one all_gather per `bucket_bytes` of full tensors, the shards of several
    tensors flattened into one buffer), so at most one bucket of full tensors is alive per rank beyond
    the shards, and the collectives are O(bytes / bucket_bytes), not O(tensors).
    Data-parallel / context-parallel replicas may run it independently (same results).
    MoE experts (expert parallelism): each expert tensor is gathered over its expert tensor-parallel
    group, then over the stage's expert-parallel group (gather_experts_over_ep), so every rank of the
    stage yields every expert; the EP ranks must iterate in lockstep too.

gather_hf_weights_on_rank0(chunks, cfg)
    The whole model on global rank 0, stage after stage: each stage exports as above, and the
    rank of that stage in global rank 0's pipeline group sends its tensors to rank 0 in buckets
    (one pickled list of names, shapes and dtypes and one flat tensor per bucket). Every rank
    must exhaust the generator; it yields only on global rank 0 (nothing elsewhere).

hf_weights_on_every_rank(chunks, cfg)
    The whole model on EVERY rank, stage after stage: each stage exports as above and broadcasts
    its tensors over its pipeline group in buckets the same way (colocated engines: each trainer
    rank feeds the engine on its own GPU, which needs every layer). Every rank iterates it in lockstep.
"""
from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.convert.mappings import bind
from megatron_grpo.models.builder import unwrap
from megatron_grpo.models.hf_config import ModelArchitecture


EXPORT_BUCKET_BYTES = 512 * 2**20  # full tensors gathered (or sent between stages) per collective


def export_hf_weights(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture,
                      dtype: torch.dtype | None = None,
                      bucket_bytes: int = EXPORT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) for every HF tensor this pipeline stage owns; see module doc."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_group = ps.get_tensor_model_parallel_group()
    pending: list = []  # items held back, in model order, until their bucket's one gather
    for chunk in model_chunks:
        for item in bind(unwrap(chunk), cfg):
            if not item.rule.export:
                continue
            if item.expert is not None:  # gathered over expert TP and EP (gather_experts_over_ep)
                yield from _bucket(pending, cfg, dtype, tp_size, tp_group)
                pending = []
                yield from gather_experts_over_ep(item, cfg, dtype)
                continue
            split = [i for i in pending if _split(i, tp_size)]
            if split and (_split(item, tp_size) and item.param.dtype != split[0].param.dtype
                          or _full_bytes(pending + [item], tp_size) > bucket_bytes):
                yield from _bucket(pending, cfg, dtype, tp_size, tp_group)
                pending = []
            pending.append(item)
    yield from _bucket(pending, cfg, dtype, tp_size, tp_group)


def _split(item, tp_size: int) -> bool:
    return bool(item.rule.transform.tp_split) and tp_size > 1


def _full_bytes(items, tp_size: int) -> int:
    return sum(item.param.numel() * item.param.element_size() * (tp_size if _split(item, tp_size) else 1)
               for item in items)


def _bucket(items, cfg: ModelArchitecture, dtype, tp_size: int, tp_group):
    """The items' HF tensors in order; the shards of the TP-split ones (one dtype) flattened into one
    buffer and all-gathered once."""
    split = [item for item in items if _split(item, tp_size)]
    shards: dict[int, list[torch.Tensor]] = {}
    if split:
        flat = torch.cat([_local(item).reshape(-1) for item in split])
        parts = [torch.empty_like(flat) for _ in range(tp_size)]
        dist.all_gather(parts, flat, group=tp_group)
        offset = 0
        for item in split:
            count, shape = item.param.numel(), item.param.shape
            shards[id(item)] = [part[offset:offset + count].view(shape) for part in parts]
            offset += count
    for item in items:
        for name, tensor in zip(item.hf_names, item.rule.transform.to_hf(shards.get(id(item), [_local(item)]),
                                                                         cfg)):
            tensor = tensor if dtype is None else tensor.to(dtype)
            yield name, tensor.contiguous()


def _local(item) -> torch.Tensor:
    """This rank's tensor of `item` as engines and HF files get it: a LoRA run's adapter merged in."""
    adapter = getattr(item.param, "lora_adapter", None)
    return item.param.detach() if adapter is None else adapter.merged(item.param.detach())


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def gather_experts_over_ep(item, cfg: ModelArchitecture, dtype: torch.dtype | None = None
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) of one local expert's tensor on every EP rank of this stage: the
    shards of each expert are gathered over its expert-TP group (item.shard_group), then the
    EP ranks' experts with the same local index (global index ep_rank * local count + local index)
    are gathered over the expert-parallel group. A collective over both groups."""
    from megatron.core import parallel_state as ps

    local = item.param.detach()
    shards = _all_gather(local, item.shard_group) if item.rule.transform.tp_split else [local]
    full = item.rule.transform.to_hf(shards, cfg)
    ep_group = ps.get_expert_model_parallel_group()
    ep_rank, ep_size = dist.get_rank(ep_group), dist.get_world_size(ep_group)
    per_rank = cfg.num_experts // ep_size
    local_index = item.expert - ep_rank * per_rank
    for name, tensor in zip(item.hf_names, full):
        for rank, part in enumerate(_all_gather(tensor, ep_group)):
            expert_name = _rename_expert(name, item.expert, rank * per_rank + local_index)
            yield expert_name, (part if dtype is None else part.to(dtype)).contiguous()


def _rename_expert(name: str, expert: int, other: int) -> str:
    marker = f".mlp.experts.{expert}."
    if marker not in name:
        raise ValueError(f"{name}: not the HF name of expert {expert}")
    return name.replace(marker, f".mlp.experts.{other}.")


_END = "__end_of_stage__"


def _stage_buckets(tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int):
    """(metadata, flat tensor) per bucket of one dtype: metadata lists each tensor's (name, shape)."""
    names, flats, size, kind = [], [], 0, None
    for name, tensor in tensors:
        if flats and (tensor.dtype != kind or size + tensor.numel() * tensor.element_size() > bucket_bytes):
            yield names, torch.cat(flats)
            names, flats, size = [], [], 0
        kind = tensor.dtype
        names.append((name, tuple(tensor.shape)))
        flats.append(tensor.reshape(-1))
        size += tensor.numel() * tensor.element_size()
    if flats:
        yield names, torch.cat(flats)


def _unpacked(names: list[tuple[str, tuple]], flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A received bucket's tensors, each its own storage (a writer such as safetensors refuses
    tensors that share one)."""
    offset = 0
    for name, shape in names:
        count = math.prod(shape)
        yield name, flat[offset:offset + count].view(shape).clone()
        offset += count


def gather_hf_weights_on_rank0(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture,
                               dtype: torch.dtype | None = None,
                               bucket_bytes: int = EXPORT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """All HF tensors of the model, yielded on global rank 0 only; every rank must exhaust it."""
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    my_stage = ps.get_pipeline_model_parallel_rank()
    on_rank0_chain = 0 in pp_ranks  # this rank's PP group is global rank 0's
    device = next(unwrap(model_chunks[0]).parameters()).device  # NCCL needs receive buffers on the GPU
    for stage in range(len(pp_ranks)):
        if stage == my_stage:
            sends = on_rank0_chain and rank != 0
            tensors = export_hf_weights(model_chunks, cfg, dtype, bucket_bytes)
            if rank == 0:
                yield from tensors
            elif sends:
                for names, flat in _stage_buckets(tensors, bucket_bytes):
                    dist.send_object_list([(names, flat.dtype, flat.numel())], dst=0)
                    dist.send(flat, dst=0)
                dist.send_object_list([_END], dst=0)
            else:
                for _ in tensors:  # the stage's collectives, in lockstep with its TP / EP peers
                    pass
        elif rank == 0:
            src = pp_ranks[stage]
            while True:
                meta = [None]
                dist.recv_object_list(meta, src=src)
                if meta[0] == _END:
                    break
                names, flat_dtype, numel = meta[0]
                flat = torch.empty(numel, dtype=flat_dtype, device=device)
                dist.recv(flat, src=src)
                yield from _unpacked(names, flat)


def hf_weights_on_every_rank(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture,
                             dtype: torch.dtype | None = None,
                             bucket_bytes: int = EXPORT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """All HF tensors of the model, yielded on every rank (see the module docstring): stage s's
    tensors are broadcast from its rank in each pipeline group, a bucket at a time."""
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    if len(pp_ranks) == 1:
        yield from export_hf_weights(model_chunks, cfg, dtype, bucket_bytes)
        return
    my_stage = ps.get_pipeline_model_parallel_rank()
    device = next(unwrap(model_chunks[0]).parameters()).device  # NCCL broadcasts device tensors
    for stage, src in enumerate(pp_ranks):
        if stage == my_stage:
            for names, flat in _stage_buckets(export_hf_weights(model_chunks, cfg, dtype, bucket_bytes),
                                              bucket_bytes):
                dist.broadcast_object_list([(names, flat.dtype, flat.numel())], src=src, group=pp_group)
                dist.broadcast(flat, src=src, group=pp_group)
                yield from _unpacked(names, flat)
            dist.broadcast_object_list([_END], src=src, group=pp_group)
            continue
        while True:
            meta = [None]
            dist.broadcast_object_list(meta, src=src, group=pp_group)
            if meta[0] == _END:
                break
            names, flat_dtype, numel = meta[0]
            flat = torch.empty(numel, dtype=flat_dtype, device=device)
            dist.broadcast(flat, src=src, group=pp_group)
            yield from _unpacked(names, flat)
