"""The SGLang client, weight transports, engine pool, launcher and sglang-router against SGLang
0.5.23's OWN runtime on this CPU (its scheduler, model runner, radix cache, torch-native attention,
sampler and weight updater; build/sglang-runtime-venv), started through the project's launcher as
the trainer starts it with rollout.sglang.device=cpu, in fp32.

Engines: two tiny Qwen3 (a 200k context, so that a generation runs until it is aborted) behind the
real sglang-router, all answering only to one API key; later a tiny Llama at TP 2 (SGLang's Llama has
get_weights_by_name; its peaked weights make top-p cut the sampling supports) with
--sampling-mask-max-tokens 30 and --enable-fp32-lm-head, and a tiny Qwen3-MoE with
--enable-return-routed-experts, which starts on a CPU only with the test-only torch shim of
tests/sglang_cpu_shim (its engine's PYTHONPATH only; no SGLang code changed). Log-probs are held to a float64 forward of
the same weights in transformers, with a tolerance of fp32 round-off; after every weight sync each
engine's /weights_checker checksums must equal what SGLang holds for the pushed tensors (its fused
qkv_proj / gate_up_proj, its vocabulary padded to a multiple of 64, TP shards:
tests/sglang_runtime_fixtures.py sglang_fused_checksums).

What the runtime cannot do on this CPU stays on the harness (tests/test_sglang.py and neighbours:
seeded reproducibility, memory release, fault injection). "was:" names a defect found here, with
the behaviour before its fix."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_grpo.rollout.local import LocalEngine
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
from megatron_grpo.rollout.sglang.errors import SGLangError, SGLangTimeoutError, SGLangUnavailableError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, request_json
from megatron_grpo.rollout.sglang.launcher import SGLangLauncher
from megatron_grpo.rollout.sglang.pool import EnginePool, EngineSlot
from megatron_grpo.rollout.sglang.update_session import UpdateSession
from megatron_grpo.rollout.sglang.verify import WeightSample, WeightVerificationError, verify_engines
from megatron_grpo.rollout.sglang.weight_sync import (DiskTransport, DistributedTransport, EngineTarget,
                                                      TensorTransport, update_weights)
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.testing.distributed import free_port
from tests.sglang_harness.fixtures import LONG_CONTEXT, save_long_context_model
from tests.sglang_runtime_fixtures import (launch_real_servers, real_router_settings, real_server_settings,
                                           runtime_env, runtime_python, sglang_fused_checksums)
from tests.tiny_hf import CHAR_CHAT_TEMPLATE, EOS_ID, char_tokenizer, float64_logprobs, save_peaky_llama, tiny_model

pytestmark = [pytest.mark.sglang_runtime]
KEY = "runtime-test-key"
FAST_RETRY = RetryPolicy(max_attempts=3, backoff_s=0.05)
NO_PROBE = EngineOptions(health_check_interval_s=0)
PROMPTS = [(5, 9, 11), (40, 41, 42, 43, 44, 45, 46), (7,) * 12]
LONG = LONG_CONTEXT - 100  # runs until aborted
KV_TOKENS = 16384  # --max-total-tokens: room for the long generations these tests abort
MASK_CAP = 30  # the Llama engine's --sampling-mask-max-tokens
ROUTES_FLAG = "--enable-return-routed-experts"
CPU_SHIM = Path(__file__).parent / "sglang_cpu_shim"  # test-only: routed experts start on a CPU (its docstring)
# Fast health checks so that a paused or dead worker leaves the router's rotation within seconds.
ROUTER_FLAGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                "--health-success-threshold", "1", "--health-check-timeout-secs", "2")


def requests(params, prompts=PROMPTS):
    return [GenerationRequest(p, params, group_id=f"g{i}") for i, p in enumerate(prompts)]


def client(urls, **kwargs) -> SGLangClient:
    return SGLangClient(urls, api_key=KEY, **{"retry": FAST_RETRY, **kwargs})


def call(url: str, path: str, payload=None, method: str = "POST", **kwargs):
    return request_json(url, path, payload, method=method, api_key=KEY, **kwargs)


# ----- what the engines should hold -------------------------------------------------------------
def fp32_logprob_tolerance(sample) -> float:
    """The engine computes in fp32 with a KV cache, the reference one float64 forward of the same
    weights: a few fp32 ulps per layer, growing with the sequence."""
    return 64 * torch.finfo(torch.float32).eps * max(1, len(sample.prompt_ids) + len(sample.response_ids))


def assert_logprobs_match(reference64, sample, temperature: float = 1.0) -> None:
    want = float64_logprobs(reference64, sample.prompt_ids, sample.response_ids, temperature)
    got = torch.tensor(sample.logprobs, dtype=torch.float64)
    assert (got - want).abs().max() <= fp32_logprob_tolerance(sample), (sample, (got - want).abs().max())


def assert_engine_holds(url: str, model, version: int, tp_size: int = 1) -> None:
    """Every parameter of every TP rank is bitwise what SGLang makes of the model's tensors, the
    engine stamps `version`, and its log-probs are the model's."""
    answer = call(url, "/weights_checker", {"action": "checksum"})
    assert [rank["checksums"] for rank in answer["ranks"]] == sglang_fused_checksums(
        model.config, model.state_dict(), tp_size=tp_size)  # every parameter: all were pushed
    reference = copy.deepcopy(model).double()
    for sample in client([url]).generate(requests(SamplingParams(max_new_tokens=8))[:2]):
        assert sample.weight_version == version
        assert_logprobs_match(reference, sample)
    assert call(url, "/model_info", method="GET")["weight_version"] == str(version)


def hf_stream(model):
    return ((name, tensor.clone()) for name, tensor in model.state_dict().items())


# ----- two Qwen3 engines behind the router ------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_long_context_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    runtime_python()
    engines = [real_server_settings(model_dir, api_key=KEY, max_total_tokens=KV_TOKENS) for _ in range(2)]
    router = real_router_settings(extra_args=ROUTER_FLAGS, api_key=KEY)
    launcher = launch_real_servers(tmp_path_factory.mktemp("logs"), engines, router=router)
    yield {"engines": [s.url for s in engines], "router": router.url, "launcher": launcher, "model_dir": model_dir}
    launcher.shutdown(grace_s=2)


@pytest.fixture(scope="module")
def reference():
    """The engines' checkpoint in transformers, in float64: the trainer-side recomputation."""
    return tiny_model(seed=0, scale=3.0).double()


