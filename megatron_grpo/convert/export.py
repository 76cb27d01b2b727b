"""Stream the sharded Megatron model out as full HF-named tensors, one tensor at a time.

export_hf_weights(chunks, cfg)
    Per pipeline stage. A collective over this rank's TP group: every TP rank of the stage must
    iterate it in lockstep, and EVERY TP rank yields the same (hf_name, full tensor) pairs.
    Each stage yields only its own layers (with their global HF layer indices), the first stage
    the embedding, the last the final norm and (untied) lm_head. Tensors split over TP are
    all-gathered one at a time, so at most one full tensor is alive per rank beyond the shards.
    Data-parallel / context-parallel replicas may run it independently (same results).
    MoE experts (expert parallelism): each expert tensor is gathered over its expert tensor-parallel
    group, then over the stage's expert-parallel group (gather_experts_over_ep), so every rank of the
    stage yields every expert; the EP ranks must iterate in lockstep too.

gather_hf_weights_on_rank0(chunks, cfg)
    The whole model on global rank 0, stage after stage: each stage exports as above, and the
    rank of that stage in global rank 0's pipeline group sends each tensor to rank 0. Every rank
    must exhaust the generator; it yields only on global rank 0 (nothing elsewhere).

hf_weights_on_every_rank(chunks, cfg)
    The whole model on EVERY rank, stage after stage: each stage exports as above and broadcasts
    each tensor over its pipeline group (colocated engines: each trainer rank feeds the engine on
    its own GPU, which needs every layer). Every rank iterates it in lockstep.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.convert.mappings import bind
from megatron_grpo.models.builder import unwrap
from megatron_grpo.models.hf_config import ModelArchitecture


def export_hf_weights(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) for every HF tensor this pipeline stage owns; see module doc."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_group = ps.get_tensor_model_parallel_group()
    for chunk in model_chunks:
        for item in bind(unwrap(chunk), cfg):
            if not item.rule.export:
                continue
            if item.expert is not None:
                yield from gather_experts_over_ep(item, cfg, dtype)
                continue
            local = item.param.detach()
            if item.rule.transform.tp_split and tp_size > 1:
                shards = [torch.empty_like(local) for _ in range(tp_size)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
            else:
                shards = [local]
            for name, tensor in zip(item.hf_names, item.rule.transform.to_hf(shards, cfg)):
                tensor = tensor if dtype is None else tensor.to(dtype)
                yield name, tensor.contiguous()


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


def gather_hf_weights_on_rank0(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture,
                               dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
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
            for name, tensor in export_hf_weights(model_chunks, cfg, dtype):
                if rank == 0:
                    yield name, tensor
                elif sends:
                    dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=0)
                    dist.send(tensor, dst=0)
            if sends:
                dist.send_object_list([_END], dst=0)
        elif rank == 0:
            src = pp_ranks[stage]
            while True:
                meta = [None]
                dist.recv_object_list(meta, src=src)
                if meta[0] == _END:
                    break
                name, shape, tensor_dtype = meta[0]
                tensor = torch.empty(shape, dtype=tensor_dtype, device=device)
                dist.recv(tensor, src=src)
                yield name, tensor


def hf_weights_on_every_rank(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture,
                             dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """All HF tensors of the model, yielded on every rank (see the module docstring): stage s's
    tensors are broadcast from its rank in each pipeline group, one tensor at a time."""
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    if len(pp_ranks) == 1:
        yield from export_hf_weights(model_chunks, cfg, dtype)
        return
    my_stage = ps.get_pipeline_model_parallel_rank()
    device = next(unwrap(model_chunks[0]).parameters()).device  # NCCL broadcasts device tensors
    for stage, src in enumerate(pp_ranks):
        if stage == my_stage:
            for name, tensor in export_hf_weights(model_chunks, cfg, dtype):
                dist.broadcast_object_list([(name, tuple(tensor.shape), tensor.dtype)], src=src, group=pp_group)
                dist.broadcast(tensor, src=src, group=pp_group)
                yield name, tensor
            dist.broadcast_object_list([_END], src=src, group=pp_group)
            continue
        while True:
            meta = [None]
            dist.broadcast_object_list(meta, src=src, group=pp_group)
            if meta[0] == _END:
                break
            name, shape, tensor_dtype = meta[0]
            tensor = torch.empty(shape, dtype=tensor_dtype, device=device)
            dist.broadcast(tensor, src=src, group=pp_group)
            yield name, tensor
