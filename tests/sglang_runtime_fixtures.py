"""Start SGLang 0.5.23's own runtime on this CPU (build/sglang-runtime-venv, scripts/setup_sglang_runtime.sh)
through the project's own launcher, as the trainer does with rollout.sglang.device=cpu.

The tests that use these run in that venv's interpreter (`build/sglang-runtime-venv/bin/python -m pytest`,
marker sglang_runtime); a missing venv skips them, or fails them under MEGATRON_GRPO_REQUIRE_TEST_DEPS=1."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch

from megatron_grpo.launch.env import free_server_port
from megatron_grpo.rollout.sglang.launcher import RouterSettings, ServerSettings, SGLangLauncher
from tests.requirements import missing

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PYTHON = REPO_ROOT / "build" / "sglang-runtime-venv" / "bin" / "python"


def runtime_python() -> str:
    """The interpreter with SGLang's runtime; missing: the test skips (fails under scripts/test.sh)."""
    if not RUNTIME_PYTHON.exists():
        missing(f"{RUNTIME_PYTHON} is missing: run `bash scripts/setup_sglang_runtime.sh`")
    return str(RUNTIME_PYTHON)


def real_server_settings(model_dir: str | Path, *, tp_size: int = 1, dtype: str = "float32",
                         api_key: str | None = None, extra_args: Sequence[str] = (),
                         max_total_tokens: int = 4096) -> ServerSettings:
    """One real engine as the trainer's launcher starts it on a CPU (device=cpu, the trainer's dtype,
    a capped KV cache), from the runtime venv's `python -m sglang.launch_server`."""
    return ServerSettings(model_path=str(model_dir), tp_size=tp_size, port=free_server_port(), api_key=api_key,
                          device="cpu", dtype=dtype, max_total_tokens=max_total_tokens,
                          # no warm-up request (the launcher's wait on /health_generate generates a
                          # token anyway); SGLang picks its process-group port near --port at random,
                          # where several test servers on one machine can collide.
                          extra_args=("--skip-server-warmup", "--nccl-port", str(free_server_port()), *extra_args),
                          command=(runtime_python(), "-m", "sglang.launch_server"))


def real_router_settings(policy: str = "round_robin", extra_args: Sequence[str] = (),
                         api_key: str | None = None) -> RouterSettings:
    """The sglang-router of the runtime venv (its Prometheus port is fixed by default: two collide)."""
    return RouterSettings(port=free_server_port(), policy=policy, api_key=api_key,
                          extra_args=("--prometheus-port", str(free_server_port()), *extra_args),
                          command=(runtime_python(), "-m", "sglang_router.launch_router"))


def runtime_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """One thread per process (the machine is shared), no torch.compile of SGLang's seeded sampler
    (compiling C++ on a CPU takes far longer than the tiny model's whole test)."""
    return {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TORCHDYNAMO_DISABLE": "1", **(extra or {})}


def launch_real_servers(log_dir: str | Path, settings: Sequence[ServerSettings], *,
                        router: RouterSettings | None = None, timeout_s: float = 300.0,
                        env: Mapping[str, str] | None = None) -> SGLangLauncher:
    """Starts the real engines (and router) and waits until they serve; the caller shuts them down."""
    launcher = SGLangLauncher(servers=list(settings), log_dir=log_dir, router=router, env=runtime_env(env))
    launcher.start()
    try:
        launcher.wait_healthy(timeout_s=timeout_s, poll_s=0.5)
    except BaseException:
        launcher.shutdown(grace_s=2)
        raise
    return launcher


def launch_real_router(log_dir: str | Path, worker_urls: Sequence[str]) -> SGLangLauncher:
    """The runtime venv's sglang-router in front of servers started elsewhere (as slurm/ starts it);
    the caller shuts it down."""
    from tests.sglang_harness.fixtures import router_in_front

    return router_in_front(log_dir, worker_urls, real_router_settings(), runtime_env())


def sglang_fused_checksums(model_dir: str | Path, hf_tensors: Mapping[str, torch.Tensor], *,
                           tp_size: int = 1) -> list[dict[str, str]]:
    """What a real float32 CPU engine serving model_dir (a dense Qwen2 / Qwen3 / Llama) reports by
    /weights_checker {"action": "checksum"} for the parameters it holds from `hf_tensors`, one dict per
    TP rank, in SGLang's names (qkv_proj = cat(q, k, v), gate_up_proj = cat(gate, up), TP shards, the
    vocabulary zero-padded to a multiple of 64): tests.sglang_harness.fixtures.sglang_checksums, which
    tests/test_sglang_real_vs_harness.py holds to a real engine. Compare with engine_checksums(url)
    restricted to these keys (the engine also reports what was not sent)."""
    from tests.sglang_harness.fixtures import sglang_checksums

    return sglang_checksums(model_dir, hf_tensors, tp_size)
