"""Who am I in the job? Rank discovery from the launcher's environment variables.

`discover_ranks(env)` is a pure function of an environment mapping (plus, for MPI, an optional
communicator), so tests drive it with synthetic environments. Launchers, in order of precedence:

  torchrun  RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
            Wins over everything: `srun torchrun ...` leaves the Slurm variables of the srun task
            (one task per node) in every worker, and only torchrun's describe the worker.
  mpi       OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE} (Open MPI) or PMI_RANK / PMI_SIZE
            with MPI_LOCALRANKID / MPI_LOCALNRANKS (MPICH, Intel MPI). Wins over Slurm: `mpirun`
            inside an allocation starts its daemons with srun, so SLURM_PROCID is the daemon's.
            The master address comes from mpi4py (rank 0's hostname and a free port, broadcast)
            when a communicator is given or mpi4py imports; else MASTER_ADDR must be set.
  slurm     SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, tasks per node from
            SLURM_NTASKS_PER_NODE or SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("4(x2),3"),
            master = first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST, port = MASTER_PORT
            or one derived from SLURM_JOB_ID (every task computes the same one). Only a task
            started by srun counts (SLURM_STEP_ID set): the batch script itself also has
            SLURM_PROCID=0 but is a single process.
  none      world 1 on 127.0.0.1, port 0: the process binds whichever port the OS gives it, so no
            other process can take the port between choosing and binding it.

Where a port must be chosen before the process that listens on it exists (a test harness starting
ranks, a launcher), reserve_port() holds it bound until the listener takes it over.
"""
from __future__ import annotations

import contextlib
import random
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

from megatron_grpo.errors import LaunchError

TORCHRUN = "torchrun"
MPI = "mpi"
SLURM = "slurm"
NO_LAUNCHER = "none"

DEFAULT_MASTER_PORT = 29500  # torchrun's default, used when MPI gives an address but no port
_SLURM_PORT_BASE = 15000  # ports derived from the job id fall in [15000, 30000): below the
_SLURM_PORT_SPAN = 15000  # Linux ephemeral range, so a client socket cannot already hold them
_EPHEMERAL_START = 32768  # Linux's default net.ipv4.ip_local_port_range starts here
_SERVER_PORT_START = 20000  # free_server_port picks from [20000, the ephemeral range)


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job and where rank 0 listens for the rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int  # 0: any free port (one process, which binds it itself)
    launcher: str

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(f"{self.launcher}: rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchError(f"{self.launcher}: local rank {self.local_rank} is outside local world size "
                              f"{self.local_world_size}")
        if self.local_world_size > self.world_size:
            raise LaunchError(f"{self.launcher}: local world size {self.local_world_size} exceeds world size "
                              f"{self.world_size}")
        if not 0 < self.master_port < 65536 and not (self.master_port == 0 and self.world_size == 1):
            raise LaunchError(f"{self.launcher}: master port {self.master_port} is not a TCP port (1-65535)")

    @property
    def init_method(self) -> str:
        """The tcp:// rendezvous URL for torch.distributed.init_process_group."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr  # IPv6
        return f"tcp://{host}:{self.master_port}"


def detect_launcher(env: Mapping[str, str]) -> str:
    """Which launcher started this process (see the module docstring for the precedence)."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return TORCHRUN
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return MPI
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return SLURM
    return NO_LAUNCHER