def test_generate_answers_parse_into_samples(cluster):
    url = cluster["engines"][0]
    body = call(url, "/generate", {"input_ids": [5, 6, 7], "return_logprob": True,
                                   "sampling_params": {"n": 3, "max_new_tokens": 5, "ignore_eos": True}})
    assert isinstance(body, list) and len(body) == 3  # SGLang's own n>1 fan-out
    for item in body:
        meta = item["meta_info"]
        assert len(item["output_ids"]) == 5 and meta["finish_reason"] == {"type": "length", "length": 5}
        assert [row[1] for row in meta["output_token_logprobs"]] == item["output_ids"]
        assert meta["weight_version"] == "default" and meta["completion_tokens"] == 5
    samples = client([url]).generate(requests(SamplingParams(n=2, max_new_tokens=5, ignore_eos=True)))
    assert [(s.group_id, s.sample_index) for s in samples] == [(f"g{i}", j) for i in range(3) for j in range(2)]
    assert all(len(s.response_ids) == 5 and s.weight_version == 0 and s.engine == url for s in samples)
    # SGLang uses sampling_seed only under deterministic inference, which does not run on a CPU:
    # the same seeds give other samples (seeded reproducibility is tested on the harness)
    seeded = SamplingParams(n=3, max_new_tokens=12, seed=42)
    assert [s.response_ids for s in client([url]).generate(requests(seeded))] != \
        [s.response_ids for s in client([url]).generate(requests(seeded))]


@pytest.mark.parametrize("params", [SamplingParams(n=3, max_new_tokens=12),
                                    SamplingParams(n=2, max_new_tokens=12, temperature=0.7, top_k=30),
                                    SamplingParams(n=2, max_new_tokens=12, temperature=1.3, top_p=0.8, min_p=0.02),
                                    SamplingParams(n=2, max_new_tokens=30, stop=("a", "Q"),
                                                   stop_token_ids=tuple(range(100, 115)))])
def test_sampled_logprobs_equal_the_trainer_recomputation(cluster, reference, params):
    """The engine's log-probs are log_softmax(logits / T) of the sampled tokens, before top-p/top-k,
    as the trainer computes them; stops follow SGLang's own rules. was: top_k=30 with n=2 failed
    with HTTP 500 "The sampling backend did not return captured sampling support" (SGLang's n>1
    prefix warm-up request carries the sampling mask but samples nothing)."""
    samples = client(cluster["engines"]).generate(requests(params))
    assert len(samples) == len(PROMPTS) * params.n
    for sample in samples:
        assert_logprobs_match(reference, sample, params.temperature)
        if params.top_k != -1:  # a finite top_k asks for SGLang's sampling mask: behaviour log-probs
            assert len(sample.behaviour_logprobs) == len(sample.response_ids)
        if sample.finish_reason == "stop":  # SGLang's Req.update_finish_state
            text = char_tokenizer().decode(sample.response_ids)
            stop_ids = (*params.stop_token_ids, EOS_ID)  # SGLang keeps the stop token in output_ids
            assert sample.response_ids[-1] in stop_ids or any(s in text for s in params.stop), sample
        else:
            assert sample.finish_reason == "length" and len(sample.response_ids) == params.max_new_tokens
    if params.stop:
        assert "stop" in {s.finish_reason for s in samples}  # 15 stop ids, 2 stop strings: some stop


def test_greedy_equals_the_local_engine(cluster):
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=10)
    got = client(cluster["engines"][:1]).generate(requests(params))
    want = LocalEngine(tiny_model(seed=0, scale=3.0), char_tokenizer()).generate(requests(params))
    assert [s.response_ids for s in got] == [s.response_ids for s in want]


