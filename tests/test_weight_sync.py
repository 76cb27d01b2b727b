"""Weight sync into the local engine and into a fake SGLang server (tp_size 2) through the
distributed, colocated-tensor and disk transports: the server's tensors equal the sent ones
bitwise and its log-probs equal the local engine's with the same weights."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from megatron_grpo.rollout.local import LocalEngine
from megatron_grpo.rollout.sglang.buckets import iter_buckets, tensor_bytes
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.engine import SGLangEngine
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy
from megatron_grpo.rollout.sglang.serialization import deserialize, flatten_bucket, serialize, unflatten_bucket
from megatron_grpo.rollout.sglang.weight_sync import (DiskTransport, DistributedTransport, EngineTarget,
                                                      TensorTransport)
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.testing.distributed import free_port
from tests.fake_sglang.fixtures import fake_server_settings, launch_fake_servers
from tests.fake_sglang.server import weights_digest
from tests.fake_sglang.tiny import char_tokenizer, save_tiny_model, tiny_model

pytestmark = pytest.mark.slow  # most tests start fake server processes
PARAMS = SamplingParams(n=2, max_new_tokens=10, seed=11)
PROMPTS = [(5, 9, 11), (40, 41, 42, 43, 44, 45, 46)]


def hf_stream(model):
    """What the exporter yields: HF names and full tensors (here from an HF model's state_dict)."""
    return ((name, tensor.clone()) for name, tensor in model.state_dict().items())


def requests():
    return [GenerationRequest(p, PARAMS, group_id=f"g{i}") for i, p in enumerate(PROMPTS)]


# ----- pure pieces --------------------------------------------------------------------------------
def test_buckets_are_bounded_ordered_and_complete():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 30, 5, 100, 1, 1, 60])]
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=40 * 4))
    assert [name for b in buckets for name, _ in b] == [name for name, _ in tensors]
    for bucket in buckets:
        assert len(bucket) == 1 or sum(tensor_bytes(t) for _, t in bucket) <= 160
    assert [len(b) for b in buckets] == [2, 1, 1, 2, 1]  # [10,30] [5] [100] [1,1] [60]


def test_flattened_bucket_roundtrip_mixed_dtypes():
    torch.manual_seed(0)
    bucket = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.randn(2, 2, 2).half())]
    payload = flatten_bucket(bucket, metadata_format="plain")
    assert payload["flattened_tensor"].dtype == torch.uint8
    assert [(m.start_idx, m.end_idx, m.numel) for m in payload["metadata"]] == [(0, 48, 48), (48, 58, 10), (58, 74, 16)]
    for (name, sent), (got_name, got) in zip(bucket, unflatten_bucket(deserialize(serialize(payload)))):
        assert name == got_name and got.dtype == sent.dtype and torch.equal(got, sent)


