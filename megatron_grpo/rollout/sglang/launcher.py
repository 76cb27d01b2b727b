"""Start, health-wait, restart and stop `python -m sglang.launch_server` processes (and optionally a router).

Each server gets its own log file and process group; shutdown signals the group (SIGTERM, then
SIGKILL), at close(), at interpreter exit, and, on Linux, when the launching thread dies
(PR_SET_PDEATHSIG), so a crashed trainer does not leave GPU servers behind.

Ready means: an engine answers `GET /health_generate` (it generated a token; `/health` may answer
before the model can serve), a router answers `GET /readiness` (its `/health` is 200 even with no
live worker).

An API key never goes on a command line (`ps` shows every user's): the process gets it in the
environment (API_KEY_VARIABLE) and runs through launch/api_key_exec.py, which hands it to the module."""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from megatron_grpo.errors import ConfigError
from megatron_grpo.launch.env import port_in_use
from megatron_grpo.launch.lifetime import preexec_die_with_parent
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.http_json import request_json


API_KEY_VARIABLE = "MEGATRON_GRPO_SGLANG_API_KEY"  # the launched process's key (launch/api_key_exec.py)


def keyed_command(command: Sequence[str], api_key: str | None) -> list[str]:
    """`python -m MODULE` -> `python -m megatron_grpo.launch.api_key_exec VARIABLE MODULE`
    when there is a key: the key then comes from the environment."""
    command = list(command)
    if not api_key:
        return command
    if "-m" not in command[:-1]:
        raise ConfigError(f"cannot pass an API key to {' '.join(command)} without putting it on the command line: "
                          "rollout.sglang.launch_command / router_command must run `python -m MODULE`")
    # python's -m: the last one before the module (a prefix such as `numactl -m 0` may have its own)
    at = max(i for i, part in enumerate(command[:-1]) if part == "-m") + 1
    return [*command[:at], "megatron_grpo.launch.api_key_exec", API_KEY_VARIABLE, *command[at:]]


@dataclass(frozen=True)
class ServerSettings:
    """One SGLang server's command line. `extra_args` are appended untouched."""

    model_path: str
    tokenizer_path: str | None = None  # None: the model folder's
    tp_size: int = 1
    mem_fraction_static: float | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    enable_memory_saver: bool = False
    base_gpu_id: int | None = None  # the engine's first GPU (colocated engines: rollout/sglang/colocated.py)
    # SGLang ignores sampling_seed without it; costs throughput (docs/rollout.md: seeded rollouts).
    enable_deterministic_inference: bool = False
    enable_fp32_lm_head: bool = False  # model.fp32_lm_head: the LM head in fp32, as the trainer's
    # actor.moe_routing_replay: SGLang records each token's experts and returns them when a request
    # asks (return_routed_experts); without the flag it ignores the request field.
    enable_return_routed_experts: bool = False
    device: str = "cuda"  # "cpu": SGLang's CPU backend (cpu_engine_environment)
    cpu_threads: int = 1  # device=cpu: OMP_NUM_THREADS of the engine's processes
    dtype: str | None = None  # --dtype; None: SGLang's auto (float16 for an fp32 checkpoint)
    max_total_tokens: int | None = None  # --max-total-tokens: the KV cache, in tokens
    extra_args: tuple[str, ...] = ()
    # What starts one server; its flags follow. Tests point it at the SGLang test harness.
    command: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def environment(self) -> dict[str, str]:
        """What the server's process needs in its environment beyond ours."""
        return cpu_engine_environment(self.tp_size, threads=self.cpu_threads) if self.device == "cpu" else {}


# SGLang 0.5.23 on a CPU (its srt/utils/numa_utils.py, device_communicators/pynccl_wrapper.py):
# SGLANG_USE_CPU_ENGINE=1 selects the CPU backend; an engine of several TP ranks binds each rank's
# OpenMP threads to the cores SGLANG_CPU_OMP_THREADS_BIND gives it ("0|1": rank 0 on core 0, rank
# 1 on core 1; unset, it wants one NUMA node per rank); and its TP all-reduce uses gloo once PyNccl
# cannot load NCCL: a CUDA build of torch ships NCCL, which PyNccl would load and then ask for a
# CUDA device, so SGLANG_NCCL_SO_PATH names a library that does not exist. Without that binding (it
# needs AMX or arm64) torch takes an OpenMP thread per core; OMP_NUM_THREADS caps it.
NO_NCCL_LIBRARY = "/nonexistent/megatron-grpo-cpu-engine/libnccl.so"


