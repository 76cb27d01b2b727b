"""The real sglang-router 0.3.2 (its Rust binary, a CPU wheel) in front of two SGLang test servers
(SGLang's own HTTP app and tokenizer manager, tests/sglang_harness): the client's generate path,
readiness, a paused worker and a killed worker. The servers and the router answer only to one API
key, as the trainer and the sbatch scripts start them. "was:" names the behaviour before the fix."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, request_json
from megatron_grpo.rollout.sglang.launcher import SGLangLauncher, router_command
from megatron_grpo.rollout.sglang.weight_sync import DiskTransport, EngineTarget
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.testing.distributed import free_port
from tests.sglang_harness.fixtures import (LONG_CONTEXT, harness_env, launch_servers, router_settings,
                                           save_long_context_model, server_settings, sglang_python)

pytestmark = pytest.mark.slow  # starts SGLang test servers and the router
# Fast health checks so that a paused or dead worker leaves the rotation within seconds.
ROUTER_FLAGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                "--health-success-threshold", "1", "--health-check-timeout-secs", "2")


KEY = "router-test-key"


def requests(params, count=4):
    return [GenerationRequest((5 + i, 9, 11), params, group_id=f"g{i}") for i in range(count)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    sglang_python()
    model_dir = save_long_context_model(tmp_path_factory.mktemp("model"))
    router = router_settings(extra_args=ROUTER_FLAGS, api_key=KEY)
    servers = [server_settings(model_dir, api_key=KEY) for _ in range(2)]
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), servers, router=router)
    yield {"router": router.url, "engines": [s.url for s in launcher.servers], "launcher": launcher}
    launcher.shutdown(grace_s=5)


def test_router_refuses_a_list_of_sampling_params(cluster):
    """was: seeded n>1 sent as one request with a list of sampling_params: 422 from the router."""
    with pytest.raises(SGLangError, match="HTTP 422") as info:
        request_json(cluster["router"], "/generate", {"input_ids": [[5, 6], [5, 6]], "return_logprob": True,
                                                      "sampling_params": [{"max_new_tokens": 3, "sampling_seed": 1},
                                                                          {"max_new_tokens": 3, "sampling_seed": 2}]},
                     api_key=KEY)
    assert info.value.status == 422


def test_seeded_groups_through_the_router_are_reproducible(cluster):
    client = SGLangClient([cluster["router"]], retry=RetryPolicy(max_attempts=2, backoff_s=0.1), api_key=KEY)
    params = SamplingParams(n=3, max_new_tokens=8, seed=11)
    first, again = client.generate(requests(params)), client.generate(requests(params))
    assert len(first) == 12 and [(s.group_id, s.sample_index) for s in first] == \
        [(f"g{i}", j) for i in range(4) for j in range(3)]
    # Deterministic inference on both engines: the same seed gives the same sample on either one.
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    client.close()


def test_router_health_is_liveness_readiness_is_the_ready_signal(tmp_path):
    """was: the launcher waited on the router's /health, which is 200 with no live worker."""
    dead_worker = f"http://127.0.0.1:{free_port()}"
    router = router_settings(extra_args=ROUTER_FLAGS)
    launcher = SGLangLauncher(servers=[], log_dir=tmp_path, router=router, env=harness_env())
    managed = launcher._spawn("router", router.url, router_command(router, [dead_worker]), "/readiness", None)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                request_json(router.url, "/health", method="GET", timeout_s=5)
                break
            except SGLangError:
                assert time.monotonic() < deadline, managed.log_tail()
                time.sleep(0.5)
        with pytest.raises(SGLangError, match="HTTP 503"):
            request_json(router.url, "/readiness", method="GET", timeout_s=5)
        with pytest.raises(SGLangError, match=r"not ready \(/readiness\) in time"):
            launcher._wait_one(managed, time.monotonic() + 3, 0.5)
    finally:
        launcher.shutdown(grace_s=2)


def test_abort_goes_to_each_engine_not_the_router(cluster):
    """was: /abort_request sent to the router URL, which has no such route (404)."""
    with pytest.raises(SGLangError, match="HTTP 404"):
        request_json(cluster["router"], "/abort_request", {"abort_all": True}, api_key=KEY)
    engines = SGLangClient(cluster["engines"], api_key=KEY)
    engine = SGLangEngine(engines,
                          DiskTransport(engines, [EngineTarget(u) for u in cluster["engines"]], "/nonexistent"),
                          generate_client=SGLangClient([cluster["router"]], api_key=KEY),
                          options=EngineOptions(health_check_interval_s=0))
    threading.Timer(1.0, engine.abort).start()
    out = engine.generate(requests(SamplingParams(max_new_tokens=LONG_CONTEXT - 100, ignore_eos=True, seed=1), count=2))
    assert {s.finish_reason for s in out} == {"abort"}


