"""The real sglang-router 0.3.2 (its Rust binary, a CPU wheel) in front of two SGLang test servers
(SGLang's own HTTP app and tokenizer manager, tests/sglang_harness) with deterministic inference:
seeded groups reproduce through it; and its readiness. The servers and the router answer only to one
API key, as the trainer and the sbatch scripts start them. "was:" names the behaviour before the fix.

The router in front of SGLang's own runtime (generation, seeded groups as separate requests, aborts
to each engine, API keys, a paused worker, a killed worker): tests/test_sglang_runtime.py."""
from __future__ import annotations

import time

import pytest

from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, request_json
from megatron_grpo.rollout.sglang.launcher import SGLangLauncher, router_command
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.testing.distributed import free_port
from tests.sglang_harness.fixtures import (harness_env, launch_servers, router_settings,
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

