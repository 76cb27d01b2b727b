"""Start SGLang test servers (and the real sglang-router) through the project's own launcher."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from megatron_grpo.rollout.sglang.launcher import RouterSettings, ServerSettings, SGLangLauncher
from megatron_grpo.launch.env import free_server_port
from tests.requirements import missing

REPO_ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO_ROOT / "build" / "sglang-venv" / "bin" / "python"
SERVER_MODULE = "tests.sglang_harness.server"


# fp32 weights (SGLang's dtype=auto serves an fp32 checkpoint in fp16), so that the engine's log-probs
# and checksums can be compared with fp32 references; no warm-up request (the launcher's readiness
# wait on /health_generate generates a token anyway).
HARNESS_FLAGS = ("--dtype", "float32", "--skip-server-warmup")


def sglang_python() -> str:
    """The interpreter with SGLang's code (scripts/setup_sglang_venv.sh). Missing: the test skips,
    except under scripts/test.sh, where it fails (tests/requirements.py)."""
    if not SGLANG_PYTHON.exists():
        missing(f"{SGLANG_PYTHON} is missing: run `bash scripts/setup_sglang_venv.sh`")
    return str(SGLANG_PYTHON)


def server_command() -> tuple[str, ...]:
    return (sglang_python(), "-m", SERVER_MODULE)


# Ports below the ephemeral range (free_server_port): a server's port from free_port() could be taken
# by any client socket of the tests before the server binds it.
def server_settings(model_dir: str | Path, tp_size: int = 1, extra_args: Sequence[str] = (),
                    api_key: str | None = None, deterministic: bool = True) -> ServerSettings:
    return ServerSettings(model_path=str(model_dir), tp_size=tp_size, port=free_server_port(), api_key=api_key,
                          enable_deterministic_inference=deterministic,
                          # SGLang picks its process-group port near --port at random; several test
                          # servers (and other tests' rendezvous) on one machine can collide there.
                          extra_args=(*HARNESS_FLAGS, "--nccl-port", str(free_server_port()), *extra_args),
                          command=server_command())


def router_settings(policy: str = "round_robin", extra_args: Sequence[str] = (),
                    api_key: str | None = None) -> RouterSettings:
    # Its Prometheus exporter binds a fixed port by default: two routers on one machine collide.
    return RouterSettings(port=free_server_port(), policy=policy, api_key=api_key,
                          extra_args=("--prometheus-port", str(free_server_port()), *extra_args),
                          command=(sglang_python(), "-m", "sglang_router.launch_router"))


def launch_router(log_dir: str | Path, worker_urls: Sequence[str], policy: str = "round_robin") -> SGLangLauncher:
    """The real sglang-router in front of servers started elsewhere (as slurm/ starts it); the
    caller shuts it down."""
    return router_in_front(log_dir, worker_urls, router_settings(policy), harness_env())


def router_in_front(log_dir: str | Path, worker_urls: Sequence[str], router: RouterSettings,
                    env: Mapping[str, str]) -> SGLangLauncher:
    """`router` started in front of servers started elsewhere, waited on until ready."""
    from urllib.parse import urlparse

    given = [ServerSettings(model_path="", host=urlparse(u).hostname, port=urlparse(u).port) for u in worker_urls]
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    launcher = SGLangLauncher(servers=given, log_dir=log_dir, router=router, env=dict(env))
    try:
        launcher.wait_healthy(timeout_s=120, poll_s=0.5)  # starts only the router: no server was started here
    except BaseException:
        launcher.shutdown(grace_s=2)
        raise
    return launcher


LONG_CONTEXT = 200_000


def save_long_context_model(folder: str | Path) -> Path:
    """The tests' tiny HF model with a 200k context, so that a generation runs until it is aborted."""
    import json

    from tests.tiny_hf import save_tiny_model

    folder = save_tiny_model(folder, seed=0, scale=3.0)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LONG_CONTEXT}))
    return folder


def harness_env(faults: Mapping[str, str] | None = None) -> dict[str, str]:
    """PYTHONPATH for the harness package, one thread per process, and any HARNESS_* faults."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            # SGLang torch.compile()s its seeded sampler; compiling C++ on CPU takes far longer
            # than the tiny model's whole test, and eager mode computes the same.
            "TORCHDYNAMO_DISABLE": "1", **(faults or {})}


def launch_servers(log_dir: str | Path, settings: Sequence[ServerSettings], *, router: RouterSettings | None = None,
                   faults: Mapping[str, str] | None = None, timeout_s: float = 300.0) -> SGLangLauncher:
    """Starts the servers (and router) and waits until they serve; the caller shuts them down."""
    launcher = SGLangLauncher(servers=list(settings), log_dir=log_dir, router=router, env=harness_env(faults))
    launcher.start()
    try:
        launcher.wait_healthy(timeout_s=timeout_s, poll_s=0.5)
    except BaseException:
        launcher.shutdown(grace_s=2)
        raise
    return launcher


def trainer_overrides() -> list[str]:
    """Recipe overrides that make the trainer launch harness servers (and the real router from the
    SGLang venv) instead of `sglang.launch_server` / `sglang_router.launch_router`."""
    return [f"rollout.sglang.launch_command=[{sglang_python()},-m,{SERVER_MODULE},{','.join(HARNESS_FLAGS)}]",
            f"rollout.sglang.router_command=[{sglang_python()},-m,sglang_router.launch_router,"
            f"--prometheus-port={free_server_port()}]"]


def sglang_checksum(tensor: torch.Tensor) -> str:
    """SGLang's /weights_checker checksum of a CPU tensor (sha256 of its bytes, first 8 bytes, hex),
    to compare an engine's parameters with the trainer's bitwise."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return f"{int.from_bytes(hashlib.sha256(data).digest()[:8], 'big'):016x}"


