"""The SGLang client, weight transports, engine and verification against SGLang 0.5.23's own code:
the servers here run SGLang's HTTP app, TokenizerManager, DetokenizerManager, request classes,
sampler functions and scheduler-side weight-update code, with a CPU scheduler for the GPU part
(tests/sglang_harness). Each defect found by running against that code has a test here that
failed on the code before its fix (noted as "was:").

The calls SGLang's own runtime serves on a CPU run against it instead (tests/test_sglang_runtime.py:
generation, log-probs, aborts, every weight transport, checksums, API keys, engines that die); here
stay the pure pieces and what needs the harness: seeded reproducibility (deterministic inference
does not run on a CPU) and memory release (a real CPU engine dies on /release_memory_occupation)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from megatron_grpo.rollout.sglang.buckets import iter_buckets, tensor_bytes
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
from megatron_grpo.rollout.sglang.errors import SGLangConnectionError, SGLangUnavailableError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, request_json
from megatron_grpo.errors import ConfigError
from megatron_grpo.rollout.sglang.launcher import (API_KEY_VARIABLE, RouterSettings, ServerSettings, router_command,
                                                  server_command)
from megatron_grpo.rollout.sglang.protocol import generate_payloads
from megatron_grpo.rollout.sglang.weight_sync import EngineTarget, TensorTransport
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams, derive_sample_seed
from megatron_grpo.testing.distributed import free_port, free_server_port
from tests.sglang_harness.fixtures import (launch_servers, save_long_context_model, server_settings, sglang_checksum,
                                           sglang_checksums, sglang_python)
from tests.tiny_hf import tiny_model

pytestmark = pytest.mark.slow  # starts SGLang test servers
FAST_RETRY = RetryPolicy(max_attempts=3, backoff_s=0.05)
NO_PROBE = EngineOptions(health_check_interval_s=0)
PROMPTS = [(5, 9, 11), (40, 41, 42, 43, 44, 45, 46), (7,) * 12]


def requests(params, prompts=PROMPTS):
    return [GenerationRequest(p, params, group_id=f"g{i}") for i, p in enumerate(prompts)]


# ----- pure pieces (no server) -------------------------------------------------------------------
def test_seeded_samples_are_separate_n1_requests():
    """was: one request with a LIST of sampling_params, which sglang-router refuses (422)."""
    request = GenerationRequest((5, 6), SamplingParams(n=3, max_new_tokens=4, seed=7), "g")
    payloads = generate_payloads(request)
    assert [first for first, _ in payloads] == [0, 1, 2]
    for first, payload in payloads:
        assert isinstance(payload["sampling_params"], dict) and payload["input_ids"] == [5, 6]
        assert payload["sampling_params"]["n"] == 1
        assert payload["sampling_params"]["sampling_seed"] == derive_sample_seed(7, first)
    unseeded = generate_payloads(GenerationRequest((5,), SamplingParams(n=3), "u"))
    assert len(unseeded) == 1 and unseeded[0][1]["sampling_params"]["n"] == 3
    assert "sampling_seed" not in unseeded[0][1]["sampling_params"]


def test_buckets_are_bounded_ordered_and_complete():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 30, 5, 100, 1, 1, 60])]
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=40 * 4))
    assert [name for b in buckets for name, _ in b] == [name for name, _ in tensors]
    for bucket in buckets:
        assert len(bucket) == 1 or sum(tensor_bytes(t) for _, t in bucket) <= 160
    assert [len(b) for b in buckets] == [2, 1, 1, 2, 1]  # [10,30] [5] [100] [1,1] [60]


def test_launcher_command_lines():
    """was: --enable-deterministic-inference never passed, so seeds did nothing on a real server; and
    the API key was on the command line, which every user of the node sees in `ps`."""
    settings = ServerSettings(model_path="/m", tokenizer_path="/t", tp_size=4, mem_fraction_static=0.7, host="10.0.0.2",
                              port=31000, api_key="k", enable_memory_saver=True, enable_deterministic_inference=True,
                              extra_args=("--attention-backend", "fa3"),
                              command=("python3", "-m", "sglang.launch_server"))
    assert server_command(settings) == [
        "python3", "-m", "megatron_grpo.launch.api_key_exec", API_KEY_VARIABLE, "sglang.launch_server",
        "--model-path", "/m", "--tokenizer-path", "/t", "--tp-size", "4", "--host", "10.0.0.2",
        "--port", "31000", "--mem-fraction-static", "0.7", "--enable-memory-saver",
        "--enable-deterministic-inference", "--attention-backend", "fa3"]
    router = RouterSettings(port=30100, command=("python3", "-m", "sglang_router.launch_router"))
    assert router_command(router, ["http://a:1", "http://b:2"]) == [
        "python3", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "30100", "--policy",
        "round_robin", "--worker-urls", "http://a:1", "http://b:2"]
    keyed = RouterSettings(port=30100, api_key="k", command=("python3", "-m", "sglang_router.launch_router"))
    assert router_command(keyed, ["http://a:1"])[:5] == [
        "python3", "-m", "megatron_grpo.launch.api_key_exec", API_KEY_VARIABLE, "sglang_router.launch_router"]
    with pytest.raises(ConfigError, match="must run `python -m MODULE`"):
        server_command(ServerSettings(model_path="/m", api_key="k", command=("/opt/bin/start-sglang",)))


def test_api_key_exec_hands_the_key_to_the_module_not_the_command_line(tmp_path, monkeypatch, capsys):
    from megatron_grpo.launch.api_key_exec import main as api_key_exec

    (tmp_path / "echo_argv.py").write_text("import json, os, sys\n"
                                           "json.dump([sys.argv[1:], os.environ.get('THE_KEY')], "
                                           f"open({str(tmp_path / 'seen.json')!r}, 'w'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # run_module(alter_sys=True) rewrites argv[0]
    monkeypatch.setenv("THE_KEY", "k3y")
    api_key_exec(["THE_KEY", "echo_argv", "--port", "1"])
    # the module sees the key as its flag; the variable is gone, so its children do not inherit it
    assert json.loads((tmp_path / "seen.json").read_text()) == [["--port", "1", "--api-key", "k3y"], None]
    for key, argv, message in ((None, ["THE_KEY", "echo_argv"], "THE_KEY is not set"),
                               ("k3y", ["THE_KEY", "echo_argv", "--api-key", "x"], "got --api-key on its command")):
        if key:
            monkeypatch.setenv("THE_KEY", key)
        with pytest.raises(SystemExit) as exit_info:
            api_key_exec(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_unreachable_servers_give_one_error_naming_them():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    client = SGLangClient(dead, retry=FAST_RETRY)
    with pytest.raises(SGLangUnavailableError) as info:
        client.generate(requests(SamplingParams(max_new_tokens=2))[:1])
    message = str(info.value)
    assert all(url in message for url in dead) and "failed 3 times" in message and "cannot reach" in message
    with pytest.raises(SGLangConnectionError, match=rf"{dead[0]}/model_info: cannot reach"):
        client.call(dead[0], "/model_info", method="GET")
    client.close()


def _join_weight_group(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    from megatron_grpo.rollout.sglang.process_group import destroy_process_group, init_custom_process_group

    if rank == 0:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # what torchrun sets in the trainer
    group = init_custom_process_group("gloo", "127.0.0.1", port, rank, 2, "test-group", timeout_s=20)
    tensor = torch.tensor([float(rank == 0)])
    dist.broadcast(tensor, group_src=0, group=group)
    queue.put((rank, float(tensor)))
    destroy_process_group(group)


def test_weight_update_group_forms_under_torchrun():
    """was: c10d.rendezvous made the trainer a store client under torchrun (agent store), so the
    weight-update group never formed (timeout)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_server_port()
    procs = [ctx.Process(target=_join_weight_group, args=(rank, port, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert sorted(queue.get(timeout=5) for _ in range(2)) == [(0, 1.0), (1, 1.0)]


# ----- against SGLang's code ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_long_context_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """det: deterministic inference, tp 1; tp2: deterministic, tp 2 (two scheduler ranks)."""
    sglang_python()
    settings = {"det": server_settings(model_dir), "tp2": server_settings(model_dir, tp_size=2)}
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), list(settings.values()))
    yield {name: s.url for name, s in settings.items()}
    launcher.shutdown(grace_s=5)


def assert_engine_holds(url: str, model, version: int, tp_size: int = 1) -> None:
    """Every parameter of every TP rank is bitwise the model's, and samples carry `version`."""
    answer = request_json(url, "/weights_checker", {"action": "checksum"})
    expected = sglang_checksums(model.config, model.named_parameters(), tp_size)  # SGLang's fused TP shards
    assert [rank["checksums"] for rank in answer["ranks"]] == expected
    samples = SGLangClient([url], retry=FAST_RETRY).generate(requests(SamplingParams(max_new_tokens=6, seed=1))[:1])
    assert {s.weight_version for s in samples} == {version}
    assert request_json(url, "/model_info", method="GET")["weight_version"] == str(version)


def hf_stream(model):
    return ((name, tensor.clone()) for name, tensor in model.state_dict().items())


def test_seeds_take_effect_only_with_deterministic_inference(servers):
    """was: seeds sent, but SGLang ignores them without --enable-deterministic-inference (which does
    not run on a CPU: that they do nothing without it, tests/test_sglang_runtime.py shows on the
    real runtime)."""
    params = SamplingParams(n=3, max_new_tokens=12, seed=42)
    det = SGLangClient([servers["det"]])
    first, again = det.generate(requests(params)), det.generate(requests(params))
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    assert len({tuple(s.response_ids) for s in first[:3]}) == 3  # the n samples of a prompt differ


def test_colocated_release_then_update_resumes_only_released_tags(servers):
    """was: resume `weights`, push, then resume with tags=None (all tags), so SGLang raised
    KeyError for the already-resumed `weights` and its scheduler took the server down."""
    url = servers["tp2"]
    client = SGLangClient([url])
    engine = SGLangEngine(client, TensorTransport(client, [EngineTarget(url, tp_size=2)], bucket_bytes=100 * 1024),
                          options=NO_PROBE)
    engine.release_memory()  # the trainer runs; SGLang drops the weights' contents (zeroed here)
    zeroed = request_json(url, "/weights_checker", {"action": "checksum"})["ranks"]
    assert all(rank["checksums"]["model.norm.weight"] == sglang_checksum(torch.zeros(64)) for rank in zeroed)
    model = tiny_model(seed=3, scale=3.0)
    engine.update_weights(hf_stream(model), version=10)  # weights first, the rest after the push
    assert engine.last_sync.num_buckets > 1
    assert_engine_holds(url, model, 10, tp_size=2)
    engine.release_memory()
    engine.resume_memory()
    request_json(url, "/health_generate", method="GET", timeout_s=60)

