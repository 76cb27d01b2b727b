"""The harness scheduler's load snapshots, served by SGLang 0.5.23's own GET /v1/loads (its writer in
the scheduler, its reader in the TokenizerManager), its instant mode (HARNESS_INSTANT=1) for
benchmarks of the client's own overhead, and what SGLangClient keeps in flight on each engine,
read there: directly and through the real sglang-router."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from megatron_grpo.rollout.sglang.launcher import SGLangLauncher
from tests.sglang_harness.fixtures import harness_env, server_settings, sglang_python
from tests.tiny_hf import EOS_ID, save_tiny_model

pytestmark = pytest.mark.slow  # starts SGLang test servers
FORWARD_DELAY_S = 0.02  # the loaded server: 6 sequences x 20 tokens take >= 2.4 s
INSTANT_DELAY_S = 5.0  # the instant server's delay, were it to run a forward pass


def http(url: str, path: str, payload: dict | None = None):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """"loaded", "loaded2": every forward pass slowed; "instant": HARNESS_INSTANT (and a delay no
    forward may pay). All start at once."""
    sglang_python()
    model = save_tiny_model(tmp_path_factory.mktemp("model"), seed=0)
    logs = tmp_path_factory.mktemp("logs")
    faults = {"loaded": {"HARNESS_FORWARD_DELAY_S": str(FORWARD_DELAY_S)},
              "loaded2": {"HARNESS_FORWARD_DELAY_S": str(FORWARD_DELAY_S)},
              "instant": {"HARNESS_INSTANT": "1", "HARNESS_FORWARD_DELAY_S": str(INSTANT_DELAY_S)}}
    settings = {name: server_settings(model) for name in faults}
    launchers = [SGLangLauncher(servers=[settings[name]], log_dir=logs / name, env=harness_env(faults[name]))
                 for name in faults]
    try:
        for launcher in launchers:
            launcher.start()
        for launcher in launchers:
            launcher.wait_healthy(timeout_s=300, poll_s=0.5)
        yield {name: s.url for name, s in settings.items()}
    finally:  # all at once: a harness server takes SGLang's 5 s to stop
        stoppers = [threading.Thread(target=launcher.shutdown, kwargs={"grace_s": 5}) for launcher in launchers]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join()


def test_v1_loads_counts_the_running_and_waiting_sequences(servers):
    url = servers["loaded"]
    idle = http(url, "/v1/loads")
    assert [(load["dp_rank"], load["num_running_reqs"], load["num_waiting_reqs"]) for load in idle["loads"]] == [
        (0, 0, 0)]
    assert idle["loads"][0]["max_total_num_tokens"] == 1 << 20 and idle["loads"][0]["max_running_requests"] > 0

    # 4 requests of one sequence and one of n=2 (SGLang's TokenizerManager fans it out): 6 sequences
    params = {"max_new_tokens": 20, "ignore_eos": True, "temperature": 1.0}
    payloads = [{"input_ids": [5, 9, 11], "sampling_params": {**params, "n": n}} for n in (1, 1, 1, 1, 2)]
    answers: list = []
    threads = [threading.Thread(target=lambda p=p: answers.append(http(url, "/generate", p))) for p in payloads]
    for thread in threads:
        thread.start()
    peak, peak_load = 0, None
    while any(thread.is_alive() for thread in threads):
        load = http(url, "/v1/loads")["loads"][0]
        if load["num_running_reqs"] + load["num_waiting_reqs"] > peak:
            peak, peak_load = load["num_running_reqs"] + load["num_waiting_reqs"], load
        time.sleep(0.01)
    for thread in threads:
        thread.join()
    sequences = [seq for answer in answers for seq in (answer if isinstance(answer, list) else [answer])]
    assert sorted(len(seq["output_ids"]) for seq in sequences) == [20] * 6
    assert peak == 6, peak_load
    assert peak_load["num_used_tokens"] >= 6 * 3  # the prompts at least

    deadline = time.monotonic() + 5
    while (load := http(url, "/v1/loads")["loads"][0])["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"]) == (0, 0, 0)


def test_instant_mode_answers_one_eos_token_at_once(servers):
    url = servers["instant"]
    start = time.monotonic()
    answer = http(url, "/generate", {"input_ids": [5, 9, 11], "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 30, "temperature": 1.0}})
    assert time.monotonic() - start < INSTANT_DELAY_S / 2  # no forward pass ran
    meta = answer["meta_info"]
    assert answer["output_ids"] == [EOS_ID] and meta["completion_tokens"] == 1
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert meta["output_token_logprobs"] == [[0.0, EOS_ID, None]]
    # ignore_eos: it ends anyway, as "length"; a sampling mask is the one-token support
    answer = http(url, "/generate", {"input_ids": [5], "return_logprob": True, "return_sampling_mask": True,
                                     "sampling_params": {"max_new_tokens": 30, "top_k": 1, "ignore_eos": True}})
    meta = answer["meta_info"]
    assert answer["output_ids"] == [EOS_ID] and meta["finish_reason"]["type"] == "length"
    assert meta["output_token_sampling_mask"] == [[EOS_ID]] and meta["output_token_logprobs"][0][0] == 0.0


def _peak_loads(urls: list[str], work) -> tuple[dict[str, int], int]:
    """Runs work() while polling each engine's /v1/loads: the most sequences (running + waiting)
    each engine held, and the most all of them held at one poll."""
    peaks, together = dict.fromkeys(urls, 0), 0
    thread = threading.Thread(target=work)
    thread.start()
    while thread.is_alive():
        loads = {url: sum(load["num_running_reqs"] + load["num_waiting_reqs"]
                          for load in http(url, "/v1/loads")["loads"]) for url in urls}
        peaks = {url: max(peaks[url], loads[url]) for url in urls}
        together = max(together, sum(loads.values()))
        time.sleep(0.005)
    thread.join()
    return peaks, together


def test_max_concurrency_is_sequences_per_engine_directly_and_behind_the_router(servers, tmp_path):
    """8 groups of n=3 (unseeded: one request of 3 sequences each) at max_concurrency=6: each of two
    engines holds 6 sequences (two requests) while work remains, never more; behind the router the
    client holds 6 x 2 engines and the router spreads them; with one engine fewer, 6 x 1."""
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
    from tests.sglang_harness.fixtures import launch_router

    engines = [servers["loaded"], servers["loaded2"]]
    requests = [GenerationRequest(prompt_ids=[5, 9, 11 + i], group_id=str(i),
                                  sampling=SamplingParams(n=3, max_new_tokens=12, ignore_eos=True))
                for i in range(8)]
    direct, results = SGLangClient(engines, concurrency=6), []
    peaks, _ = _peak_loads(engines, lambda: results.append(direct.generate(requests)))
    assert peaks == dict.fromkeys(engines, 6)
    assert direct.peak_in_flight == dict.fromkeys(engines, 6) and direct.in_flight == dict.fromkeys(engines, 0)
    assert sorted({s.engine for s in results[0]}) == sorted(engines) and len(results[0]) == 24

    router = launch_router(tmp_path / "router", engines)
    try:
        routed = SGLangClient([router.router.url], concurrency=6, engines_per_url=2)
        peaks, together = _peak_loads(engines, lambda: routed.generate(requests))
        # one engine left the pool (SGLangEngine._rotation_changed): the router's URL holds 6 x 1
        routed.set_engines_per_url(1)
        routed.reset_peaks()
        _, after_loss = _peak_loads(engines, lambda: routed.generate(requests))
    finally:
        router.shutdown(grace_s=2)
    assert together == 12 and after_loss == 6
    assert routed.peak_in_flight == {router.router.url: 6}
    assert all(peak >= 3 for peak in peaks.values()), peaks  # the router used both