# ----- multi-turn: every turn a /generate with the trajectory's input_ids ---------------------------
def multi_turn_rollout(engine, temperature: float):
    from megatron_grpo.algo import AdvantageConfig
    from megatron_grpo.data.prompts import EncodedPrompt
    from megatron_grpo.data.records import PromptRecord
    from megatron_grpo.environments.episodes import EpisodeLimits
    from megatron_grpo.trainer.rollouts.multi_turn import MultiTurnSettings
    from megatron_grpo.trainer.rollouts.rollout_phase import RolloutSettings, collect_rollout_batch

    tokenizer, prompts = char_tokenizer(), []
    for i, key in enumerate(["ab", "xyz"]):
        record = PromptRecord(data_source="t", prompt=[{"role": "user", "content": key}], ground_truth="",
                              extra_info={"index": i})
        text = tokenizer.apply_chat_template(record.prompt, chat_template=CHAR_CHAT_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(EncodedPrompt(record, text, tokenizer(text, add_special_tokens=False)["input_ids"], False))
    # every ASCII character ends a turn (the model's other ids are Cyrillic): most turns are short
    sampling = SamplingParams(n=3, temperature=temperature, max_new_tokens=6, stop_token_ids=tuple(range(2, 96)))
    limits = EpisodeLimits(max_turns=3, max_new_tokens_per_turn=6, max_length=60, step_timeout_s=10.0)
    settings = RolloutSettings(n=3, sampling=sampling, adv_estimator="grpo", advantage_config=AdvantageConfig(),
                               multi_turn=MultiTurnSettings("tests.test_multi_turn:EchoEnvironment", {}, limits,
                                                            chat_template=CHAR_CHAT_TEMPLATE))
    return collect_rollout_batch(engine, lambda: prompts, tokenizer, None, settings, step=1, num_prompts=2,
                                 in_trainer_thread=False)


def test_multi_turn_trajectories_logprobs_and_greedy_equal_the_local_engine(cluster, reference):
    """The tool environment's observations are appended between turns: the engine's log-probs of the
    generated ids equal a float64 recomputation over the whole trajectory (observations masked out),
    and greedy trajectories equal the local engine's token for token (turns, observations, masks)."""
    url = cluster["engines"][0]
    engine = SGLangEngine(client([url]), DiskTransport(client([url]), [EngineTarget(url)], "/nonexistent"),
                          options=NO_PROBE)
    batch = multi_turn_rollout(engine, temperature=1.0)
    assert batch.metrics["multi_turn/turns_mean"] > 1.5
    assert sum(not all(s.response_mask) for s in batch.samples) >= 3
    for sample in batch.samples:
        mask = torch.tensor(sample.response_mask)
        got = torch.tensor(sample.rollout_logprobs, dtype=torch.float64)
        assert torch.all(got[~mask] == 0)
        want = float64_logprobs(reference, sample.prompt_ids, sample.response_ids)
        assert (got[mask] - want[mask]).abs().max() <= fp32_logprob_tolerance(sample)
    greedy = multi_turn_rollout(engine, temperature=0.0)
    local = multi_turn_rollout(LocalEngine(tiny_model(seed=0, scale=3.0), char_tokenizer()), temperature=0.0)
    assert [s.prompt_ids + s.response_ids for s in greedy.samples] == \
        [s.prompt_ids + s.response_ids for s in local.samples]
    assert [s.response_mask for s in greedy.samples] == [s.response_mask for s in local.samples]
    engine.close()


def test_over_sampling_aborts_the_tail_and_a_partial_response_is_continued(cluster, reference):
    """rollout.long_tail against the real scheduler: 4 groups for 1, the first with a short budget; its
    completion aborts the call (/abort_request), and the others come back with what they generated so
    far. Continued from prompt + partial response (a new request, prefix-cached by the radix cache),
    each joined response is the partial one extended, and all its log-probs equal one float64 forward."""
    from megatron_grpo.data.prompts import EncodedPrompt
    from megatron_grpo.data.records import PromptRecord
    from megatron_grpo.trainer.rollouts.long_tail import CarryOver, LongTailSettings, generate_cutting_the_tail

    url = cluster["engines"][0]
    engine = SGLangEngine(client([url]), DiskTransport(client([url]), [EngineTarget(url)], "/nonexistent"),
                          options=NO_PROBE)
    prompts = [EncodedPrompt(PromptRecord("t", [{"role": "user", "content": str(i)}], ""), str(i), list(p), False)
               for i, p in enumerate(PROMPTS + [(9, 8, 7, 6)])]
    long = SamplingParams(n=2, max_new_tokens=LONG, ignore_eos=True)

    def make_request(prompt, index):
        budget = 4 if index == 0 else LONG
        return GenerationRequest(tuple(prompt.input_ids), dataclasses.replace(long, max_new_tokens=budget), f"g{index}")

    carry = CarryOver()
    first = generate_cutting_the_tail(engine, carry, lambda: prompts, 1, LongTailSettings(3, True), long, make_request,
                                      in_trainer_thread=False)
    assert [g.prompt.text for g in first.groups] == ["0"] and len(carry.groups) == 3
    partial = {(g.prompt.text, s.sample_index): s for g in carry.groups for s in g.samples}
    assert all(s.finish_reason == "abort" for s in partial.values())
    assert sum(len(s.response_ids) for s in partial.values()) > 0, "the abort came before any token: nothing to test"
    longest = max(len(s.response_ids) for s in partial.values())
    rest = dataclasses.replace(long, max_new_tokens=longest + 3)  # each continuation: at most 3 + what it lacks
    second = generate_cutting_the_tail(engine, carry, lambda: [], 3, LongTailSettings(0, True), rest, make_request,
                                       in_trainer_thread=False)
    assert len(second.groups) == 3 and not carry.groups
    for group in second.groups:
        for sample in group.samples:
            before = partial[(group.prompt.text, sample.sample_index)]
            k = len(before.response_ids)
            assert sample.finish_reason == "length" and len(sample.response_ids) == longest + 3
            assert sample.response_ids[:k] == before.response_ids and sample.logprobs[:k] == before.logprobs
            assert_logprobs_match(reference, sample)
    engine.close()


def test_multi_turn_over_sampling_cuts_a_turn_that_the_next_round_continues(cluster, reference):
    """rollout.long_tail with multi-turn episodes against the real scheduler: group "0"'s turns stop at
    their first id and its environment ends the episode; that step (on the step pool, while the call
    goes on) completes the group and aborts the call; the other groups' turns (no stop, no EOS) come
    back cut, their environments untouched. The next round continues each cut turn from trajectory +
    partial turn with the rest of the turn's budget: the joined turn extends the partial one and all
    its log-probs equal one float64 forward."""
    from megatron_grpo.environments.episodes import ChatRenderer, EpisodeLimits
    from megatron_grpo.trainer.rollouts.long_tail import CarryOver, LongTailSettings
    from megatron_grpo.trainer.rollouts.long_tail_episodes import play_cutting_the_tail
    from megatron_grpo.trainer.rollouts.multi_turn import MultiTurnSettings, trajectory_sample, turn_output
    from tests.test_long_tail_episodes import prompts as tally_prompts

    url = cluster["engines"][0]
    engine = SGLangEngine(client([url]), DiskTransport(client([url]), [EngineTarget(url)], "/nonexistent"),
                          options=NO_PROBE)
    renderer = ChatRenderer(char_tokenizer(), CHAR_CHAT_TEMPLATE)

    def turns_of(groups):
        episodes = [(group, i) for group in groups for i in range(len(group.episodes))]

        def generate(turns, on_turn_done):
            requests = []
            for turn in turns:
                group, i = episodes[turn.episode]
                quick = group.prompt.text == "0"
                params = SamplingParams(n=1, max_new_tokens=turn.max_new_tokens, ignore_eos=not quick,
                                        stop_token_ids=tuple(range(2, 300)) if quick else ())
                requests.append(GenerationRequest(turn.ids, params, f"{group.group_id}:{i}"))
            done = engine.generate(requests, lambda k, samples: on_turn_done(k, turn_output(samples[0])))
            return [turn_output(s) for s in done]
        return generate

    def play(carry, feed, needed, over, per_turn):
        limits = EpisodeLimits(max_turns=3, max_new_tokens_per_turn=per_turn, max_length=LONG + 40, step_timeout_s=30)
        mt = MultiTurnSettings("tests.test_long_tail_episodes:TallyEnvironment", {}, limits, CHAR_CHAT_TEMPLATE)
        return play_cutting_the_tail(engine, carry, feed, needed, LongTailSettings(over, True), mt, renderer, 2,
                                     lambda g: f"g{g}", turns_of)

    carry = CarryOver()
    first = play(carry, lambda: tally_prompts(4), 1, 3, LONG)
    assert [g.prompt.text for g in first.groups] == ["0"] and len(carry.episodes) == 3
    cut = [e for g in carry.episodes for e in g.episodes]
    assert all(e.running and e.partial is not None and e.partial.finish_reason == "abort" for e in cut)
    assert sum(len(e.partial.ids) for e in cut) > 0, "the abort came before any token: nothing to test"
    partial = {id(e): e.partial for e in cut}
    environments = {id(e): e.environment for e in cut}
    longest = max(len(p.ids) for p in partial.values())
    second = play(carry, lambda: [], 3, 0, longest + 3)  # each cut turn: at most 3 + what it lacks
    assert len(second.groups) == 3 and not carry.episodes
    for group in second.groups:
        for i, e in enumerate(group.episodes):
            before, t = partial[id(e)], e.trajectory
            assert t.end == "turn_length" and t.turns == 1 and len(t.response_ids) == longest + 3
            assert t.response_ids[:len(before.ids)] == list(before.ids)
            assert t.logprobs[:len(before.ids)] == list(before.logprobs)
            assert environments[id(e)].seen == []  # a turn cut by a length limit is never stepped
            assert_logprobs_match(reference, trajectory_sample(t, group.group_id, i, 0))
    engine.close()


def test_4xx_is_not_retried_and_names_the_url(cluster):
    url = cluster["engines"][0]
    with pytest.raises(SGLangError, match=rf"{url}/generate: HTTP 401") as info:
        SGLangClient([url], retry=FAST_RETRY).generate(requests(SamplingParams(max_new_tokens=2))[:1])
    assert info.value.status == 401
    with pytest.raises(SGLangError, match=r"HTTP 400: .*top_k must be -1 \(disable\) or at least 1") as info:
        call(url, "/generate", {"input_ids": [5], "sampling_params": {"top_k": 0}})
    assert info.value.status == 400


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
    router = cluster["router"]
    assert status(router, "/generate", prompt) == 401
    assert status(router, "/generate", prompt, key="wrong") == 401
    assert status(router, "/generate", prompt, key=KEY) == 200  # and it calls the workers with it
    assert status(router, "/workers", method="GET") == 401
    assert status(router, "/workers", {"url": "http://127.0.0.1:1"}) == 401
    assert status(router, "/flush_cache", {}) == 401
    for proc in cluster["launcher"].processes:
        for process in [psutil.Process(proc.process.pid), *psutil.Process(proc.process.pid).children(recursive=True)]:
            assert KEY not in " ".join(process.cmdline()), (proc.name, process.cmdline())


def test_timeout_gives_clear_error(cluster):
    url = cluster["engines"][0]
    start = time.monotonic()
    with pytest.raises(SGLangTimeoutError, match=rf"POST {url}/generate: no answer within 0.5s"):
        client([url], timeout_s=0.5).generate(requests(SamplingParams(max_new_tokens=LONG, ignore_eos=True))[:1])
    assert time.monotonic() - start < 2.5  # not retried
    call(url, "/abort_request", {"abort_all": True})


def test_abort_returns_abort_samples(cluster):
    url = cluster["engines"][0]
    engines = client([url])
    engine = SGLangEngine(engines, DiskTransport(engines, [EngineTarget(url)], "/nonexistent"), options=NO_PROBE)
    threading.Timer(1.0, engine.abort).start()
    out = engine.generate(requests(SamplingParams(max_new_tokens=LONG, ignore_eos=True))[:2])
    assert {s.finish_reason for s in out} == {"abort"} and all(len(s.response_ids) < LONG for s in out)
    assert engine.generate(requests(SamplingParams(max_new_tokens=3))[:1])[0].finish_reason == "length"


# ----- the router --------------------------------------------------------------------------------
def test_abort_goes_to_each_engine_not_the_router(cluster):
    """was: /abort_request sent to the router URL, which has no such route (404)."""
    with pytest.raises(SGLangError, match="HTTP 404"):
        call(cluster["router"], "/abort_request", {"abort_all": True})
    engines = client(cluster["engines"])
    targets = [EngineTarget(u) for u in cluster["engines"]]
    engine = SGLangEngine(engines, DiskTransport(engines, targets, "/nonexistent"),
                          generate_client=client([cluster["router"]]), options=NO_PROBE)
    threading.Timer(1.0, engine.abort).start()
    out = engine.generate(requests(SamplingParams(max_new_tokens=LONG, ignore_eos=True)))
    assert {s.finish_reason for s in out} == {"abort"}


def test_router_serves_seeded_groups_as_separate_requests(cluster):
    """was: seeded n>1 sent as one request with a list of sampling_params: 422 from the router."""
    with pytest.raises(SGLangError, match="HTTP 422") as info:
        call(cluster["router"], "/generate", {"input_ids": [[5, 6], [5, 6]], "return_logprob": True,
                                              "sampling_params": [{"max_new_tokens": 3, "sampling_seed": 1},
                                                                  {"max_new_tokens": 3, "sampling_seed": 2}]})
    assert info.value.status == 422
    params = SamplingParams(n=3, max_new_tokens=8, seed=11, ignore_eos=True)
    samples = client([cluster["router"]]).generate(requests(params))
    assert [(s.group_id, s.sample_index) for s in samples] == [(f"g{i}", j) for i in range(3) for j in range(3)]
    assert all(len(s.response_ids) == 8 and s.engine == cluster["router"] for s in samples)


def _generate_count(cluster, url: str) -> int:
    """/generate requests the engine's access log has seen (its log file, written by SGLang's uvicorn)."""
    proc = next(p for p in cluster["launcher"].processes if p.url == url)
    return proc.log_path.read_text(errors="replace").count('"POST /generate HTTP/1.1" 200')


def test_a_paused_worker_leaves_the_rotation_and_comes_back(cluster):
    paused = cluster["engines"][0]
    call(paused, "/pause_generation", {"mode": "in_place"})
    try:
        time.sleep(6)  # two failed health checks (each times out on the paused worker after 2 s)
        routed = client([cluster["router"]], timeout_s=30, retry=RetryPolicy(max_attempts=1))
        start = time.monotonic()
        out = routed.generate([GenerationRequest((5 + i, 9), SamplingParams(max_new_tokens=4), f"p{i}")
                               for i in range(6)])
        assert len(out) == 6 and time.monotonic() - start < 20  # none waited on the paused worker
    finally:
        call(paused, "/continue_generation", {})
    time.sleep(4)
    before = {url: _generate_count(cluster, url) for url in cluster["engines"]}
    client([cluster["router"]]).generate([GenerationRequest((5 + i, 9), SamplingParams(max_new_tokens=2), f"q{i}")
                                          for i in range(8)])
    assert all(_generate_count(cluster, url) > before[url] for url in cluster["engines"])  # both serve again


def test_check_sglang_tool_passes(cluster, tmp_path):
    """tools/check_sglang.py, the check for a real server, end to end with every transport (first of
    the weight tests: it compares with the checkpoint, and restores it at the end)."""
    url = cluster["engines"][0]
    log = tmp_path / "check_sglang.log"
    with open(log, "w") as out:  # a file, not a pipe: torch's shm manager daemon inherits the handles
        process = subprocess.Popen([runtime_python(), "-u", "tools/check_sglang.py", url, "--model-path",
                                    str(cluster["model_dir"]), "--api-key", KEY, "--tolerance", "1e-5", "--verbose",
                                    # the plain list: importing sglang's bucket class costs the process
                                    # seconds (flattened buckets: test_tensor_payload_passes_...)
                                    "--tensor-payload", "tensors"],
                                   stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            returncode = process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"check_sglang.py did not finish in 300 s:\n{log.read_text()}")
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.startswith(("PASS ", "FAIL "))]
    assert returncode == 0, output
    assert [line.split()[1].rstrip(":") for line in lines] == ["health", "generate", "logprobs", "disk", "distributed",
                                                               "tensor", "restore"]
    assert all(line.startswith("PASS") for line in lines)


