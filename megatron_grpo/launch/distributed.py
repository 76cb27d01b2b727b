"""The default torch.distributed process group and this rank's device.

    ctx = init_distributed()                      # discovers ranks from the launcher's env
    initialize_model_parallel(ParallelLayout(tensor=2), seed=1234)
    ...
    shutdown()

nccl on CUDA (one device per local rank: cuda:LOCAL_RANK), gloo on CPU. When the default group
already exists (the test harness made it), it is checked against the discovered ranks and kept.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from megatron_grpo.errors import LaunchError
from megatron_grpo.launch.env import MPI, SLURM, RankInfo, discover_ranks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedContext:
    ranks: RankInfo
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.ranks.rank == 0


def select_backend(cuda_available: bool) -> str:
    return "nccl" if cuda_available else "gloo"


def select_device(local_rank: int, local_world_size: int, cuda_device_count: int | None,
                  launcher: str = "torchrun") -> torch.device:
    """cuda:local_rank, or cpu when `cuda_device_count` is None (no CUDA). Each local rank needs
    its own device: two ranks on one GPU would deadlock nccl or run out of memory.

    Slurm and MPI can bind one GPU per task (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per
    rank): then every rank sees exactly one device, and it is cuda:0."""
    if cuda_device_count is None:
        return torch.device("cpu")
    if cuda_device_count == 1 and local_world_size > 1 and launcher in (SLURM, MPI):
        return torch.device("cuda", 0)
    if local_world_size > cuda_device_count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise LaunchError(
            f"{local_world_size} ranks on this node but only {cuda_device_count} CUDA devices are visible "
            f"(CUDA_VISIBLE_DEVICES={visible}); start at most {cuda_device_count} processes per node "
            f"(torchrun --nproc-per-node, srun --ntasks-per-node) or give each task its own GPU")
    return torch.device("cuda", local_rank)


def init_distributed(ranks: RankInfo | None = None, *, env: Mapping[str, str] | None = None,
                     backend: str | None = None, timeout_minutes: float = 30.0,
                     mpi_comm: Any = None) -> DistributedContext:
    """Initialises the default process group for this rank and binds its device.

    `ranks` defaults to discover_ranks(env or os.environ). `backend` defaults to nccl with CUDA,
    gloo without. Safe to call when the group already exists with the same rank and world."""
    if ranks is None:
        ranks = discover_ranks(os.environ if env is None else env, mpi_comm=mpi_comm)
    cuda = torch.cuda.is_available()
    device = select_device(ranks.local_rank, ranks.local_world_size, torch.cuda.device_count() if cuda else None,
                           ranks.launcher)
    backend = backend or select_backend(cuda)
    if backend == "nccl" and not cuda:
        raise LaunchError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False; use 'gloo'")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        _check_existing_group(ranks)
        return DistributedContext(ranks=ranks, backend=dist.get_backend(), device=device)
    dist.init_process_group(backend=backend, init_method=ranks.init_method, rank=ranks.rank,
                            world_size=ranks.world_size,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    log.info("rank %d/%d (local %d/%d, %s) joined %s on %s via %s", ranks.rank, ranks.world_size,
             ranks.local_rank, ranks.local_world_size, ranks.launcher, backend, device, ranks.init_method)
    return DistributedContext(ranks=ranks, backend=backend, device=device)


def _check_existing_group(ranks: RankInfo) -> None:
    if (dist.get_rank(), dist.get_world_size()) != (ranks.rank, ranks.world_size):
        raise LaunchError(
            f"torch.distributed is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
            f"but the {ranks.launcher} environment says rank {ranks.rank}/{ranks.world_size}")


def shutdown() -> None:
    """Destroys megatron's model-parallel groups and the default group (if they exist)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_from_rank0(value: Any) -> Any:
    """Every rank gets global rank 0's `value` (a small picklable object; others pass anything)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
