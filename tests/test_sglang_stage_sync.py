"""Weight sync per pipeline stage into SGLang's own server code (tests/sglang_harness): at PP=2 on
2 gloo ranks each stage's sender pushes its own layers through its own weight-update group
(megatron-grpo-pp<stage>) into one engine, inside ONE begin/end session; the engine then holds
bitwise what the rank-0 route (gather_hf_weights_on_rank0) and the policy's HF files hold. A
stage whose push the engine refuses fails the sync on every rank (no hang), and the engine keeps
serving. With two engines whose requests arrive in opposite stage orders the stages still form
their groups and push (in turn), where at once they deadlocked."""
import http.server
import threading
import time
import urllib.error
import urllib.request

import pytest

from megatron_grpo.testing.distributed import run_distributed
from tests.sglang_harness.fixtures import launch_servers, server_settings

pytestmark = pytest.mark.slow  # starts an SGLang test server


def _sync_into_sglang(rank, world_size, url, model_dir, break_stage):
    import torch.distributed as dist

    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.convert.stage_export import StageRole
    from megatron_grpo.errors import RolloutFailure
    from megatron_grpo.launch import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
    from megatron_grpo.rollout.sglang.http_json import request_json
    from megatron_grpo.rollout.sglang.weight_sync import DistributedTransport, EngineTarget
    from megatron_grpo.launch.collectives import all_gather_objects as all_gather
    from megatron_grpo.trainer.sync.stage_sync import StageSync
    from megatron_grpo.trainer.sync.weight_sync import sync_weights
    from tests.sglang_harness.fixtures import sglang_checksum, sglang_checksums

    initialize_model_parallel(ParallelLayout(tensor=1, pipeline=2), seed=3)
    cfg = ModelArchitecture.from_hf(model_dir, tensor_parallel=1, vocab_multiple=8)
    chunks = build_model(cfg)
    load_hf_weights(chunks, cfg, model_dir)

    engine = None
    if rank == 0:  # as trainer/engines/sglang_setup.py builds it for weight_sync=distributed
        client = SGLangClient([url])
        transport = DistributedTransport(client, [EngineTarget(url)], "127.0.0.1", 0, backend="gloo",
                                         bucket_bytes=2**16, timeout_s=60)
        transport.connect()
        engine = SGLangEngine(client, transport, options=EngineOptions(health_check_interval_s=0))
    endpoint = all_gather(engine.stage_endpoint() if rank == 0 else None)[0]
    role = StageRole.current()
    sink = endpoint.open(role, bucket_bytes=2**16) if role.sends else None
    if sink is not None and role.stage == break_stage:  # a tensor the engine cannot load: its loader refuses
        push = sink.push
        sink.push = lambda tensors, version: push(((n, t[:-1] if n.endswith("layers.1.input_layernorm.weight")
                                                    else t) for n, t in tensors), version)
    stage_sync = StageSync(role=role, sink=sink, in_turn=endpoint.push_in_turn)
    run = type("Run", (), {"stage_sync": stage_sync, "engine": engine, "policy": chunks, "model_config": cfg})
    failure, metrics = None, {}
    try:
        metrics = sync_weights(run, version=5)
    except RolloutFailure as exc:
        failure = str(exc)
    roles = all_gather((dist.get_rank(), role))
    tensors = dict(gather_hf_weights_on_rank0(chunks, cfg))  # the rank-0 route
    reference = {n: sglang_checksum(t) for n, t in tensors.items()}
    held = sglang_checksums(model_dir, tensors)[0]  # what the engine holds of them (SGLang's fused parameters)
    stage_sync.close()
    if rank != 0:
        return {"failure": failure}
    checksums = request_json(url, "/weights_checker", {"action": "checksum"})["ranks"][0]["checksums"]
    version = request_json(url, "/model_info", method="GET")["weight_version"]
    serves = engine.health()
    engine.close()
    return {"failure": failure, "metrics": metrics, "roles": roles, "reference": reference, "held": held,
            "checksums": checksums,
            "version": version, "engine_version": engine.weight_version, "healthy": bool(serves),
            "health": serves.detail}


@pytest.fixture(scope="module")
def policy_dirs(tmp_path_factory):
    from tests.tiny_hf import save_tiny_model

    root = tmp_path_factory.mktemp("stage_sync")
    return save_tiny_model(root / "policy", seed=1, scale=3.0), save_tiny_model(root / "other", seed=2, scale=3.0)


@pytest.fixture(scope="module")
def servers(policy_dirs, tmp_path_factory):
    """Two engines serving the other weights (seed 2), started at once."""
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), [server_settings(policy_dirs[1]) for _ in range(2)])
    yield [server.url for server in launcher.servers]
    launcher.shutdown(grace_s=2)


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def _hf_checksums(model_dir):
    from safetensors.torch import load_file

    from tests.sglang_harness.fixtures import sglang_checksum

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return {name: sglang_checksum(tensor) for name, tensor in tensors.items()}