def discover_ranks(env: Mapping[str, str], mpi_comm: Any = None) -> RankInfo:
    """RankInfo for this process. `mpi_comm` is an mpi4py-like communicator (with bcast); by
    default mpi4py's COMM_WORLD is used when mpi4py imports and MASTER_ADDR is not set."""
    launcher = detect_launcher(env)
    if launcher == TORCHRUN:
        return _from_torchrun(env)
    if launcher == MPI:
        return _from_mpi(env, mpi_comm)
    if launcher == SLURM:
        return _from_slurm(env)
    _reject_unlaunched_slurm_allocation(env)
    return RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                    master_port=0, launcher=NO_LAUNCHER)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the OS picks it). Another process may take it
    before you bind it: prefer port 0 where the listener is this process, else reserve_port()."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_server_port(host: str = "127.0.0.1", count: int = 1, stride: int = 1) -> int:
    """A port p below this machine's ephemeral range with p, p + stride, ... (count ports) free now,
    for servers that a later process starts. free_port() hands out an ephemeral port, which any
    client socket or srun's own I/O listener (both bind port 0) may take before the server binds
    it; once srun held an engine's port and answered its health checks ("Insane message length").
    The ports stay reserved (_PortReservations) so that no other call hands them out meanwhile."""
    end = ephemeral_range_start() - count * stride
    start = _SERVER_PORT_START if end - _SERVER_PORT_START >= 1000 else 1024
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(start, end)
        ports = [first + k * stride for k in range(count)]
        if all(_bindable(host, port) for port in ports) and _RESERVATIONS.hold(host, ports):
            return first
    raise LaunchError(f"no {count} free ports {stride} apart in [{start}, {end}) on {host}")


class _PortReservations:
    """Ports handed out by free_server_port, kept bound (SO_REUSEADDR, never listening) by this
    process for a while. Between the pick and the server's bind, another pick (in this process or
    any other: _bindable probes without SO_REUSEADDR) used to get the same port: a test's router and
    one of its own engines once drew one port and the router exited "Address already in use". The
    servers themselves bind through a reservation: uvicorn (SGLang), sglang-router, torch's TCPStore,
    http.server and Slurm's daemons all set SO_REUSEADDR, and Linux lets such a socket bind a port
    whose holder does not listen. Ports are released _HOLD_S after their pick, by a later pick."""

    _HOLD_S = 900.0  # longer than any server here takes to start listening

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[float, socket.socket]] = []

    def hold(self, host: str, ports: list[int]) -> bool:
        """Reserves all of `ports`, or none (False) where one was bound since it was probed."""
        now = time.monotonic()
        with self._lock:
            for picked, sock in self._held:
                if now - picked > self._HOLD_S:
                    sock.close()
            self._held = [(picked, sock) for picked, sock in self._held if now - picked <= self._HOLD_S]
            new = []
            try:
                for port in ports:
                    new.append(_reusable_socket())
                    new[-1].bind((host, port))
            except OSError:
                for sock in new:
                    sock.close()
                return False
            self._held += [(now, sock) for sock in new]
            return True


_RESERVATIONS = _PortReservations()  # one per process: the ports are a machine-wide resource


def ephemeral_range_start() -> int:
    """The first port of net.ipv4.ip_local_port_range (Linux's default 32768 where it is unreadable)."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_START


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on host:port now: something listens there or holds it
    without SO_REUSEADDR. A free_server_port reservation (SO_REUSEADDR, not listening) is free."""
    sock = _reusable_socket()
    try:
        sock.bind((host, port))
        return False
    except OSError:
        return True
    finally:
        sock.close()


