"""Weight sync per pipeline stage into the local engine's own process (trainer/sync/stage_sync.py,
convert/stage_export.py): at PP=2, TP2xPP2 and DP2xPP2 exactly one rank per stage sends (TP rank 0
of the first data-parallel replica), and the engine then computes exactly what an engine given the
rank-0 export (gather_hf_weights_on_rank0, the conversion tool's tensors) computes."""
import pytest

from megatron_grpo.testing.distributed import run_distributed


def _sync_per_stage(rank, world_size, layout, model_dir, other_dir):
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.convert.stage_export import StageRole
    from megatron_grpo.launch import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.rollout.engine_process import EngineSpec, ProcessEngine
    from megatron_grpo.rollout.local import LocalEngine
    from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
    from megatron_grpo.launch.collectives import all_gather_objects as all_gather
    from megatron_grpo.trainer.sync.stage_sync import StageSync
    from megatron_grpo.trainer.sync.weight_sync import sync_weights

    tp, pp = layout
    initialize_model_parallel(ParallelLayout(tensor=tp, pipeline=pp), seed=3)
    cfg = ModelArchitecture.from_hf(model_dir, tensor_parallel=tp, vocab_multiple=8)
    chunks = build_model(cfg)
    load_hf_weights(chunks, cfg, model_dir)

    # The engine starts from other weights; only the sync can make it compute like the policy.
    engine = ProcessEngine(EngineSpec(model_dir=other_dir, threads=1)) if rank == 0 else None
    endpoint = all_gather(engine.stage_endpoint() if rank == 0 else None)[0]
    role = StageRole.current()
    stage_sync = StageSync(role=role, sink=endpoint.open(role, bucket_bytes=2**16) if role.sends else None)
    run = SimpleNamespace(stage_sync=stage_sync, engine=engine, policy=chunks, model_config=cfg)
    metrics = sync_weights(run, version=4)
    roles = all_gather((dist.get_rank(), role))

    reference = LocalEngine.from_pretrained(other_dir) if rank == 0 else None
    tensors = gather_hf_weights_on_rank0(chunks, cfg)
    if rank == 0:
        reference.update_weights(tensors, version=4)
    for _ in tensors:
        pass
    stage_sync.close()
    if rank != 0:
        return None
    requests = [GenerationRequest(prompt_ids=(5, 17, 42 + i, 3), sampling=SamplingParams(n=2, max_new_tokens=6, seed=i),
                                  group_id=str(i)) for i in range(3)]
    try:
        got = engine.generate(requests)
        version = engine.weight_version
    finally:
        engine.close()
    want = reference.generate(requests)
    torch.set_num_threads(1)
    return {"metrics": metrics, "roles": roles, "version": version, "samples_versions": [s.weight_version for s in got],
            "got": [(s.response_ids, s.logprobs) for s in got], "want": [(s.response_ids, s.logprobs) for s in want]}


@pytest.mark.slow
@pytest.mark.parametrize("layout, world_size", [((1, 2), 2), ((2, 2), 4), ((1, 2), 4)],
                         ids=["pp2", "tp2-pp2", "dp2-pp2"])
def test_each_stage_streams_its_own_layers_into_the_engine_process(tmp_path, layout, world_size):
    from tests.tiny_hf import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "policy", seed=1, scale=3.0)
    other_dir = save_tiny_model(tmp_path / "other", seed=2, scale=3.0)
    result = run_distributed(_sync_per_stage, world_size=world_size, timeout=240,
                             args=(layout, str(model_dir), str(other_dir)))[0]
    tp, pp = layout
    senders = [(rank, role) for rank, role in result["roles"] if role.sends]
    assert sorted(role.stage for _, role in senders) == list(range(pp))  # one sender per stage
    exporters = [role for _, role in result["roles"] if role.exports]
    assert len(exporters) == tp * pp  # the first DP replica only: its TP ranks take part in the gathers
    assert result["metrics"]["sync/stages"] == pp
    assert result["version"] == 4 and set(result["samples_versions"]) == {4}
    assert result["got"] == result["want"]  # same tokens, same fp32 log-probs, bit for bit