def test_each_stage_pushes_its_layers_into_sglang(server, policy_dirs):
    """The engine starts from other weights (seed 2): only the two stages' pushes make it the policy."""
    result = run_distributed(_sync_into_sglang, world_size=2, timeout=300,
                             args=(server, str(policy_dirs[0]), -1))[0]
    assert result["failure"] is None
    senders = sorted(role.stage for _, role in result["roles"] if role.sends)
    assert senders == [0, 1]  # exactly one sender per stage
    assert not result["metrics"].get("sync/retries") and result["metrics"]["sync/stages"] == 2
    # the first sync is verified: consistency (SGLang's Qwen3 has no get_weights_by_name: no values)
    assert result["metrics"]["sync/verified"] == 1.0 and result["metrics"]["sync/verified_tensors"] == 0
    reference, engine = result["reference"], result["checksums"]
    assert reference == {n: c for n, c in _hf_checksums(policy_dirs[0]).items() if n in reference}
    assert engine == result["held"]  # bitwise, every tensor of both stages
    assert result["version"] == "5"


def test_a_failing_stage_push_fails_the_sync_on_every_rank(server, policy_dirs):
    results = run_distributed(_sync_into_sglang, world_size=2, timeout=300,
                              args=(server, str(policy_dirs[0]), 1))
    failures = [r["failure"] for r in results]
    assert all(f and "failed 2 times" in f and "stage 1" in f for f in failures), failures
    # Not taken as a version (SGLang itself stamps each bucket it loaded: stage 0's were), and the
    # session was closed and generation continued: the engine still serves.
    assert results[0]["engine_version"] == 0 and results[0]["healthy"], results[0]["health"]


class _DelayingHop:
    """An HTTP hop in front of one engine that passes every request on, holding
    /init_weights_update_group of one group for `delay_s` first: the network delivering the two
    stages' requests to this engine in the other order."""

    def __init__(self, engine_url: str, held_group: str, delay_s: float):
        hop = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def _forward(self, body):
                if self.path == "/init_weights_update_group" and held_group.encode() in body:
                    time.sleep(delay_s)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                request = urllib.request.Request(engine_url + self.path, data=body, headers=headers,
                                                 method=self.command)
                try:
                    with urllib.request.urlopen(request, timeout=120) as answer:
                        status, payload = answer.status, answer.read()
                except urllib.error.HTTPError as error:
                    status, payload = error.code, error.read()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=hop.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _sync_two_engines_per_stage(rank, world_size, urls, hop_urls, model_dir):
    """The trainer's own per-stage path (connect_stage_sync, sync_weights) at PP=2 into two engines;
    the stage senders reach them through the hops."""
    import dataclasses

    from megatron_grpo.config import load_config
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.launch import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
    from megatron_grpo.rollout.sglang.weight_sync import DistributedTransport, EngineTarget
    from megatron_grpo.trainer.sync.stage_sync import connect_stage_sync
    from megatron_grpo.trainer.sync.weight_sync import sync_weights
    from tests.sglang_harness.fixtures import engine_checksums, sglang_checksums

    initialize_model_parallel(ParallelLayout(tensor=1, pipeline=2), seed=3)
    cfg = ModelArchitecture.from_hf(model_dir, tensor_parallel=1, vocab_multiple=8)
    chunks = build_model(cfg)
    load_hf_weights(chunks, cfg, model_dir)
    recipe = load_config("tiny_cpu", ["rollout.engine=sglang", "rollout.sglang.weight_sync=distributed",
                                      "parallel.pipeline=2", f"rollout.sglang.urls=[{','.join(urls)}]"])
    engine = None
    if rank == 0:  # as trainer/engines/sglang_setup.py builds it, the groups' timeout short
        client = SGLangClient(urls)
        transport = DistributedTransport(client, [EngineTarget(u) for u in urls], "127.0.0.1", 0, backend="gloo",
                                         bucket_bytes=2**16, timeout_s=20)
        transport.connect()
        engine = SGLangEngine(client, transport, options=EngineOptions(health_check_interval_s=0))
        stage_endpoint = engine.stage_endpoint
        engine.stage_endpoint = lambda: dataclasses.replace(
            stage_endpoint(), targets=tuple(EngineTarget(u) for u in hop_urls))
    stage_sync = connect_stage_sync(recipe, type("Rank0", (), {"engine": engine}) if rank == 0 else None)
    run = type("Run", (), {"stage_sync": stage_sync, "engine": engine, "policy": chunks, "model_config": cfg})
    metrics = sync_weights(run, version=6, attempts=1)
    reference = sglang_checksums(model_dir, gather_hf_weights_on_rank0(chunks, cfg))[0]  # as the engines hold it
    stage_sync.close()
    if rank != 0:
        return None
    engine.close()
    return {"metrics": metrics, "reference": reference, "engines": [engine_checksums(url)[0] for url in urls]}


def test_two_engines_get_the_stages_requests_in_opposite_orders(servers, policy_dirs):
    """Engine 0 receives stage 0's group request 2 s before stage 1's, engine 1 the reverse. Opened
    at once, each engine's scheduler joined the group the other had not (and waited there); in turn,
    both stages form their groups and every tensor arrives bitwise in both engines."""
    hops = [_DelayingHop(url, f"megatron-grpo-pp{1 - k}", delay_s=2.0) for k, url in enumerate(servers)]
    try:
        result = run_distributed(_sync_two_engines_per_stage, world_size=2, timeout=120,
                                 args=(servers, [h.url for h in hops], str(policy_dirs[0])))[0]
    finally:
        for hop in hops:
            hop.close()
    assert result["metrics"]["sync/stages"] == 2
    reference = result["reference"]
    for engine in result["engines"]:
        assert engine == reference