@contextlib.contextmanager
def reserve_port(host: str = "127.0.0.1"):
    """Yields a free TCP port that stays bound by this process until the block ends, so the OS gives
    it to no one else (no bind(0), no outgoing connection) in between. A listener that sets
    SO_REUSEADDR (torch's TCPStore, most servers) can bind and listen on it meanwhile: Linux lets a
    second SO_REUSEADDR socket bind a port whose holder is not listening."""
    sock = _reusable_socket()
    try:
        sock.bind((host, 0))
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _reusable_socket() -> socket.socket:
    """A TCP socket with SO_REUSEADDR: a listener that sets it too may bind its port while it is bound."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


# ----------------------------------------------------------------------------------- torchrun


def _from_torchrun(env: Mapping[str, str]) -> RankInfo:
    return RankInfo(
        rank=_int(env, "RANK", TORCHRUN),
        world_size=_int(env, "WORLD_SIZE", TORCHRUN),
        local_rank=_int(env, "LOCAL_RANK", TORCHRUN),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", TORCHRUN),
        master_addr=_str(env, "MASTER_ADDR", TORCHRUN),
        master_port=_int(env, "MASTER_PORT", TORCHRUN),
        launcher=TORCHRUN,
    )


# ----------------------------------------------------------------------------------------- MPI


def _from_mpi(env: Mapping[str, str], mpi_comm: Any) -> RankInfo:
    if "OMPI_COMM_WORLD_RANK" in env:
        rank = _int(env, "OMPI_COMM_WORLD_RANK", MPI)
        world_size = _int(env, "OMPI_COMM_WORLD_SIZE", MPI)
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", MPI)
        local_world_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", MPI)
    else:
        rank = _int(env, "PMI_RANK", MPI)
        world_size = _int(env, "PMI_SIZE", MPI)
        if "MPI_LOCALRANKID" not in env and "SLURM_LOCALID" in env:
            # srun --mpi=pmi2 direct launch: PMI gives the world, Slurm the node-local part.
            local_rank = _int(env, "SLURM_LOCALID", MPI)
            local_world_size = _slurm_local_world_size(env)
        else:
            local_rank = _int(env, "MPI_LOCALRANKID", MPI)
            local_world_size = _int(env, "MPI_LOCALNRANKS", MPI)
    if "MASTER_ADDR" in env:
        master_addr = _str(env, "MASTER_ADDR", MPI)
        master_port = _int(env, "MASTER_PORT", MPI) if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
    else:
        comm = mpi_comm if mpi_comm is not None else _mpi4py_comm_world()
        master_addr, master_port = comm.bcast((socket.gethostname(), free_server_port("")) if rank == 0 else None,
                                              root=0)
    return RankInfo(rank=rank, world_size=world_size, local_rank=local_rank,
                    local_world_size=local_world_size, master_addr=master_addr,
                    master_port=int(master_port), launcher=MPI)


def _mpi4py_comm_world() -> Any:
    try:
        from mpi4py import MPI as mpi  # noqa: N811 - the module is named MPI
    except ImportError:
        raise LaunchError(
            "mpi: started by an MPI launcher, but MASTER_ADDR is not set and mpi4py is not installed to "
            "share rank 0's address; export MASTER_ADDR (and MASTER_PORT) to every rank, or "
            "pip install 'megatron-grpo[mpi]'") from None
    return mpi.COMM_WORLD


# --------------------------------------------------------------------------------------- Slurm


def _from_slurm(env: Mapping[str, str]) -> RankInfo:
    nodelist_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    nodes = parse_slurm_nodelist(_str(env, nodelist_var, SLURM))
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT", SLURM)
    else:
        port = slurm_port_for_job(_int(env, "SLURM_JOB_ID", SLURM))
    world_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    return RankInfo(
        rank=_int(env, "SLURM_PROCID", SLURM),
        world_size=_int(env, world_var, SLURM),
        local_rank=_int(env, "SLURM_LOCALID", SLURM),
        local_world_size=_slurm_local_world_size(env),
        master_addr=env.get("MASTER_ADDR") or nodes[0],
        master_port=port,
        launcher=SLURM,
    )


def _slurm_local_world_size(env: Mapping[str, str]) -> int:
    if "SLURM_NTASKS_PER_NODE" in env:  # only set with --ntasks-per-node; uniform by construction
        return _int(env, "SLURM_NTASKS_PER_NODE", SLURM)
    var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if v in env), None)
    if var is None:
        raise LaunchError("slurm: cannot tell the tasks on this node: none of SLURM_NTASKS_PER_NODE, "
                          "SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE is set")
    per_node = parse_slurm_tasks_per_node(env[var])
    if len(set(per_node)) == 1:
        return per_node[0]
    node_id = _int(env, "SLURM_NODEID", SLURM)
    if node_id >= len(per_node):
        raise LaunchError(f"slurm: SLURM_NODEID={node_id} but {var}={env[var]!r} lists {len(per_node)} nodes")
    return per_node[node_id]


def _reject_unlaunched_slurm_allocation(env: Mapping[str, str]) -> None:
    # The batch script of `sbatch -n 8` has SLURM_PROCID=0 and SLURM_NTASKS=8 but is one process;
    # treating it as rank 0 of 8 would wait forever for the other seven.
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _int(env, "SLURM_NTASKS", SLURM) > 1:
        raise LaunchError(
            f"slurm: this process runs inside an allocation of SLURM_NTASKS={env['SLURM_NTASKS']} tasks but "
            "was not started by srun (SLURM_STEP_ID is unset); start it with `srun python ...` or "
            "`torchrun ...`, or request one task")


def slurm_port_for_job(job_id: int) -> int:
    """A rendezvous port every task of one job derives alike, and that differs between jobs
    sharing a node (unless their ids are 15000 apart)."""
    return _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN


_TASKS_PER_NODE_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_slurm_tasks_per_node(value: str) -> list[int]:
    """Expands Slurm's tasks-per-node notation: "4(x2),3" -> [4, 4, 3]."""
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_PER_NODE_ITEM.match(item.strip())
        if not match:
            raise LaunchError(f"slurm: cannot parse tasks per node {value!r}; expected items like '4' or "
                              f"'4(x2)' separated by commas")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expands a compressed Slurm hostlist, as `scontrol show hostnames` does:
    "gpu-[01-03,07]" -> gpu-01 gpu-02 gpu-03 gpu-07; "a[1-2],b[5]" -> a1 a2 b5;
    "rack[1-2]-node[01-02]" -> rack1-node01 rack1-node02 rack2-node01 rack2-node02.
    Zero padding follows the range's first bound."""
    hosts: list[str] = []
    for expression in _split_top_level(nodelist.strip(), nodelist):
        hosts.extend(_expand_host_expression(expression, nodelist))
    if not hosts:
        raise LaunchError(f"slurm: empty nodelist {nodelist!r}")
    return hosts


