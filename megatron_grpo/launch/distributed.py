"""The default torch.distributed process group and this rank's device.

    ctx = init_distributed()                      # discovers ranks from the launcher's env
    initialize_model_parallel(ParallelLayout(tensor=2), seed=1234)
    ...
    shutdown()                                    # on every exit path (failed=True on an exception)

nccl on CUDA (one device per local rank: cuda:LOCAL_RANK), gloo on CPU. When the default group
already exists (the test harness made it), it is checked against the discovered ranks and kept.

Rendezvous: with several ranks, rank 0 hosts a TCPStore at MASTER_ADDR:MASTER_PORT and every rank
joins it before the group is made (`_join_rendezvous`); torch's own tcp:// rendezvous would wait
for missing ranks (a WORLD_SIZE=2 exported with one process started, a node that never came up)
for the whole collective timeout without a word. Ours says what it waits for after a few seconds
(which rank, how many more ranks, where, the deadline) and again every 30 s, and fails after
$GRPO_RENDEZVOUS_TIMEOUT_S (600 s) with a LaunchError naming the address and the ranks that came;
a MASTER_ADDR that does not resolve is a LaunchError before any of it (`check_master_addr`).
Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) torchrun has already gathered the
ranks: each rank joins that store as a client, under a prefix per restart attempt
(TORCHELASTIC_RESTART_COUNT). torchrun keeps the store across `--max-restarts`, and the process
groups' names repeat from one attempt to the next, so without the prefix the restarted ranks read
the dead attempt's gloo addresses and fail to connect (measured: `torchrun --max-restarts 1` after
a kill -9 of rank 1 failed in megatron's first new_group).

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
import socket
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from megatron_grpo.errors import LaunchError
from megatron_grpo.launch.env import MPI, SLURM, RankInfo, discover_ranks

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_ENV = "GRPO_RENDEZVOUS_TIMEOUT_S"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0
_JOINED_KEY = "megatron_grpo/rendezvous/joined"
_NOTICE = {"first_s": 3.0, "every_s": 30.0}  # when a waiting rank says what it waits for


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
    if ranks.world_size > 1 and not dist.is_initialized():
        check_master_addr(ranks, os.environ if env is None else env)
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
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if ranks.world_size > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        store = _join_rendezvous(ranks, rendezvous_timeout_s(), timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=ranks.rank,
                                world_size=ranks.world_size, timeout=timeout)
    elif ranks.world_size > 1:  # torchrun's agent gathered the ranks; its store outlives a restart
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        store = dist.TCPStore(ranks.master_addr, ranks.master_port, ranks.world_size, is_master=False,
                              timeout=timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"default_pg/attempt_{attempt}", store),
                                rank=ranks.rank, world_size=ranks.world_size, timeout=timeout)
    else:  # one process (port 0: it binds its own)
        dist.init_process_group(backend=backend, init_method=ranks.init_method, rank=ranks.rank,
                                world_size=ranks.world_size, timeout=timeout)
    _register_exit_wait()
    log.info("rank %d/%d (local %d/%d, %s) joined %s on %s via %s", ranks.rank, ranks.world_size,
             ranks.local_rank, ranks.local_world_size, ranks.launcher, backend, device, ranks.init_method)
    return DistributedContext(ranks=ranks, backend=backend, device=device)


def check_master_addr(ranks: RankInfo, env: Mapping[str, str]) -> None:
    """LaunchError when the master address does not resolve: the rendezvous would otherwise wait
    its whole timeout (600 s) with notices that never say why nobody answers. A temporary DNS
    failure (EAI_AGAIN) is asked again, twice, a second apart."""
    for attempt in range(3):
        try:
            socket.getaddrinfo(ranks.master_addr, ranks.master_port, type=socket.SOCK_STREAM)
            return
        except (socket.gaierror, UnicodeError) as exc:
            if getattr(exc, "errno", None) == socket.EAI_AGAIN and attempt < 2:
                time.sleep(1.0)
                continue
            reason = getattr(exc, "strerror", None) or str(exc)
            where = (f"MASTER_ADDR={ranks.master_addr}" if env.get("MASTER_ADDR") == ranks.master_addr
                     else f"the master address {ranks.master_addr} (from the {ranks.launcher} environment)")
            raise LaunchError(f"{where} does not resolve to an address ({reason}): set MASTER_ADDR to rank 0's "
                              f"hostname or IP address, one every node can resolve") from None


def rendezvous_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """How long the ranks may take to gather: $GRPO_RENDEZVOUS_TIMEOUT_S, else 600 s."""
    raw = (os.environ if env is None else env).get(RENDEZVOUS_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise LaunchError(f"{RENDEZVOUS_TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0")
    return value


def _join_rendezvous(ranks: RankInfo, timeout_s: float, store_timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0 hosts the store, every rank adds itself to a counter in it and waits until all
    world_size have; a rank that waits says so after _NOTICE["first_s"] and every _NOTICE["every_s"],
    and raises LaunchError after timeout_s (see the module docstring). Returns the store."""
    where = f"{ranks.master_addr}:{ranks.master_port}"
    job = f"WORLD_SIZE={ranks.world_size} from the {ranks.launcher} environment"
    start = time.monotonic()
    deadline = start + timeout_s
    next_notice = [start + _NOTICE["first_s"]]

    def notice(text: str) -> None:
        now = time.monotonic()
        if now >= next_notice[0]:
            log.warning("%s; %.0f s waited, gives up after %g s (%s)", text, now - start, timeout_s,
                        RENDEZVOUS_TIMEOUT_ENV)
            next_notice[0] = now + _NOTICE["every_s"]

    if ranks.rank == 0:
        try:
            store = dist.TCPStore(ranks.master_addr, ranks.master_port, ranks.world_size, is_master=True,
                                  wait_for_workers=False, timeout=store_timeout, multi_tenant=True)
        except RuntimeError as exc:
            raise LaunchError(f"rank 0 cannot open the rendezvous at {where} ({job}): {exc}") from None
    else:
        # A TCPStore client retries in silence until its timeout (and torch prints a C++ trace per
        # failed try): a plain connection tells whether rank 0 listens yet.
        while not _accepts(ranks.master_addr, ranks.master_port):
            if time.monotonic() >= deadline:
                raise LaunchError(f"rank {ranks.rank}: nobody opened the rendezvous at {where} within {timeout_s:g} s "
                                  f"({job}): rank 0 is not running there; start it, or correct MASTER_ADDR / "
                                  f"MASTER_PORT")
            notice(f"rank {ranks.rank} waits for rank 0 to open the rendezvous at {where} ({job})")
            time.sleep(0.25)
        remaining = max(deadline - time.monotonic(), 5.0)
        store = dist.TCPStore(ranks.master_addr, ranks.master_port, ranks.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=remaining))
        store.set_timeout(store_timeout)
    joined = store.add(_JOINED_KEY, 1)
    while joined < ranks.world_size:
        if time.monotonic() >= deadline:
            raise LaunchError(f"rendezvous at {where}: {joined} of {ranks.world_size} ranks joined within "
                              f"{timeout_s:g} s ({job}): start the missing ranks (torchrun --nproc-per-node, "
                              f"srun --ntasks, mpirun -n), or unset WORLD_SIZE and RANK to run one process")
        missing = ranks.world_size - joined
        notice(f"rank {ranks.rank} waits for {missing} more rank{'s' if missing > 1 else ''} at {where} "
               f"({joined} of {ranks.world_size} joined; {job})")
        time.sleep(0.05)
        joined = store.add(_JOINED_KEY, 0)
    return store


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


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