# ----- weight updates ----------------------------------------------------------------------------
def test_distributed_transport_opens_the_weight_update_session(cluster):
    """was: /update_weights_from_distributed without /begin_weight_update: HTTP 400 from SGLang."""
    urls = cluster["engines"]
    with pytest.raises(SGLangError, match="must run between begin_weight_update"):
        call(urls[0], "/update_weights_from_distributed",
             {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]})
    engines = client(urls)
    transport = DistributedTransport(engines, [EngineTarget(u) for u in urls], "127.0.0.1", 0, group_name="test-dist",
                                     backend="gloo", bucket_bytes=64 * 1024, timeout_s=60)
    assert transport.world_size == 3
    transport.connect()
    engine = SGLangEngine(engines, transport, options=NO_PROBE)
    model = tiny_model(seed=1, scale=3.0)
    engine.update_weights(hf_stream(model), version=7)
    assert engine.last_sync.num_buckets > 3 and engine.last_sync.num_tensors == len(model.state_dict())
    # checked by checksums; SGLang's Qwen3 has no get_weights_by_name (values: the Llama test below)
    assert engine.sync_metrics()["sync/verified"] == 1.0 and engine.sync_metrics()["sync/verified_tensors"] == 0
    for url in urls:
        assert_engine_holds(url, model, 7)
    transport.close()


