"""The SGLang client, weight transports, engine and verification against SGLang 0.5.23's own code:
the servers here run SGLang's HTTP app, TokenizerManager, DetokenizerManager, request classes,
sampler functions and scheduler-side weight-update code, with a CPU scheduler for the GPU part
(tests/sglang_harness). Each defect found by running against that code has a test here that
failed on the code before its fix (noted as "was:")."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from megatron_grpo.rollout.local import LocalEngine
from megatron_grpo.rollout.sglang.buckets import iter_buckets, tensor_bytes
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
from megatron_grpo.rollout.sglang.errors import (SGLangConnectionError, SGLangError, SGLangTimeoutError,
                                                 SGLangUnavailableError)
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, request_json
from megatron_grpo.errors import ConfigError
from megatron_grpo.rollout.sglang.launcher import (API_KEY_VARIABLE, RouterSettings, ServerSettings, router_command,
                                                  server_command)
from megatron_grpo.rollout.sglang.pool import EnginePool, EngineSlot
from megatron_grpo.rollout.sglang.protocol import generate_payloads
from megatron_grpo.rollout.sglang.verify import WeightSample, WeightVerificationError, verify_engines
from megatron_grpo.rollout.sglang.weight_sync import (DiskTransport, DistributedTransport, EngineTarget,
                                                      TensorTransport, update_weights)
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams, derive_sample_seed
from megatron_grpo.testing.distributed import free_port, free_server_port
from tests.sglang_harness.fixtures import (LONG_CONTEXT, launch_servers, save_long_context_model, server_settings,
                                           sglang_checksum, sglang_python)
from tests.tiny_hf import char_tokenizer, float64_logprobs, tiny_model

pytestmark = pytest.mark.slow  # starts SGLang test servers
FAST_RETRY = RetryPolicy(max_attempts=3, backoff_s=0.05)
NO_PROBE = EngineOptions(health_check_interval_s=0)
PROMPTS = [(5, 9, 11), (40, 41, 42, 43, 44, 45, 46), (7,) * 12]
LONG = LONG_CONTEXT  # the test model's context: long generations run until aborted


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
    """det: deterministic inference, tp 1; tp2: deterministic, tp 2 (two scheduler ranks);
    plain: default flags (seeds ignored), with an API key."""
    sglang_python()
    settings = {"det": server_settings(model_dir), "tp2": server_settings(model_dir, tp_size=2),
                "plain": server_settings(model_dir, deterministic=False, api_key="s3cret")}
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), list(settings.values()))
    yield {name: s.url for name, s in settings.items()}
    launcher.shutdown(grace_s=5)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same weights in HF transformers: the trainer-side recomputation of log-probs."""
    return tiny_model(seed=0, scale=3.0)


def recomputed_logprobs(model, sample, temperature: float) -> torch.Tensor:
    return float64_logprobs(model, sample.prompt_ids, sample.response_ids, temperature)


def fp32_logprob_tolerance(sample) -> float:
    """The engine decodes with a KV cache in fp32, the reference runs one full forward in float64
    on the same weights: a few fp32 ulps per layer of the 2-layer model, times the logit scale."""
    return 64 * torch.finfo(torch.float32).eps * max(1, len(sample.prompt_ids) + len(sample.response_ids))


def assert_engine_holds(url: str, model, version: int, tp_size: int = 1) -> None:
    """Every parameter of every TP rank is bitwise the model's, and samples carry `version`."""
    answer = request_json(url, "/weights_checker", {"action": "checksum"})
    expected = {name: sglang_checksum(p) for name, p in model.named_parameters()}
    assert len(answer["ranks"]) == tp_size
    for rank in answer["ranks"]:
        assert {k: v for k, v in rank["checksums"].items() if k in expected} == expected
    samples = SGLangClient([url], retry=FAST_RETRY).generate(requests(SamplingParams(max_new_tokens=6, seed=1))[:1])
    assert {s.weight_version for s in samples} == {version}
    assert request_json(url, "/model_info", method="GET")["weight_version"] == str(version)