def engine_checksums(url: str) -> list[dict[str, str]]:
    """SGLang's /weights_checker checksums of every parameter, one dict per engine TP rank, under the
    names and TP shards the engine holds (SGLang's fused ones for its dense models: sglang_checksums)."""
    from megatron_grpo.rollout.sglang.http_json import request_json

    answer = request_json(url, "/weights_checker", {"action": "checksum"})
    return [rank["checksums"] for rank in answer["ranks"]]


def sglang_checksums(config: str | Path | object, hf_tensors: Mapping[str, torch.Tensor] | Iterable,
                     tp_size: int = 1) -> list[dict[str, str]]:
    """What a float32 SGLang engine (real or harness) serving a model of this HF config (a folder,
    config.json or PretrainedConfig) reports by /weights_checker for the parameters it holds from
    `hf_tensors` (HF names), one dict per TP rank. For SGLang's dense Qwen2 / Qwen3 / Llama, in its
    fused, sharded, vocab-padded layout, as the trainer predicts it (rollout/sglang/expected_checksums.py:
    the harness computes that layout on its own, tests/sglang_harness/model.py SGLangLayout, and
    tests/test_sglang_real_vs_harness.py holds both to a real engine); other architectures under
    their HF names (the harness does not model SGLang's layout for them)."""
    from megatron_grpo.models.hf_config import ModelArchitecture
    from megatron_grpo.rollout.sglang.expected_checksums import (FUSED_DENSE, ChecksumPrediction, EngineLayout,
                                                                 ModelLayout)
    from tests.sglang_harness.model import DENSE_FUSED_CLASSES

    tensors = dict(hf_tensors)
    architecture = ModelArchitecture.from_hf(config)
    # SGLang's class: the config's first architecture (a config built in memory may name none)
    served = (architecture.hf_config.get("architectures") or [FUSED_DENSE.get(architecture.architecture)])[0]
    if served not in DENSE_FUSED_CLASSES:
        return [{name: sglang_checksum(tensor) for name, tensor in tensors.items()} for _ in range(tp_size)]
    model = ModelLayout.of(architecture)
    layout = EngineLayout.of({"tp_size": tp_size, "dtype": "float32", "device": "cpu"})  # as its /server_info says
    assert not isinstance(model, str) and not isinstance(layout, str), (model, layout)
    prediction = ChecksumPrediction(model, (layout,))
    for name, tensor in tensors.items():
        prediction.add(name, tensor.float())
    assert not prediction.pending, f"fused parameters with parts missing: {sorted(prediction.pending)}"
    return prediction.expected(layout)


def harness_checksums(model_dir: str | Path, hf_tensors: Mapping[str, torch.Tensor],
                      tp_size: int = 1) -> list[dict[str, str]]:
    """What a harness engine serving model_dir reports by /weights_checker, per TP rank, for all its
    parameters once it loaded `hf_tensors` (sglang_checksums' names). Every tensor must be one the
    model knows (the engine would skip it silently)."""
    from transformers import AutoModelForCausalLM

    from tests.sglang_harness.model import resolve_param

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in hf_tensors.items():
            target = resolve_param(params, name)
            assert target is not None, f"{name}: no such parameter in {model_dir}'s model"
            assert target.shape == tensor.shape, (name, tuple(target.shape), tuple(tensor.shape))
            target.copy_(tensor)
    return sglang_checksums(model_dir, model.named_parameters(), tp_size)


def engine_parameter_checksums(url: str, names) -> list[dict[str, str]]:
    """engine_checksums restricted to `names` (its buffers, e.g. rotary tables, never change);
    a name the engine does not report maps to None."""
    return [{name: rank.get(name) for name in names} for rank in engine_checksums(url)]


def sglang_sampler_function(name: str):
    """A torch-only top-level function of SGLang's sampler module, compiled from SGLang's source
    alone: importing sglang.srt.layers.sampler takes ~10 s and works only in SGLang's venv. A
    missing SGLang venv fails or skips the caller (sglang_python)."""
    import ast
    from typing import Optional

    sglang_python()
    source = next(SGLANG_PYTHON.parent.parent.glob("lib/python*/site-packages/sglang/srt/layers/sampler.py"))
    node = next(n for n in ast.parse(source.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch, "Optional": Optional}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(source), "exec"), namespace)
    return namespace[name]