def test_one_group_per_pipeline_stage_in_parallel(cluster):
    """Two stages push disjoint halves of the weights through their own groups at the same time."""
    url = cluster["engines"][0]
    model = tiny_model(seed=2, scale=3.0)
    names = list(model.state_dict())
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    engines = client([url])
    transports = [DistributedTransport.for_pipeline_stage(engines, [EngineTarget(url)], "127.0.0.1", s,
                                                          backend="gloo", bucket_bytes=32 * 1024, timeout_s=60)
                  for s in range(2)]
    errors = []
    for transport in transports:
        transport.connect()

    def stage(s):
        try:
            state = model.state_dict()
            transports[s].push(((n, state[n].clone()) for n in halves[s]), version=9)
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    with UpdateSession(engines, [url]):  # one session; its flush drops KV computed with the old weights
        threads = [threading.Thread(target=stage, args=(s,)) for s in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, errors
    assert_engine_holds(url, model, 9)
    for transport in transports:
        transport.close()


def test_tensor_payload_passes_sglangs_safe_unpickler_both_ways(cluster):
    """Both payloads of /update_weights_from_tensor through SGLang's SafeUnpickler: a plain
    (name, tensor) list (where sglang does not import) and SGLang's own flattened_bucket (where it
    does, as in this interpreter), in shared memory."""
    urls = cluster["engines"]
    engines = client(urls)
    for flattened, seed, version in ((False, 4, 11), (True, 5, 12)):
        model = tiny_model(seed=seed, scale=3.0)
        transport = TensorTransport(engines, [EngineTarget(u) for u in urls], flattened=flattened,
                                    bucket_bytes=100 * 1024)
        stats = update_weights(engines, transport, hf_stream(model), version)
        assert stats.num_buckets > 1
        for url in urls:
            assert_engine_holds(url, model, version)


def test_disk_transport(cluster, tmp_path):
    urls = cluster["engines"]
    engines = client(urls)
    transport = DiskTransport(engines, [EngineTarget(u) for u in urls], tmp_path, side_files_from=cluster["model_dir"],
                              keep_last=1, max_shard_bytes=200 * 1024)
    engine = SGLangEngine(engines, transport, options=NO_PROBE)
    for version, seed in ((13, 6), (14, 7)):
        model = tiny_model(seed=seed, scale=3.0)
        engine.update_weights(hf_stream(model), version=version)
        for url in urls:
            assert_engine_holds(url, model, version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights_v14"]  # older versions pruned
    index = json.loads((tmp_path / "weights_v14" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) and len(set(index["weight_map"].values())) > 1


def _when_in_flight(engines: SGLangClient, url: str, then_wait_s: float) -> None:
    deadline = time.monotonic() + 60
    while not engines.in_flight.get(url):
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.05)
    time.sleep(then_wait_s)


def test_update_aborts_running_generation_then_resumes(cluster):
    """pause_generation(abort) ends an in-flight generate, flush_cache waits for it to drain, and
    continue_generation lets the next generate through with the new version."""
    url = cluster["engines"][0]
    generating = client([url])
    engine = SGLangEngine(client([url]), TensorTransport(client([url]), [EngineTarget(url)]),
                          generate_client=generating, options=NO_PROBE)
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=engine.generate(
        [GenerationRequest((5, 6), SamplingParams(max_new_tokens=LONG, ignore_eos=True), "long")])))
    runner.start()
    _when_in_flight(generating, url, 1.0)
    model = tiny_model(seed=8, scale=3.0)
    engine.update_weights(hf_stream(model), version=15)
    runner.join(timeout=60)
    assert result["out"][0].finish_reason == "abort"
    assert_engine_holds(url, model, 15)


def test_async_generate_resubmits_groups_a_weight_update_aborted(cluster):
    """With resubmit_aborted (asynchronous GRPO), a group aborted by a weight update mid-generation
    is sent again: SGLang holds it until generation continues, so it comes back whole, from the new
    weights; a group that finished before the update keeps its old version. Two requests of one
    group each get their own continuation back."""
    url = cluster["engines"][0]
    generating = client([url])
    engine = SGLangEngine(client([url]), TensorTransport(client([url]), [EngineTarget(url)]),
                          generate_client=generating, options=dataclasses.replace(NO_PROBE, resubmit_aborted=True))
    long = SamplingParams(max_new_tokens=1500, ignore_eos=True)
    batch = [GenerationRequest((5, 6), long, group_id="long"),
             GenerationRequest((5, 6), SamplingParams(max_new_tokens=3), group_id="short"),
             GenerationRequest((7, 8, 9), long, group_id="long")]
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=engine.generate(batch)))
    runner.start()
    _when_in_flight(generating, url, 1.0)
    model = tiny_model(seed=9, scale=3.0)
    engine.update_weights(hf_stream(model), version=16)
    runner.join(timeout=300)
    long_sample, short_sample, other_long = result["out"]
    for sample, prompt in ((long_sample, [5, 6]), (other_long, [7, 8, 9])):
        assert (sample.finish_reason, len(sample.response_ids), sample.prompt_ids) == ("length", 1500, prompt)
        assert sample.weight_version == 16
    assert engine.resubmitted_groups == 1
    assert short_sample.finish_reason == "length" and short_sample.weight_version != 16
    assert_engine_holds(url, model, 16)


