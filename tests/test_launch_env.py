"""Rank discovery from synthetic launcher environments, device selection, and init_distributed."""
from __future__ import annotations

import errno

import pytest

from megatron_grpo.errors import ConfigError, LaunchError
from megatron_grpo.launch.env import (
    RankInfo,
    detect_launcher,
    discover_ranks,
    free_server_port,
    parse_slurm_nodelist,
    parse_slurm_tasks_per_node,
    slurm_port_for_job,
)

TORCHRUN_ENV = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "node-a", "MASTER_PORT": "29501"}
# Task 6 of `srun -N2 -n8` (4 per node), as srun sets it.
SLURM_ENV = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
             "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "123456",
             "SLURM_JOB_NODELIST": "gpu-[07-08]"}
OMPI_ENV = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


class FakeComm:
    """mpi4py's bcast protocol for one simulated rank: root's object reaches everyone."""

    def __init__(self, root_value=None):
        self.root_value = root_value
        self.calls = []

    def bcast(self, obj, root=0):
        self.calls.append((obj, root))
        return obj if self.root_value is None else self.root_value


# ----------------------------------------------------------------------------- nodelists


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu-[01-03,07]", ["gpu-01", "gpu-02", "gpu-03", "gpu-07"]),
    ("node1,node2", ["node1", "node2"]),
    ("a[1-2],b[5]", ["a1", "a2", "b5"]),
    ("rack1-node[001-004]", ["rack1-node001", "rack1-node002", "rack1-node003", "rack1-node004"]),
    ("vm", ["vm"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("c[09-10],login", ["c09", "c10", "login"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
])
def test_nodelist_forms(nodelist, hosts):
    assert parse_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, complaint", [
    ("gpu-[01-03", r"unbalanced '\['"),
    ("gpu-01]", "unbalanced ']'"),
    ("gpu-[a-b]", "cannot parse range"),
    ("gpu-[3-1]", "descending range"),
    ("a,,b", "empty host name"),
    ("", "empty host name"),
])
def test_nodelist_errors(nodelist, complaint):
    with pytest.raises(LaunchError, match=complaint):
        parse_slurm_nodelist(nodelist)


def test_tasks_per_node():
    assert parse_slurm_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert parse_slurm_tasks_per_node("8") == [8]
    with pytest.raises(LaunchError, match="tasks per node"):
        parse_slurm_tasks_per_node("4(2)")


# ----------------------------------------------------------------------------- launchers


def test_torchrun():
    info = discover_ranks(TORCHRUN_ENV)
    assert info == RankInfo(rank=5, world_size=8, local_rank=1, local_world_size=4, master_addr="node-a",
                            master_port=29501, launcher="torchrun")
    assert info.init_method == "tcp://node-a:29501"