# ----- against the fake server --------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Fake servers started from model seed 0: "tp2" (tp_size 2), and engines "e1", "e2"
    (tp_size 1; the fake joins weight-update groups as one rank)."""
    model_dir = save_tiny_model(tmp_path_factory.mktemp("model"), seed=0, scale=3.0)
    settings = {"tp2": fake_server_settings(model_dir, tp_size=2), "e1": fake_server_settings(model_dir),
                "e2": fake_server_settings(model_dir)}
    launcher = launch_fake_servers(tmp_path_factory.mktemp("logs"), list(settings.values()))
    yield {name: s.url for name, s in settings.items()} | {"model_dir": model_dir,
                                                           "tmp": tmp_path_factory.mktemp("sync")}
    launcher.shutdown(grace_s=5)


def donor(seed):
    return tiny_model(seed=seed, scale=3.0)


def assert_server_has(url, model, version):
    client = SGLangClient([url], retry=RetryPolicy(max_attempts=1))
    digests = client.call(url, "/fake/weights_digest", method="GET")
    expected = {name: weights_digest(p.detach()) for name, p in model.named_parameters(remove_duplicate=False)}
    assert digests == expected  # bitwise, every parameter
    got = client.generate(requests())
    want = LocalEngine(model, char_tokenizer()).generate(requests())
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert {s.weight_version for s in got} == {version}
    assert client.call(url, "/model_info", method="GET")["weight_version"] == str(version)
    client.close()


def test_distributed_transport_two_engines(setup):
    urls = [setup["e1"], setup["e2"]]
    client = SGLangClient(urls)
    transport = DistributedTransport(client, [EngineTarget(u) for u in urls], "127.0.0.1", free_port(),
                                     group_name="test-dist", backend="gloo", bucket_bytes=64 * 1024, timeout_s=60)
    assert transport.world_size == 3  # trainer rank 0, engines at rank offsets 1 and 2
    engine = SGLangEngine(client, transport)
    transport.connect()
    model = donor(1)
    engine.update_weights(hf_stream(model), version=7)
    assert engine.last_sync.num_buckets > 3 and engine.last_sync.num_tensors == len(model.state_dict())
    assert engine.last_sync.num_bytes == sum(tensor_bytes(t) for t in model.state_dict().values())
    for url in urls:
        assert_server_has(url, model, 7)
    assert engine.health().weight_version == 7
    # a bad name fails with an error naming the server, without hanging the broadcast
    with pytest.raises(SGLangError, match=r"/update_weights_from_distributed.*unknown parameter name "
                                          r"'not.a.weight'"):
        engine.update_weights([("not.a.weight", torch.zeros(2))], version=8)
    transport.close()


def test_distributed_group_on_a_tp2_fake_is_refused_clearly(setup):
    client = SGLangClient([setup["tp2"]], retry=RetryPolicy(max_attempts=1))
    transport = DistributedTransport(client, [EngineTarget(setup["tp2"], tp_size=2)], "127.0.0.1", free_port(),
                                     group_name="test-refused", backend="gloo", timeout_s=5)
    assert transport.world_size == 3
    with pytest.raises(SGLangError, match=rf"{setup['tp2']}/init_weights_update_group"):
        transport.connect()


def test_one_group_per_pipeline_stage_in_parallel(setup):
    """Two stages push disjoint halves of the weights through their own groups at the same time."""
    url = setup["e1"]
    model = donor(2)
    names = list(model.state_dict())
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    base_port = free_port()
    client = SGLangClient([url])
    transports = [DistributedTransport.for_pipeline_stage(client, [EngineTarget(url)], "127.0.0.1", base_port, s,
                                                          backend="gloo", bucket_bytes=32 * 1024, timeout_s=60)
                  for s in range(2)]
    assert [t.group_name for t in transports] == ["megatron-grpo-pp0", "megatron-grpo-pp1"]
    assert [t.master_port for t in transports] == [base_port, base_port + 1]
    errors = []

    def stage(s):
        try:
            transports[s].connect()
            state = model.state_dict()
            transports[s].push(((n, state[n].clone()) for n in halves[s]), version=9)
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=stage, args=(s,)) for s in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    client.call(url, "/flush_cache", {})
    assert_server_has(url, model, 9)
    for transport in transports:
        transport.close()


def test_tensor_transport_cpu_shared_memory(setup):
    client = SGLangClient([setup["tp2"]])
    transport = TensorTransport(client, EngineTarget(setup["tp2"], tp_size=2), bucket_bytes=100 * 1024,
                                metadata_format="plain")
    engine = SGLangEngine(client, transport)
    engine.release_memory()  # colocated: the trainer ran; the update wakes the server in two stages
    model = donor(3)
    engine.update_weights(hf_stream(model), version=10)
    assert engine.last_sync.num_buckets > 1
    assert_server_has(setup["tp2"], model, 10)


def test_disk_transport(setup):
    urls = [setup["e1"], setup["e2"]]
    client = SGLangClient(urls)
    transport = DiskTransport(client, [EngineTarget(u) for u in urls], setup["tmp"], side_files_from=setup["model_dir"],
                              keep_last=1, max_shard_bytes=200 * 1024)
    engine = SGLangEngine(client, transport)
    for version, seed in ((11, 4), (12, 5)):
        model = donor(seed)
        engine.update_weights(hf_stream(model), version=version)
        for url in urls:
            assert_server_has(url, model, version)
    folders = sorted(p.name for p in setup["tmp"].iterdir())
    assert folders == ["weights_v12"]  # older versions pruned
    index = json.loads((setup["tmp"] / "weights_v12" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) and len(set(index["weight_map"].values())) > 1
    assert (setup["tmp"] / "weights_v12" / "config.json").is_file()


def test_update_aborts_running_generation_then_resumes(setup):
    """pause_generation(abort) ends an in-flight generate, flush_cache waits for it to drain, and
    continue_generation lets the next generate through with the new version."""
    client = SGLangClient([setup["tp2"]])
    gen_client = SGLangClient([setup["tp2"]])
    transport = TensorTransport(client, EngineTarget(setup["tp2"], tp_size=2), metadata_format="plain")
    engine = SGLangEngine(client, transport, generate_client=gen_client)
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=engine.generate(
        [GenerationRequest((5, 6), SamplingParams(max_new_tokens=100_000, ignore_eos=True, seed=1))])))
    runner.start()
    threading.Event().wait(1.5)
    model = donor(6)
    engine.update_weights(hf_stream(model), version=13)
    runner.join(timeout=60)
    assert result["out"][0].finish_reason == "abort"
    assert_server_has(setup["tp2"], model, 13)


def test_local_engine_receives_the_same_stream():
    """The embedded default: the same HF-named stream straight into the local engine."""
    engine = LocalEngine(tiny_model(seed=0, scale=3.0), char_tokenizer())
    model = donor(7)
    report = engine.load_weights(hf_stream(model), version=2)
    assert report.num_bytes == sum(tensor_bytes(t) for t in model.state_dict().values())
    for name, p in model.named_parameters():
        assert torch.equal(dict(engine.model.named_parameters())[name], p)
    want = LocalEngine(model, char_tokenizer()).generate(requests())
    assert [s.response_ids for s in engine.generate(requests())] == [s.response_ids for s in want]
