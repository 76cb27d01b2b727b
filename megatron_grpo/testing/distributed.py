"""Run a function in N gloo processes and collect the results (tests and benchmarks).

    results = run_distributed(my_fn, world_size=2, args=(x,), timeout=120)

`my_fn(rank, world_size, *args)` must be defined at module level (it is pickled by reference).
It runs in each process after `torch.distributed` is initialised with gloo on a localhost port
that this process holds reserved (launch.env.reserve_port) until the run ends, so no other process
can take it before rank 0 listens on it (pass `init_group=False` to let fn initialise it itself, e.g. through
launch.init_distributed(), from the torchrun-style variables RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT that every child gets). Its picklable return value is
results[rank]. A child's exception is re-raised here as DistributedChildError carrying the
child's rank and traceback; a hang becomes a TimeoutError. On any failure every child is killed
at once (its peers are usually blocked in a collective), and a child whose parent died exits by
itself instead of waiting in a collective for the gloo timeout; the processes a child forks
(megatron's checkpoint writers) die with it (launch.lifetime).

Children come from a forkserver that imported torch and megatron-core once, so a process costs
milliseconds instead of the ~2.5 s of a fresh interpreter. They are not daemonic, so they may
start processes of their own (megatron's checkpoint writer does).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from megatron_grpo.launch.env import free_port, free_server_port, reserve_port  # noqa: F401 - tests import the port helpers from here

_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
            "megatron.core.models.gpt", "megatron.core.pipeline_parallel", "megatron.core.optimizer"]
_PARENT_POLL_S = 1.0
_context = None  # one forkserver per test process; created on first use


class DistributedChildError(RuntimeError):
    """A distributed child raised or died; the message carries its rank and traceback."""


ChildProcessError_ = DistributedChildError  # the name this module used first


def _get_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _exit_when_parent_dies(parent_pid: int) -> None:
    def watch():
        while True:
            time.sleep(_PARENT_POLL_S)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(3)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _child(fn, rank, world_size, port, args, env, init_group, parent_pid, result_queue):
    try:
        _exit_when_parent_dies(parent_pid)
        from megatron_grpo.launch.lifetime import bind_children_to_this_process

        bind_children_to_this_process()
        os.environ.update(env)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N processes share few cores; more threads only contend
        if init_group:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size)
        result = fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
        # Report before tearing down: destroying the group makes the peers fail too, and their
        # secondary errors must not arrive ahead of this one.
        result_queue.put((rank, False, traceback.format_exc()))
        _teardown()
        return
    try:
        _teardown()
    except BaseException:  # noqa: BLE001
        result_queue.put((rank, False, traceback.format_exc()))
        return
    # Plain pickle copies tensors into the message; the queue's own pickler would share their
    # storage through file descriptors that die with this process.
    result_queue.put((rank, True, pickle.dumps(result)))


def _teardown():
    from megatron_grpo.launch.distributed import shutdown

    shutdown()


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    timeout: float = 300.0, env: dict[str, str] | None = None,
                    init_group: bool = True) -> list[Any]:
    """Runs fn(rank, world_size, *args) in world_size gloo processes; returns results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _get_context()
    result_queue = ctx.Queue()
    with reserve_port() as port:
        procs = [ctx.Process(target=_child, name=f"{fn.__name__}-rank{rank}",
                             args=(fn, rank, world_size, port, tuple(args), dict(env or {}), init_group,
                                   os.getpid(), result_queue))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        succeeded = False
        try:
            results = _collect(fn.__name__, procs, result_queue, timeout)
            succeeded = True
        finally:
            _stop(procs, graceful=succeeded)
    return [results[rank] for rank in range(world_size)]


def _collect(name: str, procs: list, result_queue, timeout: float) -> dict[int, Any]:
    world_size = len(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(results))
            raise TimeoutError(f"{name}: ranks {missing} did not finish within {timeout:g}s")
        try:
            rank, ok, payload = result_queue.get(timeout=min(remaining, 0.5))
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if not dead:
                continue
            try:  # a rank that exited right after queueing its result is not dead: drain once more
                rank, ok, payload = result_queue.get(timeout=1.0)
            except queue_module.Empty:
                raise DistributedChildError(f"{name}: rank {dead[0]} exited with code "
                                            f"{procs[dead[0]].exitcode} before reporting a result") from None
        if not ok:
            message = _failure_message(name, rank, payload, result_queue)
            # A rank that died without a word (os._exit, a signal) usually caused the others' failures
            # (their collectives lost a peer): it is named first.
            silent = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            deaths = "".join(f"{name}: rank {r} exited with code {code} before reporting a result\n"
                             for r, code in silent)
            raise DistributedChildError(deaths + message)
        results[rank] = pickle.loads(payload)
    return results


def _failure_message(name: str, rank: int, payload: str, result_queue, grace_s: float = 1.0) -> str:
    """The first failure, plus any other rank's that arrives within `grace_s` (often the
    consequence of the first, e.g. a peer's collective failing once the group is gone)."""
    message = f"{name} failed on rank {rank}:\n{payload}"
    deadline = time.monotonic() + grace_s
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            other_rank, ok, other_payload = result_queue.get(timeout=remaining)
        except queue_module.Empty:
            break
        if not ok:
            message += f"\n--- rank {other_rank} failed too ---\n{other_payload}"
    return message


def _stop(procs: list, graceful: bool) -> None:
    if graceful:
        for proc in procs:
            proc.join(timeout=10)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()
        proc.close()
