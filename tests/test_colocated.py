"""Colocated weight sync (rollout.sglang.weight_sync=tensor) into SGLang's own server code
(tests/sglang_harness): the placement (which trainer rank feeds which engine TP rank), and on 4
gloo ranks at TP2 x PP2 two engines of tp_size 2, each engine TP rank fed by the trainer rank on its
(emulated) GPU through SGLang's own /update_weights_from_tensor and MultiprocessingSerializer: the
engines hold bitwise what the rank-0 route exports; a feeder that sends other tensors shows up in
exactly its engine rank, and the sync's verification names the engine."""
import pytest

from megatron_grpo.errors import ConfigError
from megatron_grpo.rollout.sglang.colocated import RankPlace, colocated_seats


def _places(nodes: int, per_node: int) -> list[RankPlace]:
    return [RankPlace(f"node{r // per_node}", r % per_node, per_node) for r in range(nodes * per_node)]


def test_placement_follows_the_launchers_gpu_order():
    # 2 nodes x 4 GPUs, engines of tp 2: engine k on node k // 2, GPUs (k % 2) * 2 + j
    seats = colocated_seats(_places(2, 4), num_engines=4, tp_size=2)
    assert {r: (s.engine, s.engine_rank, s.feeders, s.gpu) for r, s in seats.items()} == {
        0: (0, 0, (0, 1), 0), 1: (0, 1, (0, 1), 1), 2: (1, 0, (2, 3), 2), 3: (1, 1, (2, 3), 3),
        4: (2, 0, (4, 5), 0), 5: (2, 1, (4, 5), 1), 6: (3, 0, (6, 7), 2), 7: (3, 1, (6, 7), 3)}
    # fewer engines than GPUs: the GPUs after the last engine host none
    assert sorted(colocated_seats(_places(1, 8), num_engines=3, tp_size=1)) == [0, 1, 2]


def test_placement_orders_nodes_by_their_lowest_rank():
    places = [RankPlace("b", 0, 2), RankPlace("b", 1, 2), RankPlace("a", 1, 2), RankPlace("a", 0, 2)]
    seats = colocated_seats(places, num_engines=2, tp_size=2)
    assert seats[0].feeders == (0, 1) and seats[2].feeders == (3, 2)  # engine 1 on node "a", GPUs 0, 1


@pytest.mark.parametrize("places, engines, tp, message", [
    (_places(1, 4), 5, 1, "5 colocated engines x tp_size 1 need 5 GPUs; the trainer has 4 per node on 1 node"),
    (_places(1, 6), 1, 4, "tp_size=4 does not divide the 6 trainer GPUs of a node"),
    ([RankPlace("a", 0, 1), RankPlace("b", 0, 2), RankPlace("b", 1, 2)], 1, 1, "same number of trainer ranks"),
])
def test_placement_refuses_what_does_not_fit(places, engines, tp, message):
    with pytest.raises(ConfigError, match=message):
        colocated_seats(places, engines, tp)


