"""The gloo test harness: results by rank, child errors with tracebacks, timeouts, deaths."""
from __future__ import annotations

import time

import pytest

from megatron_grpo.testing.distributed import DistributedChildError, run_distributed


def _rank_and_allreduce(rank, world_size, scale):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return {"rank": rank, "world": world_size, "sum": value.item() * scale,
            "env_rank": int(__import__("os").environ["RANK"])}


def test_results_come_back_by_rank():
    results = run_distributed(_rank_and_allreduce, world_size=4, args=(10.0,), timeout=60)
    assert results == [{"rank": r, "world": 4, "sum": 60.0, "env_rank": r} for r in range(4)]


def test_world_size_one():
    assert run_distributed(_rank_and_allreduce, world_size=1, args=(1.0,), timeout=60) == [
        {"rank": 0, "world": 1, "sum": 0.0, "env_rank": 0}]


def _raise_on_rank_one(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        _helper_that_fails(rank)
    dist.barrier()  # rank 0 blocks here: the harness must not wait for it to time out


def _helper_that_fails(rank):
    raise ValueError(f"boom from rank {rank}")


def test_child_exception_is_reraised_with_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedChildError) as caught:
        run_distributed(_raise_on_rank_one, world_size=2, timeout=60)
    message = str(caught.value)
    assert "_raise_on_rank_one failed on rank 1" in message
    assert "Traceback (most recent call last)" in message
    assert "_helper_that_fails" in message and "ValueError: boom from rank 1" in message
    assert time.monotonic() - start < 30  # rank 0 was killed, not waited for


def _sleep_forever(rank, world_size):
    time.sleep(3600)


def test_hang_becomes_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"_sleep_forever: ranks \[0, 1\] did not finish within 2s"):
        run_distributed(_sleep_forever, world_size=2, timeout=2)
    assert time.monotonic() - start < 15


def _die_on_rank_zero(rank, world_size):
    import os

    if rank == 0:
        os._exit(7)
    time.sleep(3600)


def test_child_death_is_reported():
    with pytest.raises(DistributedChildError, match="rank 0 exited with code 7 before reporting"):
        run_distributed(_die_on_rank_zero, world_size=2, timeout=60)


def _square(x):
    return x * x


def _start_a_process(rank, world_size):
    import multiprocessing

    # megatron's checkpoint writer forks workers; that needs non-daemonic harness children.
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(_square, (rank + 2,))


def test_children_may_start_processes():
    assert run_distributed(_start_a_process, world_size=2, timeout=60) == [4, 9]
