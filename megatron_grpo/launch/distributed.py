"""The default torch.distributed process group and this rank's device.

    ctx = init_distributed()                      # discovers ranks from the launcher's env
    initialize_model_parallel(ParallelLayout(tensor=2), seed=1234)
    ...
    shutdown()                                    # on every exit path (failed=True on an exception)

nccl on CUDA (one device per local rank: cuda:LOCAL_RANK), gloo on CPU. When the default group
already exists (the test harness made it), it is checked against the discovered ranks and kept.

Exit: a gloo worker thread releases a finished collective's tensors a moment after the caller's
wait() returned, and that release takes the GIL. If the interpreter has begun finalizing by then,
Python ends the thread (pthread_exit); its unwinding through gloo's noexcept destructor calls
std::terminate: "terminate called without an active exception", SIGABRT, exit 134. shutdown()
destroys the groups (which joins their workers) and then waits for the workers of groups that
megatron-core objects keep alive to park; init_distributed() also registers that wait with atexit,
which runs before finalization, for exit paths that never reach shutdown().
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import platform
import time
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
    from megatron_grpo.launch.lifetime import bind_children_to_this_process

    bind_children_to_this_process()  # megatron's checkpoint writers and their Manager die with us
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
    _register_exit_wait()
    log.info("rank %d/%d (local %d/%d, %s) joined %s on %s via %s", ranks.rank, ranks.world_size,
             ranks.local_rank, ranks.local_world_size, ranks.launcher, backend, device, ranks.init_method)
    return DistributedContext(ranks=ranks, backend=backend, device=device)


def _check_existing_group(ranks: RankInfo) -> None:
    if (dist.get_rank(), dist.get_world_size()) != (ranks.rank, ranks.world_size):
        raise LaunchError(
            f"torch.distributed is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
            f"but the {ranks.launcher} environment says rank {ranks.rank}/{ranks.world_size}")


def shutdown(*, failed: bool = False, idle_timeout_s: float = 10.0) -> None:
    """Ends this process's part in the job: destroys megatron's model-parallel groups and the default
    group (if they exist), then waits until every gloo worker thread is parked (see the module
    docstring). Idempotent. With failed=True (an exception is on its way out) nccl groups are left
    to the process exit: other ranks may still be inside a collective, and nccl's destroy, which
    aborts communicators, can then hang; gloo's destroy is local and always runs."""
    from megatron.core import parallel_state

    if failed and dist.is_initialized() and dist.get_backend() == "nccl":
        wait_for_idle_gloo_workers(idle_timeout_s)
        return
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    wait_for_idle_gloo_workers(idle_timeout_s)


_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
_FUTEX = {"x86_64": 202, "aarch64": 98}  # futex's syscall number
_FUTEX_WAIT = 0
_FUTEX_WAIT_BITSET = 9  # the futex op of glibc's pthread_cond_wait (flags masked off)
_registered = {"exit_wait": False}


def wait_for_idle_gloo_workers(timeout_s: float = 10.0) -> list[int]:
    """Blocks until every gloo worker thread of this process is parked, i.e. sleeps in the untimed
    condition-variable wait of its run loop, which it enters only after releasing its last work
    (and so the tensors whose release needs the GIL). A worker busy with a collective, or waiting
    for the GIL (a timed wait), is not parked. Looks every 1 ms (the sleep also lets a worker take
    the GIL) until two looks in a row find all parked. Returns the thread ids still busy after
    `timeout_s` (and logs a warning); [] at once where /proc/self/task/*/syscall cannot tell (not
    Linux x86_64 / aarch64)."""
    futex = _FUTEX.get(platform.machine())
    if futex is None or not os.path.isdir("/proc/self/task"):
        return []
    deadline = time.monotonic() + timeout_s
    parked_before = False
    while True:
        busy = [tid for tid in _gloo_worker_threads() if not _parked(tid, futex)]
        if not busy and parked_before:  # two looks 1 ms apart: not a momentary futex wait
            return []
        parked_before = not busy
        if time.monotonic() >= deadline:
            log.warning("%d gloo worker threads are still busy %.0f s after the last collective (a peer "
                        "stopped mid-collective?); exiting anyway, which may abort", len(busy), timeout_s)
            return busy
        time.sleep(0.001)


def _gloo_worker_threads() -> list[int]:
    tids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as handle:
                if handle.read().strip() == _GLOO_WORKER:
                    tids.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return tids


def _parked(tid: int, futex: int) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/syscall") as handle:
            fields = handle.read().split()  # "nr arg0..arg5 sp pc", or "running"
    except OSError:  # the thread ended meanwhile: nothing left to release
        return True
    if len(fields) < 5 or fields[0] != str(futex):
        return False
    op, timeout = int(fields[2], 16), int(fields[4], 16)
    # Untimed waits only: the run loop's condition variable (WAIT_BITSET) and a plain WAIT, in
    # which one worker of the trainer sits for good after its group is gone (seen on every run;
    # counting it busy cost every exit 2 x 10 s). The GIL is a timed wait, so it never counts.
    return op & 0x7F in (_FUTEX_WAIT, _FUTEX_WAIT_BITSET) and timeout == 0


def _register_exit_wait() -> None:
    # atexit handlers run before the interpreter starts finalizing (when the abort would happen).
    if not _registered["exit_wait"]:
        atexit.register(wait_for_idle_gloo_workers)
        _registered["exit_wait"] = True
