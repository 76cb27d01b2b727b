"""rollout.sglang.device=cpu without a server: what the launcher passes and sets for an SGLang engine
on a CPU, the KV cap taken from the recipe, and what the recipe refuses (SGLang 0.5.23 cannot do it
on a CPU). The engines themselves run in tests marked sglang_runtime."""
from __future__ import annotations

import pytest

from megatron_grpo.config import load_config, validate
from megatron_grpo.config.derived import engine_kv_tokens, engine_memory_released
from megatron_grpo.errors import ConfigError
from megatron_grpo.rollout.sglang.launcher import (NO_NCCL_LIBRARY, ServerSettings, cores_per_rank,
                                                  cpu_engine_environment, server_command)

CPU = ["rollout.engine=sglang", "rollout.sglang.device=cpu", "rollout.sglang.deterministic_inference=false"]


def test_a_cpu_engine_gets_the_cpu_backend_its_dtype_and_a_kv_cap():
    settings = ServerSettings(model_path="m", device="cpu", dtype="bfloat16", max_total_tokens=4096, port=31000)
    cmd = server_command(settings)
    assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--max-total-tokens") + 1] == "4096"
    assert "--sleep-on-idle" in cmd  # an idle scheduler must not spin on the cores the trainer uses
    assert settings.environment()["SGLANG_USE_CPU_ENGINE"] == "1"
    assert settings.environment()["OMP_NUM_THREADS"] == "1"  # SGLang's default (a thread per core) crawls under load
    gpu = ServerSettings(model_path="m", dtype="bfloat16")
    assert {"--device", "--sleep-on-idle"}.isdisjoint(server_command(gpu)) and gpu.environment() == {}


def test_tp_ranks_of_a_cpu_engine_share_the_cores_and_use_gloo(monkeypatch):
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    assert cores_per_rank([0, 1], 2) == "0|1"
    assert cores_per_rank(list(range(8)), 2) == "0-3|4-7"
    assert cores_per_rank([0], 2) == "0|0"  # fewer cores than ranks: they share
    env = cpu_engine_environment(2, cores=[0, 1])
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1" and env["SGLANG_NCCL_SO_PATH"] == NO_NCCL_LIBRARY
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in cpu_engine_environment(1)
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "4-7|8-11")  # the user's binding stays theirs
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in cpu_engine_environment(2)


def test_the_kv_cache_of_a_cpu_engine_is_capped_from_the_recipe():
    cfg = load_config("tiny_cpu", [*CPU, "rollout.sglang.max_concurrency=64"])
    assert engine_kv_tokens(cfg) == 64 * (cfg.data.max_prompt_length + cfg.data.max_response_length)
    assert engine_kv_tokens(load_config("tiny_cpu", [*CPU, "rollout.sglang.max_total_tokens=5000"])) == 5000
    assert engine_kv_tokens(load_config("tiny_cpu", ["rollout.engine=sglang"])) is None  # a GPU: mem_fraction


def test_colocated_engines_release_memory_on_gpus_only():
    assert engine_memory_released(load_config("tiny_cpu", ["rollout.engine=sglang",
                                                           "rollout.sglang.weight_sync=tensor"]))
    assert not engine_memory_released(load_config("tiny_cpu", [*CPU, "rollout.sglang.weight_sync=tensor"]))


@pytest.mark.parametrize("overrides, expected", [
    (["rollout.sglang.deterministic_inference=true"], "deterministic_inference=true: SGLang 0.5.23 starts"),
    (["rollout.sglang.max_total_tokens=16"], "max_total_tokens=16 is below the longest sequence (40 tokens"),
    (["rollout.sglang.cpu_threads=0"], "cpu_threads=0 must be >= 1"),
])
def test_what_sglang_cannot_do_on_a_cpu_is_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        validate(load_config("tiny_cpu", [*CPU, *overrides]))


def test_the_shipped_cpu_recipe_validates():
    cfg = load_config("tiny_cpu_sglang")
    validate(cfg)
    assert cfg.rollout.sglang.device == "cpu" and cfg.rollout.sglang.verify_interval == 1


def test_a_port_already_taken_is_refused_before_any_server_starts(tmp_path):
    """was: a launched engine whose port another server held died at its bind while the other server
    answered the health check, and the run failed later with a 401 from a server that was not its own."""
    import socket

    from megatron_grpo.rollout.sglang.errors import SGLangError
    from megatron_grpo.rollout.sglang.launcher import SGLangLauncher

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        launcher = SGLangLauncher(servers=[ServerSettings(model_path="m", port=port, command=("false",))],
                                  log_dir=tmp_path)
        with pytest.raises(SGLangError, match=rf"127.0.0.1:{port} already in use"):
            launcher.start()
        assert launcher.processes == [] and not any(tmp_path.iterdir())


def test_the_trainer_launches_cpu_engines_with_the_recipes_threads():
    import torch

    from megatron_grpo.trainer.engines.sglang_setup import launched_server_settings

    def settings(overrides):
        cfg = load_config("tiny_cpu_sglang", overrides)
        return launched_server_settings(cfg, "m", None, False, torch.float32, ("sglang",))

    [engine] = settings([])
    assert engine.environment()["OMP_NUM_THREADS"] == "1" and engine.device == "cpu"
    engines = settings(["rollout.sglang.cpu_threads=2", "rollout.sglang.num_engines=2"])
    assert [e.environment()["OMP_NUM_THREADS"] for e in engines] == ["2", "2"]
    assert [e.port for e in engines] == [30000, 30001]