def _split_top_level(text: str, original: str) -> list[str]:
    """Splits on commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"slurm: nested brackets in nodelist {original!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"slurm: unbalanced ']' in nodelist {original!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth:
        raise LaunchError(f"slurm: unbalanced '[' in nodelist {original!r}")
    parts.append(text[start:])
    if any(not part for part in parts):
        raise LaunchError(f"slurm: empty host name in nodelist {original!r}")
    return parts


def _expand_host_expression(expression: str, original: str) -> list[str]:
    open_at = expression.find("[")
    if open_at < 0:
        return [expression]
    close_at = expression.index("]", open_at)
    prefix, ranges, rest = expression[:open_at], expression[open_at + 1:close_at], expression[close_at + 1:]
    tails = _expand_host_expression(rest, original) if rest else [""]
    return [prefix + number + tail for number in _expand_ranges(ranges, original) for tail in tails]


def _expand_ranges(ranges: str, original: str) -> list[str]:
    numbers: list[str] = []
    for item in ranges.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise LaunchError(f"slurm: cannot parse range {item!r} in nodelist {original!r}; expected "
                              f"'N' or 'N-M' with digits")
        if not sep:
            numbers.append(low)
            continue
        if int(high) < int(low):
            raise LaunchError(f"slurm: descending range {item!r} in nodelist {original!r}")
        numbers.extend(str(value).zfill(len(low)) for value in range(int(low), int(high) + 1))
    return numbers


# ------------------------------------------------------------------------------------- helpers


def _str(env: Mapping[str, str], name: str, launcher: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise LaunchError(f"{launcher}: environment variable {name} is missing or empty; the launcher "
                          f"should set it (or export it yourself)")
    return value


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    value = _str(env, name, launcher)
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{launcher}: environment variable {name}={value!r} is not an integer") from None