def hf_stream(model):
    return ((name, tensor.clone()) for name, tensor in model.state_dict().items())


def test_generate_answers_parse_into_samples(servers):
    body = request_json(servers["det"], "/generate", {"input_ids": [5, 6, 7], "return_logprob": True,
                                                      "sampling_params": {"n": 3, "max_new_tokens": 5}})
    assert isinstance(body, list) and len(body) == 3  # SGLang's own n>1 fan-out
    for item in body:
        meta = item["meta_info"]
        assert len(item["output_ids"]) == 5 and meta["finish_reason"] == {"type": "length", "length": 5}
        assert [row[1] for row in meta["output_token_logprobs"]] == item["output_ids"]
        assert meta["weight_version"] == "default" and meta["completion_tokens"] == 5
    samples = SGLangClient([servers["det"]]).generate(requests(SamplingParams(n=2, max_new_tokens=5)))
    assert [(s.group_id, s.sample_index) for s in samples] == [(f"g{i}", j) for i in range(3) for j in range(2)]
    assert all(len(s.response_ids) == 5 and s.weight_version == 0 for s in samples)


@pytest.mark.parametrize("params", [SamplingParams(n=3, max_new_tokens=12, seed=5),
                                    SamplingParams(n=2, max_new_tokens=12, seed=6, temperature=0.7, top_k=30),
                                    SamplingParams(n=2, max_new_tokens=12, seed=8, temperature=1.3, top_p=0.8),
                                    SamplingParams(n=2, max_new_tokens=30, seed=7, stop=("a", "Q"),
                                                   stop_token_ids=tuple(range(100, 115)))])
def test_sampled_logprobs_equal_the_trainer_recomputation(servers, reference, params):
    """The engine's log-probs are log_softmax(logits / T) of the sampled tokens, before top-p/top-k,
    as the trainer computes them: the ratio == 1 invariant holds against SGLang's output format."""
    samples = SGLangClient([servers["det"], servers["tp2"]], retry=FAST_RETRY).generate(requests(params))
    assert len(samples) == len(PROMPTS) * params.n
    for sample in samples:
        want = recomputed_logprobs(reference, sample, params.temperature)
        got = torch.tensor(sample.logprobs, dtype=torch.float64)
        assert (got - want).abs().max() <= fp32_logprob_tolerance(sample), sample
        if sample.finish_reason == "stop":  # SGLang's own stop rules (Req.update_finish_state)
            text = char_tokenizer().decode(sample.response_ids)
            assert sample.response_ids[-1] in params.stop_token_ids or any(s in text for s in params.stop)
        else:
            assert sample.finish_reason == "length" and len(sample.response_ids) == params.max_new_tokens


def test_greedy_equals_the_local_engine(servers, reference):
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=10)
    got = SGLangClient([servers["det"]]).generate(requests(params))
    want = LocalEngine(reference, char_tokenizer()).generate(requests(params))
    assert [s.response_ids for s in got] == [s.response_ids for s in want]


def test_seeds_take_effect_only_with_deterministic_inference(servers):
    """was: seeds sent, but SGLang ignores them without --enable-deterministic-inference."""
    params = SamplingParams(n=3, max_new_tokens=12, seed=42)
    det = SGLangClient([servers["det"]])
    first, again = det.generate(requests(params)), det.generate(requests(params))
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    assert len({tuple(s.response_ids) for s in first[:3]}) == 3  # the n samples of a prompt differ
    plain = SGLangClient([servers["plain"]], api_key="s3cret")
    assert [s.response_ids for s in plain.generate(requests(params))] != \
        [s.response_ids for s in plain.generate(requests(params))]


def test_4xx_is_not_retried_and_names_the_url(servers):
    with pytest.raises(SGLangError, match=rf"{servers['plain']}/generate: HTTP 401") as info:
        SGLangClient([servers["plain"]], retry=FAST_RETRY).generate(requests(SamplingParams(max_new_tokens=2))[:1])
    assert info.value.status == 401