def test_verification_names_engines_that_disagree(cluster):
    """An engine that missed an update disagrees with the others on /weights_checker checksums.
    Qwen3 in SGLang has no get_weights_by_name (HTTP 400), so the value check is reported
    unavailable and the checksums are what catch it."""
    first, second = cluster["engines"]
    engines = client([first, second])
    with pytest.raises(SGLangError, match=r"HTTP 400: .*Get parameter by name failed") as unavailable:
        engines.call(first, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 2})
    assert unavailable.value.status == 400
    model = tiny_model(seed=10, scale=3.0)
    sample = WeightSample()
    update_weights(engines, TensorTransport(engines, [EngineTarget(first)]), sample.tap(hf_stream(model)), 17)
    assert verify_engines(engines, [EngineTarget(first)], sample).value_checked == 0
    with pytest.raises(WeightVerificationError, match=rf"engines {first} and {second} disagree"):
        verify_engines(engines, [EngineTarget(first), EngineTarget(second)], sample)


# ----- engines that die --------------------------------------------------------------------------
def test_pool_takes_a_dead_engine_out_and_stops_below_min_engines(cluster):
    live, dead = cluster["engines"][0], f"http://127.0.0.1:{free_port()}"
    engines = client([live, dead])
    pool = EnginePool([EngineSlot(EngineTarget(live)), EngineSlot(EngineTarget(dead))], min_engines=1,
                      probe_timeout_s=10, api_key=KEY, on_change=lambda alive: engines.set_urls([t.url for t in alive]))
    assert pool.probe() == [dead]
    assert engines.urls == [live] and not pool.recover()
    strict = EnginePool([EngineSlot(EngineTarget(live)), EngineSlot(EngineTarget(dead))], min_engines=2,
                        probe_timeout_s=10, api_key=KEY)
    with pytest.raises(SGLangUnavailableError, match=rf"only 1 of 2 SGLang engines are alive.*{dead}"):
        strict.recover()
    engines.close()


def test_an_engine_killed_mid_rollout_is_routed_around_and_taken_out(cluster):
    """Last for this cluster: it SIGKILLs the second engine while a rollout runs through the router
    and another straight to both engines. The router retries the killed worker's requests on the
    other, the client retries its own there, and the pool's probe takes the dead engine out."""
    survivor, victim_url = cluster["engines"]
    victim = next(p for p in cluster["launcher"].processes if p.url == victim_url)
    direct = client([survivor, victim_url], timeout_s=120, retry=RetryPolicy(max_attempts=3, backoff_s=0.2))
    routed = client([cluster["router"]], timeout_s=120, retry=RetryPolicy(max_attempts=2, backoff_s=0.2))
    pool = EnginePool([EngineSlot(EngineTarget(survivor)), EngineSlot(EngineTarget(victim_url))], min_engines=1,
                      probe_timeout_s=10, api_key=KEY, on_change=lambda alive: direct.set_urls([t.url for t in alive]))
    params = SamplingParams(max_new_tokens=300, ignore_eos=True)
    batch = [GenerationRequest((5 + i, 9, 11), params, group_id=f"k{i}") for i in range(6)]
    results, errors = {}, []

    def run(name, which):
        try:
            results[name] = which.generate(batch)
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name, which)) for name, which in (("direct", direct),
                                                                                    ("routed", routed))]
    for thread in threads:
        thread.start()
    _when_in_flight(direct, victim_url, 0.3)
    os.killpg(victim.process.pid, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    for name in ("direct", "routed"):
        assert len(results[name]) == 6 and all(len(s.response_ids) == 300 for s in results[name]), name
    assert {s.engine for s in results["direct"]} <= {survivor, victim_url}
    assert victim.process.wait(timeout=10) == -signal.SIGKILL
    assert pool.probe() == [victim_url] and direct.urls == [survivor]
    # the cluster's last test: its engines end now, so that the next ones start with the machine's
    # cores and memory to themselves (its teardown finds nothing left to stop)
    cluster["launcher"].shutdown(grace_s=2)


# ----- a Llama at TP 2 (sampling masks, values by name, distributed updates into both ranks) and a
# ----- Qwen3-MoE with routed experts, started together after the cluster's engines ended ---------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (SGLang's LlamaForCausalLM has get_weights_by_name) with the character tokenizer;
    weights large enough that top-p cuts the distributions at different sizes."""
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_peaky_llama(folder)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts, softmax top-2, every layer sparse as SGLang 0.5.23 builds it) and a
    tiny GLM-4.5 (sigmoid router with expert bias, group-limited top-k, layer 0 dense)."""
    from megatron_grpo.data.synthetic import build_tokenizer
    from megatron_grpo.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("moe")
    folders = {"qwen3_moe": save_tiny_hf_model("qwen3_moe", root / "qwen3_moe", seed=1, mlp_only_layers=[]),
               "glm4_moe": save_tiny_hf_model("glm4_moe", root / "glm4_moe", seed=1)}
    for folder in folders.values():
        build_tokenizer(folder)
    return folders


@pytest.fixture(scope="module")
def late(llama, moe_dirs, tmp_path_factory):
    """tp2: the Llama at TP 2; qwen3_moe and glm4_moe: the MoE models with --enable-return-routed-experts,
    which start on a CPU only with the test-only torch shim of tests/sglang_cpu_shim on their PYTHONPATH
    (the GLM engine without an API key, as the trainer's recipe gives it). All start at once (two
    launchers: the shim is in the MoE engines' environment only)."""
    runtime_python()
    logs = tmp_path_factory.mktemp("logs")
    tp2 = real_server_settings(llama[0], tp_size=2, api_key=KEY,
                               extra_args=("--sampling-mask-max-tokens", str(MASK_CAP), "--enable-fp32-lm-head"))
    moe = {"qwen3_moe": real_server_settings(moe_dirs["qwen3_moe"], api_key=KEY, extra_args=(ROUTES_FLAG,)),
           "glm4_moe": real_server_settings(moe_dirs["glm4_moe"], extra_args=(ROUTES_FLAG,))}
    shim = {"PYTHONPATH": os.pathsep.join([str(CPU_SHIM), os.environ.get("PYTHONPATH", "")])}
    launchers = [SGLangLauncher(servers=[tp2], log_dir=logs, env=runtime_env()),
                 SGLangLauncher(servers=list(moe.values()), log_dir=logs, env=runtime_env(shim))]
    try:
        for launcher in launchers:
            launcher.start()
        for launcher in launchers:
            launcher.wait_healthy(timeout_s=300, poll_s=0.5)
        yield {"tp2": tp2.url, "tp2_pid": launchers[0].processes[0].process.pid,
               **{name: settings.url for name, settings in moe.items()}}
    finally:
        for launcher in launchers:
            launcher.shutdown(grace_s=2)


@pytest.fixture(scope="module")
def tp2(late):
    return {"url": late["tp2"], "pid": late["tp2_pid"]}


def truncated(top_k: int, top_p: float, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, top_k=top_k, top_p=top_p, max_new_tokens=12)


def sglang_sampler_function(name: str):
    """A torch-only top-level function of SGLang's sampler module, compiled from the runtime's
    source alone (importing sglang.srt.layers.sampler takes seconds)."""
    import ast
    from typing import Optional

    venv = Path(runtime_python()).parent.parent
    source = next(venv.glob("lib/python*/site-packages/sglang/srt/layers/sampler.py"))
    node = next(n for n in ast.parse(source.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch, "Optional": Optional}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(source), "exec"), namespace)
    return namespace[name]