def _sync_colocated(rank, world_size, urls, model_dir, shift_rank):
    """TP2 x PP2 policy from model_dir; two colocated engines of tp 2 fed through the trainer's
    colocated route (trainer/sync/stage_sync.py). `shift_rank` (or None) sends its tensors + 1."""
    import torch.distributed as dist

    from megatron_grpo.config import load_config
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.errors import RolloutFailure
    from megatron_grpo.launch import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
    from megatron_grpo.rollout.sglang.weight_sync import EngineTarget, TensorTransport
    from megatron_grpo.trainer.sync.stage_sync import connect_stage_sync
    from megatron_grpo.trainer.sync.weight_sync import sync_weights
    from tests.sglang_harness.fixtures import engine_checksums, sglang_checksums

    initialize_model_parallel(ParallelLayout(tensor=2, pipeline=2), seed=3)
    cfg = ModelArchitecture.from_hf(model_dir, tensor_parallel=2, vocab_multiple=8)
    chunks = build_model(cfg, ParallelLayout(tensor=2, pipeline=2))
    load_hf_weights(chunks, cfg, model_dir)
    recipe = load_config("tiny_cpu", ["rollout.engine=sglang", "rollout.sglang.weight_sync=tensor",
                                      "rollout.sglang.tp_size=2", f"rollout.sglang.urls=[{','.join(urls)}]"])
    engine = None
    if rank == 0:  # as trainer/engines/sglang_setup.py builds it for weight_sync=tensor
        client = SGLangClient(urls)
        engine = SGLangEngine(client, TensorTransport(client, [EngineTarget(u, 2) for u in urls]),
                              options=EngineOptions(health_check_interval_s=0))
    stage_sync = connect_stage_sync(recipe, type("Rank0", (), {"engine": engine}) if rank == 0 else None)
    if rank == shift_rank:
        push = stage_sync.sink.push
        stage_sync.sink.push = lambda tensors, version: push(((n, t + 1) for n, t in tensors), version)
    run = type("Run", (), {"stage_sync": stage_sync, "engine": engine, "policy": chunks, "model_config": cfg})
    failure, metrics = None, {}
    try:
        metrics = sync_weights(run, version=4, attempts=1)
    except RolloutFailure as exc:
        failure = str(exc)
    role = stage_sync.role.label
    tensors = dict(gather_hf_weights_on_rank0(chunks, cfg))
    # what each engine rank holds of them (SGLang's fused TP shards), plain and + 1
    reference = (sglang_checksums(model_dir, tensors, 2), sglang_checksums(model_dir, {n: t + 1 for n, t in
                                                                                       tensors.items()}, 2))
    stage_sync.close()
    roles = [None] * world_size
    dist.all_gather_object(roles, role)
    if rank != 0:
        return None
    engine.close()
    return {"failure": failure, "metrics": metrics, "roles": roles, "reference": reference,
            "engines": [engine_checksums(url) for url in urls]}


@pytest.fixture(scope="module")
def tp2_engines(tmp_path_factory):
    """Two harness engines of tp_size 2 on emulated GPUs 0-1 and 2-3, serving another model than
    the policy (so that only a sync can make them hold the policy)."""
    from tests.sglang_harness.fixtures import launch_servers, server_settings
    from tests.tiny_hf import save_tiny_model

    root = tmp_path_factory.mktemp("colocated")
    policy = save_tiny_model(root / "policy", seed=1, scale=3.0)
    other = save_tiny_model(root / "other", seed=2, scale=3.0)
    launcher = launch_servers(root / "logs", [server_settings(other, tp_size=2, extra_args=("--base-gpu-id", str(g)))
                                              for g in (0, 2)])
    yield policy, [server.url for server in launcher.servers]
    launcher.shutdown(grace_s=2)


@pytest.mark.slow
def test_each_engine_rank_is_fed_by_the_trainer_rank_on_its_gpu(tp2_engines):
    from megatron_grpo.testing.distributed import run_distributed

    policy, urls = tp2_engines
    out = run_distributed(_sync_colocated, 4, (urls, str(policy), None), timeout=300)[0]
    assert out["failure"] is None, out["failure"]
    assert out["roles"] == [f"engine {e} rank {j} ({urls[e]})" for e in (0, 1) for j in (0, 1)]
    assert out["metrics"]["sync/verified"] == 1.0 and out["metrics"]["sync/stages"] == 4.0  # every rank fed
    plain, _ = out["reference"]
    for engine in out["engines"]:
        assert engine == plain  # both TP ranks of both engines: bitwise the rank-0 route's tensors


@pytest.mark.slow
def test_a_wrong_feeder_shows_in_its_engine_rank_and_fails_the_sync(tp2_engines):
    """Rank 3 (engine 1, TP rank 1) sends its tensors + 1: only that engine rank holds them, and
    the first sync's verification stops the run naming engine 1."""
    from megatron_grpo.testing.distributed import run_distributed

    policy, urls = tp2_engines
    out = run_distributed(_sync_colocated, 4, (urls, str(policy), 3), timeout=300)[0]
    assert out["failure"] is not None and urls[1] in out["failure"] and "disagree" in out["failure"]
    plain, shifted = out["reference"]
    assert out["engines"][0] == plain
    assert out["engines"][1] == [plain[0], shifted[1]]