def test_sglang_refuses_unknown_sampling_keys_with_400(servers):
    with pytest.raises(SGLangError, match="HTTP 400") as info:
        request_json(servers["det"], "/generate", {"input_ids": [5], "sampling_params": {"top_k": 0}})
    assert info.value.status == 400


def test_timeout_gives_clear_error(servers):
    client = SGLangClient([servers["det"]], timeout_s=0.5, retry=FAST_RETRY)
    start = time.monotonic()
    with pytest.raises(SGLangTimeoutError, match=rf"POST {servers['det']}/generate: no answer within 0.5s"):
        client.generate(requests(SamplingParams(max_new_tokens=LONG - 100, ignore_eos=True))[:1])
    assert time.monotonic() - start < 2.5  # not retried
    request_json(servers["det"], "/abort_request", {"abort_all": True})


def test_abort_returns_abort_samples(servers):
    client = SGLangClient([servers["det"]], retry=FAST_RETRY)
    engine = SGLangEngine(client, DiskTransport(client, [EngineTarget(servers["det"])], "/nonexistent"),
                          options=NO_PROBE)
    threading.Timer(1.0, engine.abort).start()
    out = engine.generate(requests(SamplingParams(max_new_tokens=LONG - 100, ignore_eos=True, seed=1))[:2])
    assert {s.finish_reason for s in out} == {"abort"} and all(len(s.response_ids) < LONG - 100 for s in out)
    assert engine.generate(requests(SamplingParams(max_new_tokens=3))[:1])[0].finish_reason == "length"


def test_distributed_transport_opens_the_weight_update_session(servers):
    """was: /update_weights_from_distributed without /begin_weight_update: HTTP 400 from SGLang."""
    with pytest.raises(SGLangError, match="must run between begin_weight_update"):
        request_json(servers["det"], "/update_weights_from_distributed",
                     {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]})
    urls = [servers["det"], servers["tp2"]]
    client = SGLangClient(urls)
    targets = [EngineTarget(servers["det"]), EngineTarget(servers["tp2"], tp_size=2)]
    transport = DistributedTransport(client, targets, "127.0.0.1", 0, group_name="test-dist",
                                     backend="gloo", bucket_bytes=64 * 1024, timeout_s=60)
    assert transport.world_size == 4  # trainer rank 0, engine 1 at rank 1, engine 2's TP ranks at 2 and 3
    transport.connect()
    engine = SGLangEngine(client, transport, options=NO_PROBE)
    model = tiny_model(seed=1, scale=3.0)
    engine.update_weights(hf_stream(model), version=7)
    assert engine.last_sync.num_buckets > 3 and engine.last_sync.num_tensors == len(model.state_dict())
    # verified by checksums; SGLang's Qwen3 has no get_weights_by_name, so no tensor by value (as on a real
    # server; Llama's value check: tests/test_sglang_sampling_mask.py)
    assert engine.sync_metrics()["sync/verified"] == 1.0 and engine.sync_metrics()["sync/verified_tensors"] == 0
    assert_engine_holds(servers["det"], model, 7)
    assert_engine_holds(servers["tp2"], model, 7, tp_size=2)
    transport.close()