def test_torchrun_wins_inside_srun():
    # `srun torchrun ...`: the worker also carries its srun task's variables (one task per node).
    env = {**SLURM_ENV, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", **TORCHRUN_ENV}
    assert discover_ranks(env).launcher == "torchrun"
    assert discover_ranks(env).rank == 5


def test_torchrun_missing_variable_is_named():
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_PORT"}
    with pytest.raises(LaunchError, match="torchrun: environment variable MASTER_PORT is missing"):
        discover_ranks(env)


def test_torchrun_non_integer_is_named():
    with pytest.raises(LaunchError, match="RANK='x' is not an integer"):
        discover_ranks({**TORCHRUN_ENV, "RANK": "x"})


def test_rank_outside_world_is_rejected():
    with pytest.raises(LaunchError, match="rank 8 is outside world size 8"):
        discover_ranks({**TORCHRUN_ENV, "RANK": "8"})
    with pytest.raises(LaunchError, match="local rank 4 is outside local world size 4"):
        discover_ranks({**TORCHRUN_ENV, "LOCAL_RANK": "4"})


def test_ipv6_master_is_bracketed():
    info = discover_ranks({**TORCHRUN_ENV, "MASTER_ADDR": "fe80::1"})
    assert info.init_method == "tcp://[fe80::1]:29501"


def test_slurm():
    info = discover_ranks(SLURM_ENV)
    assert info == RankInfo(rank=6, world_size=8, local_rank=2, local_world_size=4, master_addr="gpu-07",
                            master_port=slurm_port_for_job(123456), launcher="slurm")


def test_slurm_port_is_per_job_and_overridable():
    assert discover_ranks(SLURM_ENV).master_port == discover_ranks({**SLURM_ENV, "SLURM_PROCID": "0"}).master_port
    other_job = discover_ranks({**SLURM_ENV, "SLURM_JOB_ID": "123457"}).master_port
    assert other_job != discover_ranks(SLURM_ENV).master_port
    assert all(15000 <= slurm_port_for_job(job) < 30000 for job in (0, 1, 14999, 15000, 10**9))
    explicit = discover_ranks({**SLURM_ENV, "MASTER_PORT": "40000", "MASTER_ADDR": "10.0.0.1"})
    assert (explicit.master_addr, explicit.master_port) == ("10.0.0.1", 40000)


def test_slurm_step_variables_win_over_job_variables():
    # srun -n 2 inside an allocation of 8 tasks on gpu-[01-04]: the step runs on gpu-03 only.
    env = {**SLURM_ENV, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "gpu-03",
           "SLURM_JOB_NODELIST": "gpu-[01-04]"}
    info = discover_ranks(env)
    assert (info.world_size, info.local_world_size, info.master_addr) == (2, 2, "gpu-03")


def test_slurm_ntasks_per_node_and_uneven_nodes():
    assert discover_ranks({**SLURM_ENV, "SLURM_NTASKS_PER_NODE": "4",
                           "SLURM_TASKS_PER_NODE": "9"}).local_world_size == 4
    # 7 tasks as "4,3": the second node has 3.
    uneven = {**SLURM_ENV, "SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": "4,3", "SLURM_PROCID": "5",
              "SLURM_LOCALID": "1", "SLURM_NODEID": "1"}
    assert discover_ranks(uneven).local_world_size == 3
    with pytest.raises(LaunchError, match="SLURM_NODEID=2 but SLURM_TASKS_PER_NODE='4,3' lists 2 nodes"):
        discover_ranks({**uneven, "SLURM_NODEID": "2"})


def test_slurm_missing_variables_are_named():
    env = {k: v for k, v in SLURM_ENV.items() if k != "SLURM_JOB_NODELIST"}
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST is missing"):
        discover_ranks(env)
    env = {k: v for k, v in SLURM_ENV.items() if k != "SLURM_TASKS_PER_NODE"}
    with pytest.raises(LaunchError, match="cannot tell the tasks on this node"):
        discover_ranks(env)
    env = {k: v for k, v in SLURM_ENV.items() if k != "SLURM_JOB_ID"}
    with pytest.raises(LaunchError, match="SLURM_JOB_ID is missing"):
        discover_ranks(env)


def test_slurm_batch_script_without_srun():
    batch = {k: v for k, v in SLURM_ENV.items() if k != "SLURM_STEP_ID"}
    batch.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    with pytest.raises(LaunchError, match="not started by srun"):
        discover_ranks(batch)
    single = discover_ranks({**batch, "SLURM_NTASKS": "1"})
    assert (single.launcher, single.world_size) == ("none", 1)


def test_openmpi_with_master_addr():
    info = discover_ranks({**OMPI_ENV, "MASTER_ADDR": "head", "MASTER_PORT": "23456"})
    assert info == RankInfo(rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="head",
                            master_port=23456, launcher="mpi")


def test_mpi_master_from_communicator():
    # Not rank 0: the address and port are whatever rank 0 broadcast.
    comm = FakeComm(root_value=("rank0-host", 31337))
    info = discover_ranks(OMPI_ENV, mpi_comm=comm)
    assert (info.master_addr, info.master_port) == ("rank0-host", 31337)
    assert comm.calls == [(None, 0)]
    # Rank 0 broadcasts its own hostname and a port.
    comm0 = FakeComm()
    info0 = discover_ranks({**OMPI_ENV, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
                           mpi_comm=comm0)
    sent_host, sent_port = comm0.calls[0][0]
    assert (info0.master_addr, info0.master_port) == (sent_host, sent_port) and 0 < sent_port < 65536


def test_mpi_without_mpi4py_or_master_addr(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` raise ImportError
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set and mpi4py is not installed"):
        discover_ranks(OMPI_ENV)


def test_pmi_ranks():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
           "MASTER_ADDR": "head"}
    info = discover_ranks(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (2, 4, 0, 2)
    assert info.master_port == 29500
    # srun --mpi=pmi2 direct launch: local layout from Slurm.
    direct = {"PMI_RANK": "5", "PMI_SIZE": "8", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
              "SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "MASTER_ADDR": "head"}
    info = discover_ranks(direct)
    assert (info.launcher, info.local_rank, info.local_world_size) == ("mpi", 1, 4)


def test_mpirun_inside_slurm_allocation_uses_mpi_ranks():
    env = {**SLURM_ENV, "SLURM_PROCID": "0", **OMPI_ENV, "MASTER_ADDR": "gpu-07"}
    assert detect_launcher(env) == "mpi"
    assert discover_ranks(env).rank == 3


def test_no_launcher():
    info = discover_ranks({})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (0, 1, 0, 1)
    assert (info.launcher, info.master_addr) == ("none", "127.0.0.1")
    # port 0: the process binds a port the OS picks when it binds, so no other process can take it first
    assert (info.master_port, info.init_method) == (0, "tcp://127.0.0.1:0")
    with pytest.raises(LaunchError, match="master port 0 is not a TCP port"):
        RankInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, master_addr="h", master_port=0,
                 launcher="torchrun")


# ----------------------------------------------------------------------------- layout and devices


def test_world_size_not_divisible_by_model_parallel():
    from megatron_grpo.launch.parallel import ParallelLayout

    layout = ParallelLayout(tensor=2, pipeline=2, context=1)
    assert layout.data_parallel_size(8) == 2
    with pytest.raises(LaunchError, match=r"world size 6 is not divisible by TP\*PP\*CP = 2\*2\*1 = 4"):
        layout.data_parallel_size(6)
    with pytest.raises(ConfigError, match="parallel.tensor=0"):
        ParallelLayout(tensor=0)
    with pytest.raises(ConfigError, match="parallel.virtual_pipeline=2"):
        ParallelLayout(pipeline=1, virtual_pipeline=2)


def test_device_selection():
    import torch

    from megatron_grpo.launch.distributed import select_backend, select_device

    assert select_device(3, 4, cuda_device_count=None) == torch.device("cpu")
    assert select_device(3, 4, cuda_device_count=8) == torch.device("cuda", 3)
    with pytest.raises(LaunchError, match="8 ranks on this node but only 4 CUDA devices are visible"):
        select_device(5, 8, cuda_device_count=4)
    # srun --gpus-per-task=1: each task sees only its own GPU.
    assert select_device(3, 4, cuda_device_count=1, launcher="slurm") == torch.device("cuda", 0)
    with pytest.raises(LaunchError, match="4 ranks on this node but only 1 CUDA devices"):
        select_device(3, 4, cuda_device_count=1, launcher="torchrun")
    assert (select_backend(True), select_backend(False)) == ("nccl", "gloo")


def _init_from_env(rank, world_size):
    import torch
    import torch.distributed as dist

    from megatron_grpo.launch.distributed import init_distributed, shutdown

    ctx = init_distributed()  # torchrun-style variables set by the harness
    again = init_distributed()  # the group exists: checked and kept
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    result = (ctx.ranks.rank, ctx.ranks.world_size, ctx.backend, str(ctx.device), again.backend, total.item())
    shutdown()
    return result, dist.is_initialized()


def test_init_distributed_from_torchrun_env():
    from megatron_grpo.testing.distributed import run_distributed

    results = run_distributed(_init_from_env, world_size=2, init_group=False, timeout=60)
    assert results == [((r, 2, "gloo", "cpu", "gloo", 3.0), False) for r in range(2)]


def _init_with_wrong_rank(rank, world_size):
    import os

    from megatron_grpo.launch.distributed import init_distributed

    os.environ["RANK"] = str(1 - rank)
    init_distributed()


def test_init_distributed_rejects_a_group_that_disagrees():
    from megatron_grpo.testing.distributed import DistributedChildError, run_distributed

    with pytest.raises(DistributedChildError, match="already initialised as rank"):
        run_distributed(_init_with_wrong_rank, world_size=2, timeout=60)


# ----------------------------------------------------------------------------- rendezvous ports


def _single_process_with_stolen_free_port(rank, world_size):
    import os
    import socket

    import torch
    import torch.distributed as dist

    from megatron_grpo.launch import env
    from megatron_grpo.launch.distributed import init_distributed, shutdown

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)  # no launcher: one process
    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    env.free_port = lambda host="127.0.0.1": thief.getsockname()[1]  # another process got there first
    ctx = init_distributed()
    total = torch.ones(1)
    dist.all_reduce(total)
    shutdown()
    thief.close()
    return ctx.ranks.launcher, total.item()


def test_single_process_rendezvous_cannot_lose_its_port():
    from megatron_grpo.testing.distributed import run_distributed

    assert run_distributed(_single_process_with_stolen_free_port, 1, init_group=False,
                           timeout=60) == [("none", 1.0)]


def _sum_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return total.item()


def test_harness_port_cannot_be_taken_before_rank0_listens(monkeypatch):
    """Another process binds the harness's rendezvous port between the harness choosing it and
    rank 0 listening on it (the EADDRINUSE once seen in the checkpoint tests): it must be refused."""
    import socket

    from megatron_grpo.testing import distributed as harness

    real_context, attempts = harness._get_context(), []

    class Racing:
        def __getattr__(self, name):
            return getattr(real_context, name)

        def Process(self, *args, **kwargs):  # noqa: N802 - multiprocessing's name
            if not attempts:  # the port is chosen, no rank has started yet
                thief = socket.socket()
                try:
                    thief.bind(("127.0.0.1", kwargs["args"][3]))
                    thief.listen()
                    attempts.append(thief)  # got it: rank 0 cannot listen any more
                except OSError as exc:
                    attempts.append(exc)
            return real_context.Process(*args, **kwargs)

    monkeypatch.setattr(harness, "_get_context", lambda: Racing())
    try:
        assert harness.run_distributed(_sum_ranks, 2, timeout=60) == [1.0, 1.0]
    finally:
        for attempt in attempts:
            if isinstance(attempt, socket.socket):
                attempt.close()
    assert isinstance(attempts[0], OSError) and attempts[0].errno == errno.EADDRINUSE, attempts


def test_server_ports_lie_below_the_ephemeral_range_and_skip_taken_ones(monkeypatch):
    """srun once took an engine's port from free_port() for its own I/O listener (both bind port 0)."""
    import socket

    from megatron_grpo.launch import env as launch_env

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    first = free_server_port(count=4, stride=10)
    assert first + 30 < low and (first >= 20000 or low < 21040)  # a range starting lower: [1024, low)
    with socket.socket() as thief:
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind, through the reservation
        thief.bind(("127.0.0.1", free_server_port()))
        taken = thief.getsockname()[1]
        free = next(p for p in range(low - 1, 20000, -1) if launch_env._bindable("127.0.0.1", p))
        picks = iter([taken, free])

        class Picks:
            def randrange(self, start, stop):
                return next(picks)

        monkeypatch.setattr(launch_env.random, "Random", Picks)
        assert free_server_port() == free


def test_a_server_port_is_handed_out_once_and_its_server_binds_it():
    """A test's router and one of its engines once drew the same port (each pick probed a port that
    no process bound yet): the router exited "Address already in use". A picked port stays bound
    here until its server starts: another pick, here or in another process, skips it, while a
    server (SO_REUSEADDR, as uvicorn, sglang-router, TCPStore and Slurm bind) still listens on it."""
    import socket
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed

    picked = {free_server_port(count=2, stride=10) for _ in range(50)}
    held = sorted(picked | {p + 10 for p in picked})
    assert len(held) == 100  # no port handed out twice, no pair overlapping another
    probe = ("import sys; from megatron_grpo.launch.env import _bindable; "
             "print([p for p in sys.argv[1:] if _bindable('127.0.0.1', int(p))])")
    other_process = subprocess.run([sys.executable, "-c", probe, *map(str, held)], capture_output=True, text=True,
                                   check=True)
    assert other_process.stdout.strip() == "[]"  # another process's free_server_port skips them all
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", held[0]))
        server.listen()
        with socket.create_connection(("127.0.0.1", held[0]), timeout=5):
            pass
    # the MPI rendezvous: rank 0 picks on every interface and torch's store listens there
    store = torch.distributed.TCPStore("127.0.0.1", free_server_port(""), 1, is_master=True,
                                       timeout=timedelta(seconds=10))
    store.set("rendezvous", "done")
    assert store.get("rendezvous") == b"done"


# ----------------------------------------------------------------------------- a rendezvous that cannot complete


def test_a_rendezvous_that_cannot_complete_says_what_it_waits_for_and_fails_by_its_deadline(monkeypatch, caplog):
    """WORLD_SIZE=2 exported with one process started used to wait in silence (torch's rendezvous,
    for the 30 min collective timeout). Each rank now says what it waits for within seconds, and
    fails at $GRPO_RENDEZVOUS_TIMEOUT_S with one line naming the address and what came. In-process,
    two threads: rank 0 of a 2-rank job whose rank 1 never starts, and rank 1 of a job whose rank 0
    is not running (nothing listens on its MASTER_PORT)."""
    import datetime
    import logging
    import threading
    import time

    from megatron_grpo.launch import distributed

    monkeypatch.setenv("GRPO_RENDEZVOUS_TIMEOUT_S", "2.5")
    monkeypatch.setitem(distributed._NOTICE, "first_s", 0.5)  # 3 s in a run: the test's deadline is shorter
    timeout_s = distributed.rendezvous_timeout_s()
    jobs = {rank: RankInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, master_addr="127.0.0.1",
                           master_port=free_server_port(), launcher="torchrun") for rank in (0, 1)}
    outcome = {}

    def join(rank):
        start = time.monotonic()
        try:
            distributed._join_rendezvous(jobs[rank], timeout_s, datetime.timedelta(seconds=30))
        except LaunchError as exc:
            outcome[rank] = (str(exc), time.monotonic() - start)

    with caplog.at_level(logging.WARNING, logger=distributed.__name__):
        threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    said = [r.getMessage() for r in caplog.records]
    where = {rank: f"127.0.0.1:{jobs[rank].master_port}" for rank in (0, 1)}
    error, elapsed = outcome[0]
    assert error == (f"rendezvous at {where[0]}: 1 of 2 ranks joined within 2.5 s (WORLD_SIZE=2 from the torchrun "
                     f"environment): start the missing ranks (torchrun --nproc-per-node, srun --ntasks, mpirun -n), "
                     f"or unset WORLD_SIZE and RANK to run one process") and 2.5 <= elapsed < 10
    assert any(f"rank 0 waits for 1 more rank at {where[0]} (1 of 2 joined" in m and "gives up after 2.5 s" in m
               for m in said), said
    error, elapsed = outcome[1]
    assert error.startswith(f"rank 1: nobody opened the rendezvous at {where[1]} within 2.5 s") and elapsed < 10
    assert any(f"rank 1 waits for rank 0 to open the rendezvous at {where[1]}" in m for m in said), said


def test_a_master_addr_that_does_not_resolve_is_one_line_at_once(monkeypatch):
    """MASTER_ADDR=<a host no resolver knows> waited the whole rendezvous timeout (600 s) with
    notices that never said why; init_distributed now names the variable and its value at once,
    before any rendezvous (here the timeout is 2 s: the old code failed after it, without a word
    about the name)."""
    import time

    from megatron_grpo.launch.distributed import init_distributed

    monkeypatch.setenv("GRPO_RENDEZVOUS_TIMEOUT_S", "2")
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29511"}
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        init_distributed(env=env)
    assert str(info.value).startswith("MASTER_ADDR=no-such-host.invalid does not resolve to an address (")
    assert "\n" not in str(info.value) and time.monotonic() - start < 2