def test_a_paused_worker_leaves_the_rotation_and_comes_back(cluster):
    paused, other = cluster["engines"]
    request_json(paused, "/pause_generation", {"mode": "in_place"}, api_key=KEY)
    try:
        time.sleep(6)  # two failed health checks (each times out on the paused worker after 2 s)
        client = SGLangClient([cluster["router"]], timeout_s=30, retry=RetryPolicy(max_attempts=1), api_key=KEY)
        start = time.monotonic()
        out = client.generate(requests(SamplingParams(max_new_tokens=4, seed=2), count=6))
        assert len(out) == 6 and time.monotonic() - start < 20  # none waited on the paused worker
    finally:
        request_json(paused, "/continue_generation", {}, api_key=KEY)
    time.sleep(4)
    loads = {url: 0 for url in cluster["engines"]}
    before = {url: _generate_count(cluster, url) for url in loads}
    SGLangClient([cluster["router"]], api_key=KEY).generate(requests(SamplingParams(max_new_tokens=2, seed=3), count=8))
    assert all(_generate_count(cluster, url) > before[url] for url in loads)  # both serve again


def test_the_engines_and_the_router_answer_only_to_the_key(cluster):
    """was: servers and router open to every user who reaches the node (no key), and the key, when
    given, on the command line, which `ps` shows to all of them."""
    def status(url: str, path: str, payload=None, key=None, method="POST") -> int:
        try:
            request_json(url, path, payload, method=method, api_key=key, timeout_s=30)
        except SGLangError as exc:
            return exc.status
        return 200

    weights = {"model_path": "/elsewhere", "load_format": "auto"}
    prompt = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
    for url in cluster["engines"]:
        assert status(url, "/update_weights_from_disk", weights) == 401
        assert status(url, "/update_weights_from_disk", weights, key="wrong") == 401
        assert status(url, "/generate", prompt) == 401
        assert status(url, "/release_memory_occupation", {}) == 401
        assert status(url, "/generate", prompt, key=KEY) == 200
        assert status(url, "/health_generate", method="GET") == 200  # SGLang leaves /health* open
    assert status(cluster["router"], "/generate", prompt) == 401
    assert status(cluster["router"], "/generate", prompt, key="wrong") == 401
    assert status(cluster["router"], "/generate", prompt, key=KEY) == 200  # and it calls the workers with it
    # its control routes too: nobody else adds a worker (and receives the prompts) or flushes the caches
    assert status(cluster["router"], "/workers", method="GET") == 401
    assert status(cluster["router"], "/workers", {"url": "http://127.0.0.1:1"}) == 401
    assert status(cluster["router"], "/flush_cache", {}) == 401
    for proc in cluster["launcher"].processes:
        for process in [psutil.Process(proc.process.pid), *psutil.Process(proc.process.pid).children(recursive=True)]:
            assert KEY not in " ".join(process.cmdline()), (proc.name, process.cmdline())


def test_a_killed_worker_is_routed_around(cluster):
    """Last: it kills one engine. Requests in flight on it are retried by the router on the other."""
    victim = cluster["launcher"].processes[0]
    client = SGLangClient([cluster["router"]], timeout_s=60, retry=RetryPolicy(max_attempts=2, backoff_s=0.2),
                          api_key=KEY)
    killer = threading.Timer(0.5, os.killpg, (victim.process.pid, signal.SIGKILL))
    killer.start()
    out = client.generate(requests(SamplingParams(max_new_tokens=200, ignore_eos=True, seed=4), count=8))
    killer.join()
    assert len(out) == 8 and all(len(s.response_ids) == 200 for s in out)
    assert victim.process.wait(timeout=10) == -signal.SIGKILL


def _generate_count(cluster, url: str) -> int:
    """/generate requests the engine's access log has seen (its log file, written by SGLang's uvicorn)."""
    proc = next(p for p in cluster["launcher"].processes if p.url == url)
    return proc.log_path.read_text(errors="replace").count('"POST /generate HTTP/1.1" 200')