def test_one_group_per_pipeline_stage_in_parallel(servers):
    """Two stages push disjoint halves of the weights through their own groups at the same time."""
    url = servers["det"]
    model = tiny_model(seed=2, scale=3.0)
    names = list(model.state_dict())
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    client = SGLangClient([url])
    transports = [DistributedTransport.for_pipeline_stage(client, [EngineTarget(url)], "127.0.0.1", s,
                                                          backend="gloo", bucket_bytes=32 * 1024, timeout_s=60)
                  for s in range(2)]
    errors = []
    for transport in transports:  # (on a cluster each stage's rank connects from its own process)
        transport.connect()

    def stage(s):
        try:
            state = model.state_dict()
            transports[s].push(((n, state[n].clone()) for n in halves[s]), version=9)
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    request_json(url, "/begin_weight_update", {})
    threads = [threading.Thread(target=stage, args=(s,)) for s in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    request_json(url, "/end_weight_update", {})
    assert not errors, errors
    assert_engine_holds(url, model, 9)
    for transport in transports:
        transport.close()


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


def test_tensor_payload_passes_sglangs_safe_unpickler_both_ways(servers, model_dir, tmp_path):
    """was: this package's own metadata class in the payload: SGLang's SafeUnpickler refuses it and
    the scheduler crashes. Now: plain (name, tensor) lists where sglang does not import (here), and
    SGLang's own FlattenedTensorMetadata where it does (a client process in the SGLang venv)."""
    url = servers["det"]
    client = SGLangClient([url])
    model = tiny_model(seed=4, scale=3.0)
    update_weights(client, TensorTransport(client, [EngineTarget(url)], flattened=False), hf_stream(model), 11)
    assert_engine_holds(url, model, 11)
    donor = tmp_path / "donor"
    tiny_model(seed=5, scale=3.0).save_pretrained(donor)
    script = ("import sys, torch; from tests.sglang_harness import torchvision_stub; torchvision_stub.install()\n"
              "from transformers import AutoModelForCausalLM\n"
              "from megatron_grpo.rollout.sglang.client import SGLangClient\n"
              "from megatron_grpo.rollout.sglang.weight_sync import TensorTransport, EngineTarget, update_weights\n"
              "model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)\n"
              "client = SGLangClient([sys.argv[1]])\n"
              "transport = TensorTransport(client, [EngineTarget(sys.argv[1])], bucket_bytes=100 * 1024)\n"
              "update_weights(client, transport, ((n, t.clone()) for n, t in model.state_dict().items()), 12)\n")
    log = tmp_path / "client.log"
    with open(log, "w") as out:  # a file, not a pipe: torch's shm manager daemon inherits the handles
        result = subprocess.run([sglang_python(), "-c", script, url, str(donor)], stdout=out, stderr=subprocess.STDOUT,
                                timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, log.read_text()[-3000:]
    assert_engine_holds(url, tiny_model(seed=5, scale=3.0), 12)


def test_disk_transport(servers, model_dir, tmp_path):
    urls = [servers["det"], servers["tp2"]]
    client = SGLangClient(urls)
    transport = DiskTransport(client, [EngineTarget(urls[0]), EngineTarget(urls[1], tp_size=2)], tmp_path,
                              side_files_from=model_dir, keep_last=1, max_shard_bytes=200 * 1024)
    engine = SGLangEngine(client, transport, options=NO_PROBE)
    for version, seed in ((13, 6), (14, 7)):
        model = tiny_model(seed=seed, scale=3.0)
        engine.update_weights(hf_stream(model), version=version)
        assert_engine_holds(urls[0], model, version)
        assert_engine_holds(urls[1], model, version, tp_size=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights_v14"]  # older versions pruned
    index = json.loads((tmp_path / "weights_v14" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) and len(set(index["weight_map"].values())) > 1


def test_update_aborts_running_generation_then_resumes(servers):
    """pause_generation(abort) ends an in-flight generate, flush_cache waits for it to drain, and
    continue_generation lets the next generate through with the new version."""
    url = servers["det"]
    client = SGLangClient([url])
    engine = SGLangEngine(client, TensorTransport(client, [EngineTarget(url)]), generate_client=SGLangClient([url]),
                          options=NO_PROBE)
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=engine.generate(
        [GenerationRequest((5, 6), SamplingParams(max_new_tokens=LONG - 100, ignore_eos=True, seed=1))])))
    runner.start()
    time.sleep(1.5)
    model = tiny_model(seed=8, scale=3.0)
    engine.update_weights(hf_stream(model), version=15)
    runner.join(timeout=60)
    assert result["out"][0].finish_reason == "abort"
    assert_engine_holds(url, model, 15)


def test_async_generate_resubmits_groups_a_weight_update_aborted(servers):
    """With resubmit_aborted (asynchronous GRPO), a group aborted by a weight update mid-generation
    is sent again: SGLang holds it until generation continues, so it comes back whole, from the new
    weights; a group that finished before the update keeps its old version. Two requests of one
    group (an episode's turns share none, but a caller may) each get their own continuation back."""
    url = servers["det"]
    client = SGLangClient([url])
    engine = SGLangEngine(client, TensorTransport(client, [EngineTarget(url)]), generate_client=SGLangClient([url]),
                          options=dataclasses.replace(NO_PROBE, resubmit_aborted=True))
    # long enough to be still in flight at the update on an idle machine (1500 tokens were not), short
    # enough to generate twice
    long = SamplingParams(max_new_tokens=5000, ignore_eos=True, seed=1)
    batch = [GenerationRequest((5, 6), long, group_id="long"),
             GenerationRequest((5, 6), SamplingParams(max_new_tokens=3, seed=1), group_id="short"),
             GenerationRequest((7, 8, 9), long, group_id="long")]
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=engine.generate(batch)))
    runner.start()
    time.sleep(1.5)
    model = tiny_model(seed=9, scale=3.0)
    engine.update_weights(hf_stream(model), version=16)
    runner.join(timeout=300)
    long_sample, short_sample, other_long = result["out"]
    for sample, prompt in ((long_sample, [5, 6]), (other_long, [7, 8, 9])):
        assert (sample.finish_reason, len(sample.response_ids), sample.prompt_ids) == ("length", 5000, prompt)
        assert sample.weight_version == 16
    assert engine.resubmitted_groups == 1
    assert short_sample.finish_reason == "length" and short_sample.weight_version != 16
    assert_engine_holds(url, model, 16)