def reference_supports(float64_model, sample, params: SamplingParams):
    """Per response token: SGLang's support set and log(p_y / sum_S p), from float64 probabilities."""
    sample_fn = sglang_sampler_function("top_k_top_p_min_p_sampling_from_probs_torch")
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.response_ids)])
    with torch.no_grad():
        logits = float64_model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1:-1]
    probs = torch.softmax(logits / params.temperature, dim=-1)
    rows = len(sample.response_ids)
    _, weights, token_ids, _ = sample_fn(
        probs.clone(), torch.full((rows,), params.top_k), torch.full((rows,), params.top_p, dtype=torch.float64),
        torch.full((rows,), params.min_p, dtype=torch.float64), params.min_p > 0, None, torch.arange(rows),
        return_filtered_probs=True)
    supports = [set(token_ids[i][weights[i] > 0].tolist()) for i in range(rows)]
    behaviour = [math.log(probs[i, y].item() / probs[i, sorted(s)].sum().item())
                 for i, (y, s) in enumerate(zip(sample.response_ids, supports))]
    return supports, behaviour


def test_truncated_sampling_returns_sglangs_support_and_behaviour_logprobs(tp2, llama):
    """Each token's support is the set SGLang's torch sampler keeps (top-k and top-p cuts both
    binding somewhere), contains the token, and its behaviour log-prob is log(p_y / sum_S p).
    was: n=2 answered HTTP 500 (see test_sampled_logprobs_equal_the_trainer_recomputation)."""
    url = tp2["url"]
    model = copy.deepcopy(llama[1]).double()
    cases = [truncated(20, 0.9, n=2), truncated(MASK_CAP, 0.5), truncated(MASK_CAP, 0.99)]
    engines = client([url])
    samples = engines.generate([GenerationRequest(PROMPTS[i], params, f"g{i}", return_support=True)
                                for i, params in enumerate(cases)])
    assert len(samples) == 4 and {s.engine for s in samples} == {url}
    sizes = set()
    for sample, params in zip(samples, [cases[0], cases[0], cases[1], cases[2]]):
        assert len(sample.response_ids) == len(sample.sampling_support) == len(sample.behaviour_logprobs) > 0
        assert_logprobs_match(model, sample)
        supports, behaviour = reference_supports(model, sample, params)
        tolerance = fp32_logprob_tolerance(sample)
        for position, (token, got, want) in enumerate(zip(sample.response_ids, sample.sampling_support, supports)):
            assert token in got and len(got) == len(set(got)), (sample.group_id, position)
            assert set(got) == want, (sample.group_id, position, sorted(set(got) ^ want))
            sizes.add(len(got))
        torch.testing.assert_close(torch.tensor(sample.behaviour_logprobs, dtype=torch.float64),
                                   torch.tensor(behaviour, dtype=torch.float64), atol=tolerance, rtol=0)
        # the truncated distribution is a renormalised part of the full one: its log-probs are larger
        assert all(b >= f - tolerance for b, f in zip(sample.behaviour_logprobs, sample.logprobs))
    assert 20 in sizes and MASK_CAP in sizes and min(sizes) < 20, sizes  # top-k cut, top-p cut
    # greedy: SGLang samples it as top_k=1, the support is the token, its behaviour log-prob 0
    [greedy] = engines.generate([GenerationRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=6),
                                                   "greedy", return_support=True)])
    assert greedy.sampling_support == [[t] for t in greedy.response_ids] and set(greedy.behaviour_logprobs) == {0.0}


def test_sglang_refuses_masks_it_cannot_build(tp2):
    """SGLang refuses a mask without a finite top_k <= its cap (HTTP 400, the scheduler's check):
    one clear error, not retried, the engine not blamed."""
    url = tp2["url"]
    engines = client([url])
    body = {"input_ids": [5, 6], "return_logprob": True, "return_sampling_mask": True,
            "sampling_params": {"top_k": -1, "top_p": 0.9, "max_new_tokens": 2}}
    with pytest.raises(SGLangError, match=rf"HTTP 400: .*return_sampling_mask requires top_k=1 for greedy sampling "
                                          rf"or finite 1 < top_k <= {MASK_CAP}; got top_k=1073741824") as refused:
        engines.call(url, "/generate", body)
    assert refused.value.status == 400
    with pytest.raises(SGLangError, match="top_k=-1"):  # the client does not even send it
        engines.generate([GenerationRequest((5, 6), truncated(-1, 0.9), "none", return_support=True)])
    over = GenerationRequest((5, 6), truncated(MASK_CAP + 1, 1.0), "over", return_support=True)
    with pytest.raises(SGLangError, match=rf"{url}/generate refused the sampling mask of request 'over' "
                                          rf"\(top_k={MASK_CAP + 1}, .*set rollout.top_k to a finite value .*"
                                          rf"got top_k={MASK_CAP + 1}") as refused:
        engines.generate([over])
    assert refused.value.status == 400 and not engines.rotation.is_dead(url)