def cpu_engine_environment(tp_size: int, cores: Sequence[int] | None = None, threads: int = 1) -> dict[str, str]:
    env = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_NCCL_SO_PATH": NO_NCCL_LIBRARY, "OMP_NUM_THREADS": str(threads)}
    if tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cores_per_rank(sorted(cores or os.sched_getaffinity(0)), tp_size)
    return env


def cores_per_rank(cores: Sequence[int], tp_size: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `tp_size` ranks sharing `cores` evenly ("0-7|8-15"); a rank
    gets one core at least (the ranks then share cores: slower, still correct)."""
    share = max(1, len(cores) // tp_size)
    groups = []
    for rank in range(tp_size):
        mine = cores[(rank * share) % len(cores):][:share] or cores[:share]
        groups.append(f"{mine[0]}-{mine[-1]}" if len(mine) > 1 else str(mine[0]))
    return "|".join(groups)


def server_command(settings: ServerSettings) -> list[str]:
    cmd = [*keyed_command(settings.command, settings.api_key), "--model-path", str(settings.model_path),
           *(["--tokenizer-path", str(settings.tokenizer_path)] if settings.tokenizer_path else []),
           "--tp-size", str(settings.tp_size), "--host", settings.host, "--port", str(settings.port)]
    if settings.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(settings.mem_fraction_static)]
    if settings.enable_memory_saver:
        cmd += ["--enable-memory-saver"]
    if settings.base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(settings.base_gpu_id)]
    if settings.enable_deterministic_inference:
        cmd += ["--enable-deterministic-inference"]
    if settings.enable_fp32_lm_head:
        cmd += ["--enable-fp32-lm-head"]
    if settings.enable_return_routed_experts:
        cmd += ["--enable-return-routed-experts"]
    if settings.device != "cuda":
        cmd += ["--device", settings.device]
    if settings.device == "cpu":
        # SGLang's scheduler spins on its sockets while idle (a core at 100%), which on a CPU takes a
        # core from the trainer beside it; --sleep-on-idle polls them instead (zmq.Poller: a request
        # still wakes it at once). Measured on 2 idle cores, 12 steps of tiny_cpu_sglang: 130% CPU for the
        # run spinning, 81% polling, the same step time.
        cmd += ["--sleep-on-idle"]
    if settings.dtype is not None:
        cmd += ["--dtype", settings.dtype]
    if settings.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(settings.max_total_tokens)]
    return cmd + list(settings.extra_args)


@dataclass(frozen=True)
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 30100
    policy: str = "round_robin"
    api_key: str | None = None  # protects its routes and is sent to the workers (sglang-router's --api-key)
    extra_args: tuple[str, ...] = ()
    command: tuple[str, ...] = (sys.executable, "-m", "sglang_router.launch_router")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def router_command(settings: RouterSettings, worker_urls: Sequence[str]) -> list[str]:
    return [*keyed_command(settings.command, settings.api_key), "--host", settings.host, "--port",
            str(settings.port), "--policy", settings.policy, "--worker-urls", *worker_urls, *settings.extra_args]


@dataclass
class ManagedProcess:
    name: str
    url: str
    process: subprocess.Popen
    log_path: Path
    cmd: list[str]
    ready_path: str  # the GET route that answers 200 once it can serve
    api_key: str | None = None  # in its environment, never in cmd
    own_env: Mapping[str, str] | None = None  # what its command needs beyond the launcher's environment

    def log_tail(self, chars: int = 2000) -> str:
        """The end of its log, for error messages: the key (SGLang logs its settings) shown as ***."""
        try:
            tail = self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
        return tail.replace(self.api_key, "***") if self.api_key else tail


@dataclass
class SGLangLauncher:
    """Starts one process per ServerSettings (plus a router if given) and stops them all."""

    servers: Sequence[ServerSettings]
    log_dir: str | Path
    router: RouterSettings | None = None
    env: dict[str, str] = field(default_factory=dict)
    processes: list[ManagedProcess] = field(default_factory=list)

    def start(self) -> list[str]:
        """Starts the servers (not the router: it needs healthy workers, see wait_healthy). A port
        already taken is refused first: the server started there could not listen, and the health
        check would be answered by whatever holds the port."""
        listeners = [*self.servers, *([self.router] if self.router else [])]
        taken = [f"{s.host}:{s.port}" for s in listeners if port_in_use(s.host, s.port)]
        if taken:
            raise SGLangError(f"cannot start SGLang here: {', '.join(taken)} already in use (another server?); choose "
                              f"free ports (rollout.sglang.port, router_port)", f"http://{taken[0]}")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        atexit.register(self.shutdown)
        for index, settings in enumerate(self.servers):
            self._spawn(f"sglang-{index}-port{settings.port}", settings.url, server_command(settings),
                        "/health_generate", settings.api_key, settings.environment())
        return [s.url for s in self.servers]

    def _spawn(self, name: str, url: str, cmd: list[str], ready_path: str, api_key: str | None,
               own_env: Mapping[str, str] | None = None) -> ManagedProcess:
        log_path = Path(self.log_dir) / f"{name}.log"
        env = {**os.environ, **self.env, **(own_env or {}), **({API_KEY_VARIABLE: api_key} if api_key else {})}
        # SGLang writes its settings, the key among them, to this log: only this user may read it
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # also a log left by an earlier run
        with open(fd, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            # SIGTERM when the launching thread dies (also on kill -9 of the trainer): SGLang's
            # handler then stops its scheduler and detokenizer too.
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True, preexec_fn=preexec_die_with_parent(signal.SIGTERM))
        managed = ManagedProcess(name, url, process, log_path, cmd, ready_path, api_key, own_env)
        self.processes.append(managed)
        return managed

    def wait_healthy(self, timeout_s: float = 900.0, poll_s: float = 1.0) -> str | None:
        """Waits until every server can generate (then starts the router and waits until it is ready).

        Returns the URL to send /generate to (router or None). Raises SGLangError naming the URL
        and the log tail if a server exits or is not ready within timeout_s."""
        for proc in list(self.processes):
            self._wait_one(proc, time.monotonic() + timeout_s, poll_s)
        if self.router is None:
            return None
        router = self._spawn(f"sglang-router-port{self.router.port}", self.router.url,
                             router_command(self.router, [s.url for s in self.servers]), "/readiness",
                             self.router.api_key)
        self._wait_one(router, time.monotonic() + timeout_s, poll_s)
        return self.router.url

    def restart(self, index: int, timeout_s: float = 900.0, poll_s: float = 1.0) -> None:
        """Stops server `index` (if anything is left of it) and starts it again on the same port."""
        old = self.processes[index]
        _stop(old, grace_s=5.0)
        new = self._spawn(old.name, old.url, old.cmd, old.ready_path, old.api_key, old.own_env)
        self.processes.remove(new)
        self.processes[index] = new
        self._wait_one(new, time.monotonic() + timeout_s, poll_s)

    def _wait_one(self, proc: ManagedProcess, deadline: float, poll_s: float) -> None:
        while True:
            code = proc.process.poll()
            if code is not None:
                raise SGLangError(f"{proc.name} ({proc.url}) exited with code {code} before becoming ready; "
                                  f"log {proc.log_path}:\n{proc.log_tail()}", proc.url)
            try:
                request_json(proc.url, proc.ready_path, method="GET", timeout_s=30.0, api_key=proc.api_key)
                return
            except SGLangError:
                pass
            if time.monotonic() > deadline:
                raise SGLangError(f"{proc.name} ({proc.url}) not ready ({proc.ready_path}) in time; log "
                                  f"{proc.log_path}:\n{proc.log_tail()}", proc.url)
            time.sleep(poll_s)

    def shutdown(self, grace_s: float = 15.0) -> None:
        """SIGTERM to each process group, SIGKILL after grace_s; idempotent."""
        for proc in self.processes:
            if proc.process.poll() is None:
                _signal_group(proc.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.processes:
            _stop(proc, grace_s=max(0.1, deadline - time.monotonic()))
        self.processes.clear()
        atexit.unregister(self.shutdown)


def _stop(proc: ManagedProcess, grace_s: float) -> None:
    """SIGTERM to the process group, SIGKILL after grace_s (what is left of a dead server too:
    SGLang's scheduler and detokenizer processes share the group)."""
    _signal_group(proc.process.pid, signal.SIGTERM)
    try:
        proc.process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.process.pid, signal.SIGKILL)
    proc.process.wait()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the process leads its own session/group (start_new_session)
    except ProcessLookupError:
        pass