def test_verification_names_engines_that_disagree(servers):
    """An engine that missed an update disagrees with the others on /weights_checker checksums. Qwen3
    in SGLang has no get_weights_by_name (HTTP 400), so the value check is reported unavailable and
    the checksums are what catch it (values on Llama: tests/test_sglang_sampling_mask.py)."""
    client = SGLangClient([servers["det"], servers["plain"]], api_key="s3cret")
    with pytest.raises(SGLangError, match=r"HTTP 400: .*Get parameter by name failed") as unavailable:
        client.call(servers["det"], "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 2})
    assert unavailable.value.status == 400
    model = tiny_model(seed=10, scale=3.0)
    sample = WeightSample()
    update_weights(client, TensorTransport(client, [EngineTarget(servers["det"])]), sample.tap(hf_stream(model)), 17)
    assert verify_engines(client, [EngineTarget(servers["det"])], sample).value_checked == 0
    both = [EngineTarget(servers["det"]), EngineTarget(servers["plain"])]
    with pytest.raises(WeightVerificationError, match=rf"engines {servers['det']} and {servers['plain']} disagree"):
        verify_engines(client, both, sample)


def test_pool_takes_a_dead_engine_out_and_stops_below_min_engines(servers):
    dead = f"http://127.0.0.1:{free_port()}"
    client = SGLangClient([servers["det"], dead], retry=FAST_RETRY)
    pool = EnginePool([EngineSlot(EngineTarget(servers["det"])), EngineSlot(EngineTarget(dead))], min_engines=1,
                      probe_timeout_s=10, on_change=lambda alive: client.set_urls([t.url for t in alive]))
    assert pool.probe() == [dead]
    assert client.urls == [servers["det"]] and not pool.recover()
    strict = EnginePool([EngineSlot(EngineTarget(servers["det"])), EngineSlot(EngineTarget(dead))], min_engines=2,
                        probe_timeout_s=10)
    with pytest.raises(SGLangUnavailableError, match=rf"only 1 of 2 SGLang engines are alive.*{dead}"):
        strict.recover()
    client.close()


def test_check_sglang_tool_passes(servers, model_dir, tmp_path):
    """tools/check_sglang.py end to end, every transport (last: it changes the engine's weights)."""
    log = tmp_path / "check_sglang.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-u", "tools/check_sglang.py", servers["plain"], "--model-path",
                                    str(model_dir), "--api-key", "s3cret", "--tolerance", "1e-5", "--verbose"],
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
    assert "tensors verified" in output
