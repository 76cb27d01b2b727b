"""SGLang client, protocol and launcher against fake SGLang servers (real HTTP on localhost)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from megatron_grpo.rollout.local import LocalEngine
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.engine import SGLangEngine
from megatron_grpo.rollout.sglang.errors import (SGLangConnectionError, SGLangError, SGLangTimeoutError,
                                                 SGLangUnavailableError)
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, request_json
from megatron_grpo.rollout.sglang.launcher import (RouterSettings, ServerSettings, router_command, server_command)
from megatron_grpo.rollout.sglang.weight_sync import DiskTransport, EngineTarget
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.testing.distributed import free_port
from tests.fake_sglang.fixtures import fake_server_settings, launch_fake_servers
from tests.fake_sglang.tiny import save_tiny_model

pytestmark = pytest.mark.slow  # starts server processes
FAST_RETRY = RetryPolicy(max_attempts=3, backoff_s=0.05)
PROMPTS = [(5, 9, 11), (40, 41, 42, 43, 44, 45, 46), (7,) * 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model"), seed=0, scale=3.0)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """main: plain; slow: 3 s per /generate; flaky: 503 for its first 2 /generate; secured: API key."""
    settings = {"main": fake_server_settings(model_dir),
                "slow": fake_server_settings(model_dir, extra_args=["--generate-delay", "3"]),
                "flaky": fake_server_settings(model_dir, extra_args=["--fail-first", "2"]),
                "secured": fake_server_settings(model_dir, api_key="s3cret")}
    launcher = launch_fake_servers(tmp_path_factory.mktemp("logs"), list(settings.values()))
    yield {name: s.url for name, s in settings.items()} | {"_launcher": launcher}
    launcher.shutdown(grace_s=5)


@pytest.fixture(scope="module")
def local(model_dir):
    return LocalEngine.from_pretrained(model_dir)


def requests(params):
    return [GenerationRequest(p, params, group_id=f"g{i}") for i, p in enumerate(PROMPTS)]


def assert_same_samples(got, want):
    assert [(s.group_id, s.sample_index, s.response_ids, s.finish_reason) for s in got] == \
        [(s.group_id, s.sample_index, s.response_ids, s.finish_reason) for s in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_generate_response_schema(servers):
    body = request_json(servers["main"], "/generate", {"input_ids": [5, 6, 7], "return_logprob": True,
                                                       "sampling_params": {"n": 3, "max_new_tokens": 5}})
    assert isinstance(body, list) and len(body) == 3
    for item in body:
        meta = item["meta_info"]
        assert len(item["output_ids"]) == 5 and isinstance(item["text"], str)
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert [row[1] for row in meta["output_token_logprobs"]] == item["output_ids"]
        assert all(row[0] <= 0 and row[2] is None for row in meta["output_token_logprobs"])
        assert meta["weight_version"] == "default" and meta["completion_tokens"] == 5
    single = request_json(servers["main"], "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(single, dict) and "output_token_logprobs" not in single["meta_info"]


@pytest.mark.parametrize("params", [SamplingParams(n=3, max_new_tokens=12, seed=5),
                                    SamplingParams(n=1, max_new_tokens=12, seed=6, temperature=0.7, top_k=30),
                                    SamplingParams(n=2, max_new_tokens=30, seed=7, stop=("a", "Q"),
                                                   stop_token_ids=tuple(range(100, 115))),
                                    SamplingParams(n=2, temperature=0.0, max_new_tokens=10)])
def test_client_generate_equals_local_engine(servers, local, params):
    client = SGLangClient([servers["main"]], concurrency=4, retry=FAST_RETRY)
    try:
        got = client.generate(requests(params))
    finally:
        client.close()
    assert_same_samples(got, local.generate(requests(params)))
    assert {s.weight_version for s in got} == {0}


def test_unseeded_n_samples_come_in_one_request(servers):
    client = SGLangClient([servers["main"]], retry=FAST_RETRY)
    out = client.generate([GenerationRequest((5, 6), SamplingParams(n=4, max_new_tokens=8), "u")])
    client.close()
    assert [s.sample_index for s in out] == [0, 1, 2, 3] and len({tuple(s.response_ids) for s in out}) == 4


def test_5xx_is_retried(servers, local):
    client = SGLangClient([servers["flaky"]], retry=FAST_RETRY)
    params = SamplingParams(max_new_tokens=4, seed=1)
    got = client.generate(requests(params)[:1])  # 503, 503, then the answer
    client.close()
    assert_same_samples(got, local.generate(requests(params)[:1]))


def test_4xx_is_not_retried_and_names_the_url(servers):
    with pytest.raises(SGLangError, match=rf"{servers['secured']}/generate: HTTP 401") as info:
        SGLangClient([servers["secured"]], retry=FAST_RETRY).generate(requests(SamplingParams(max_new_tokens=2))[:1])
    assert info.value.status == 401
    ok = SGLangClient([servers["secured"]], api_key="s3cret").generate(requests(SamplingParams(max_new_tokens=2))[:1])
    assert len(ok[0].response_ids) == 2


def test_timeout_gives_clear_error(servers):
    client = SGLangClient([servers["slow"]], timeout_s=0.5, retry=FAST_RETRY)
    start = time.monotonic()
    with pytest.raises(SGLangTimeoutError, match=rf"POST {servers['slow']}/generate: no answer within 0.5s"):
        client.generate(requests(SamplingParams(max_new_tokens=2))[:1])
    assert time.monotonic() - start < 2.5  # not retried
    client.close()


def test_unreachable_servers_give_one_error_naming_them():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    client = SGLangClient(dead, retry=FAST_RETRY)
    with pytest.raises(SGLangUnavailableError) as info:
        client.generate(requests(SamplingParams(max_new_tokens=2))[:1])
    message = str(info.value)
    assert all(url in message for url in dead) and "failed 3 times" in message and "cannot reach" in message
    with pytest.raises(SGLangConnectionError, match=rf"{dead[0]}/model_info: cannot reach"):
        client.call(dead[0], "/model_info", method="GET")


def test_server_killed_mid_request_is_retried_on_the_other(model_dir, tmp_path, local, servers):
    """The first request goes to a slow server that is SIGKILLed while answering; the client
    retries on the healthy one and avoids the dead one afterwards."""
    victim = launch_fake_servers(tmp_path, [fake_server_settings(model_dir, extra_args=["--generate-delay", "5"])])
    victim_url = victim.servers[0].url
    pid = victim.processes[0].process.pid
    client = SGLangClient([victim_url, servers["main"]], retry=FAST_RETRY)
    params = SamplingParams(n=2, max_new_tokens=6, seed=3)
    try:
        killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        got = client.generate(requests(params)[:1])
        elapsed = time.monotonic() - start
        killer.join()
        assert 1.0 <= elapsed < 4.5  # it waited on the victim, then the retry answered quickly
        assert victim.processes[0].process.wait(timeout=5) == -signal.SIGKILL
        assert_same_samples(got, local.generate(requests(params)[:1]))
        more = client.generate(requests(params))  # all go to the live server now
        assert_same_samples(more, local.generate(requests(params)))
    finally:
        client.close()
        victim.shutdown(grace_s=1)


def test_abort_returns_abort_samples(servers):
    engine = SGLangEngine(SGLangClient([servers["main"]], retry=FAST_RETRY),
                          DiskTransport(SGLangClient([servers["main"]]), [EngineTarget(servers["main"])], "/nonexistent"))
    threading.Timer(1.0, engine.abort).start()
    out = engine.generate(requests(SamplingParams(max_new_tokens=100_000, ignore_eos=True, seed=1))[:2])
    assert {s.finish_reason for s in out} == {"abort"} and all(len(s.response_ids) < 100_000 for s in out)
    assert engine.generate(requests(SamplingParams(max_new_tokens=3))[:1])[0].finish_reason == "length"


def test_engine_health_and_memory_calls(servers):
    engine = SGLangEngine(SGLangClient([servers["main"]]),
                          DiskTransport(SGLangClient([servers["main"]]), [EngineTarget(servers["main"])], "/nonexistent"))
    health = engine.health()
    assert health and health.weight_version == 0
    engine.release_memory()
    with pytest.raises(SGLangError, match=r"HTTP 503.*\[.cuda_graph., .kv_cache., .weights.\] are released"):
        engine.generate(requests(SamplingParams(max_new_tokens=2))[:1])
    engine.resume_memory()
    assert len(engine.generate(requests(SamplingParams(max_new_tokens=2))[:1])[0].response_ids) == 2
    bad = SGLangEngine(SGLangClient([f"http://127.0.0.1:{free_port()}"], retry=RetryPolicy(max_attempts=1)),
                       engine.transport)
    report = bad.health()
    assert not report and "cannot reach" in report.detail


def test_launcher_command_lines():
    settings = ServerSettings(model_path="/m", tp_size=4, mem_fraction_static=0.7, host="10.0.0.2", port=31000,
                              api_key="k", enable_memory_saver=True, extra_args=("--attention-backend", "fa3",
                                                                                  "--json-model-override-args", '{"a": 1}'),
                              python="python3")
    assert server_command(settings) == [
        "python3", "-m", "sglang.launch_server", "--model-path", "/m", "--tp-size", "4", "--host", "10.0.0.2",
        "--port", "31000", "--mem-fraction-static", "0.7", "--api-key", "k", "--enable-memory-saver",
        "--attention-backend", "fa3", "--json-model-override-args", '{"a": 1}']
    assert router_command(RouterSettings(port=30100, python="python3"), ["http://a:1", "http://b:2"]) == [
        "python3", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "30100", "--policy",
        "round_robin", "--worker-urls", "http://a:1", "http://b:2"]


def test_launcher_reports_a_server_that_dies_at_startup(tmp_path):
    settings = fake_server_settings(tmp_path / "no-such-model")
    with pytest.raises(SGLangError, match=rf"(?s)\({settings.url}\) exited with code 1 before becoming healthy.*"
                                          r"no config.json"):
        launch_fake_servers(tmp_path / "logs", [settings], timeout_s=60)
    assert (tmp_path / "logs" / f"sglang-0-port{settings.port}.log").is_file()


def test_launcher_shutdown_stops_the_processes(servers):
    launcher = servers["_launcher"]
    procs = [p.process for p in launcher.processes]
    assert all(p.poll() is None for p in procs)  # shut down at module teardown; here only checked alive
    assert [p.url for p in launcher.processes] == [servers[k] for k in ("main", "slow", "flaky", "secured")]


def test_check_sglang_tool_passes_against_the_fake(servers, model_dir, tmp_path):
    """tools/check_sglang.py end to end (last: it changes the secured server's weight version)."""
    log = tmp_path / "check_sglang.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-u", "tools/check_sglang.py", servers["secured"], "--model-path",
                                    str(model_dir), "--api-key", "s3cret", "--tensor-metadata", "plain",
                                    "--tolerance", "1e-5", "--verbose"], stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            returncode = process.wait(timeout=240)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"check_sglang.py did not finish in 240 s:\n{log.read_text()}")
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.startswith(("PASS ", "FAIL "))]
    assert returncode == 0, output
    assert [line.split()[1].rstrip(":") for line in lines] == ["health", "generate", "logprobs", "disk", "distributed",
                                                               "tensor", "restore"]
    assert all(line.startswith("PASS") for line in lines)