def test_get_weights_by_name_and_value_verification_on_llama(tp2, llama):
    """SGLang's Llama answers /get_weights_by_name (its Qwen2/Qwen3 do not), so value verification
    runs, here at TP 2 (rank 0's rows): it names a tensor the engine skipped (SGLang's load_weights
    ignores unknown names) and one whose values differ."""
    url, model = tp2["url"], llama[1]
    assert call(url, "/server_info", method="GET")["enable_fp32_lm_head"] is True  # accepted
    assert call(url, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 3}) == \
        model.state_dict()["model.norm.weight"][:3].tolist()
    engines = client([url])
    engine = SGLangEngine(engines, TensorTransport(engines, [EngineTarget(url, tp_size=2)]), options=NO_PROBE)
    # the same weights (the engine keeps serving the checkpoint), one under a name the model lacks
    renamed = ((name.replace("model.norm.weight", "model.final_norm.weight"), tensor.clone())
               for name, tensor in model.state_dict().items())
    with pytest.raises(WeightVerificationError, match=rf"{url} has no parameter 'model.final_norm.weight'"):
        engine.update_weights(renamed, version=1)
    sample = WeightSample(tp_size=2)
    list(sample.tap(model.state_dict().items()))
    assert verify_engines(engines, [EngineTarget(url, tp_size=2)], sample).value_checked == len(sample.tensors) > 3
    sample.tensors["lm_head.weight"] = sample.tensors["lm_head.weight"] + 1.0
    with pytest.raises(WeightVerificationError, match=rf"{url} holds different values for 'lm_head.weight'"):
        verify_engines(engines, [EngineTarget(url, tp_size=2)], sample)


def test_tp2_engine_generates_and_takes_a_distributed_update_into_both_ranks(tp2, llama):
    """The launcher's TP>1 environment on a CPU (SGLANG_CPU_OMP_THREADS_BIND, one core group per
    rank; SGLANG_NCCL_SO_PATH, so TP all-reduce falls back to gloo) serves; the weight-update group
    spans the trainer and both TP ranks (world size 3), and each rank holds its shard."""
    url = tp2["url"]
    environ = psutil.Process(tp2["pid"]).environ()
    assert len(environ["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2 and environ["SGLANG_USE_CPU_ENGINE"] == "1"
    reference = copy.deepcopy(llama[1]).double()
    for sample in client([url]).generate(requests(SamplingParams(n=2, max_new_tokens=12))):
        assert_logprobs_match(reference, sample)
    engines = client([url])
    transport = DistributedTransport(engines, [EngineTarget(url, tp_size=2)], "127.0.0.1", 0, group_name="test-tp2",
                                     backend="gloo", bucket_bytes=16 * 1024, timeout_s=60)
    assert transport.world_size == 3
    transport.connect()
    engine = SGLangEngine(engines, transport, options=NO_PROBE)
    model = copy.deepcopy(llama[1])
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.1)
    engine.update_weights(hf_stream(model), version=21)
    assert engine.sync_metrics()["sync/verified_tensors"] > 3  # Llama: values by name too
    assert_engine_holds(url, model, 21, tp_size=2)
    transport.close()


@pytest.mark.parametrize("architecture", ["qwen3_moe", "glm4_moe"])
def test_moe_routed_experts_are_the_models_routes(late, moe_dirs, architecture):
    """SGLang's native MoE path on a CPU (fused_topk_torch_native / biased grouped top-k,
    moe_forward_native) with --enable-return-routed-experts: log-probs equal transformers', and every
    sample's routes cover prompt + response - 1 positions and equal the model's own top-k at every
    position of every MoE layer (SGLang never writes its capture buffer on GLM's dense layer 0: zeros).
    (Without tests/sglang_cpu_shim the engine does not start: "RuntimeError: Found no NVIDIA driver"
    from torch.cuda.cudart() in SGLang's mem_cache/pool_host/common.py _cuda_host_register.)"""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.rollout.routed_experts import RoutedExpertsRecorder

    url = late[architecture]
    assert call(url, "/server_info", method="GET")["enable_return_routed_experts"] is True
    model = AutoModelForCausalLM.from_pretrained(str(moe_dirs[architecture]), dtype=torch.float32).eval()
    shape = (model.config.num_hidden_layers, model.config.num_experts_per_tok)
    reference = copy.deepcopy(model).double()
    reference.config._experts_implementation = "eager"  # transformers' grouped_mm takes no float64
    recorder = RoutedExpertsRecorder(model)
    rng = torch.Generator().manual_seed(3)
    batch = [GenerationRequest(tuple(torch.randint(3, 240, (length,), generator=rng).tolist()),
                               SamplingParams(n=2, max_new_tokens=8, ignore_eos=True), f"m{i}",
                               routed_experts_shape=shape) for i, length in enumerate((2, 9, 17))]
    samples = client([url]).generate(batch)
    assert len(samples) == 6
    for sample in samples:
        assert_logprobs_match(reference, sample)
        sequence = sample.prompt_ids + sample.response_ids
        assert sample.routed_experts.shape == (len(sequence) - 1, *shape)
        with torch.no_grad():
            model(torch.tensor([sequence]))
        expected = recorder.take(1, len(sequence))[0, :-1]
        sparse = (expected >= 0).all(dim=-1).all(dim=0)  # the MoE layers (the recorder gives -1 on dense ones)
        assert int(sparse.sum()) == (4 if architecture == "qwen3_moe" else 3)
        got = torch.from_numpy(sample.routed_experts)
        assert (got[:, ~sparse] == 0).all()
        assert torch.equal(got[:, sparse].sort(dim=-1).values, expected[:, sparse].sort(dim=-1).values), \
            sample.group_id


def _train_tiny(rank, world_size, overrides):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.loop import train

    cfg = load_config("tiny_cpu", overrides)
    train(cfg)
    with open(Path(cfg.logging.output_dir) / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


def test_trainer_replays_the_routes_the_engine_returns(late, moe_dirs, tmp_path):
    """Two GRPO steps with rollout.engine=sglang and actor.moe_routing_replay=true against the real
    GLM-4.5 engine (sigmoid router, group-limited top-k, a dense layer), disk sync: the MoE layers
    replay every recorded position (moe/replayed_frac > 0.9: all but the last token and padding),
    the engine serves step 2 with step 1's weights, and the trainer's log-probs equal the engine's."""
    from megatron_grpo.testing.distributed import run_distributed

    overrides = [f"model.path={moe_dirs['glm4_moe']}", "model.make_vocab_size_divisible_by=8",
                 "rollout.engine=sglang", f"rollout.sglang.urls=[{late['glm4_moe']}]",
                 "rollout.sglang.weight_sync=disk", "actor.moe_routing_replay=true", "trainer.total_steps=2",
                 "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "logging.console=false",
                 "logging.plot=false", "eval.interval=-1", "rollout.sglang.health_check_interval_s=0",
                 f"logging.output_dir={tmp_path / 'run'}"]
    records = run_distributed(_train_tiny, 1, (overrides,), timeout=300)[0]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["rollout/weight_version_min"] == record["step"] - 1
        assert record["actor/logprob_abs_diff_max"] < 1e-4, record["actor/logprob_abs_diff_max"]
        assert record["moe/replayed_frac"] > 0.9, record["moe/replayed_frac"]
