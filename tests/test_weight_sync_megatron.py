"""Weight sync from a sharded Megatron policy (TP=2 x PP=2, world 4) into the local rollout engine
and into SGLang test servers (SGLang's own HTTP app and weight-update code; distributed and disk
transports): every engine ends up with exactly the HF tensors of the conversion tool (bitwise, by
SGLang's /weights_checker checksums), and the local engine computes the trainer's log-probs."""
import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed
from tests.sglang_harness.fixtures import launch_servers, server_settings


def _push_to_servers(chunks, cfg, urls, sync_dir):
    """Rank 0 pushes the gathered policy to server 0 (distributed) and 1 (disk); every rank takes
    part in the gathers. Returns the servers' per-parameter checksums (SGLang's) on rank 0."""
    import torch.distributed as dist

    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.sglang.weight_sync import (DiskTransport, DistributedTransport, EngineTarget,
                                                          update_weights)

    digests = []
    for index, url in enumerate(urls):
        tensors = gather_hf_weights_on_rank0(chunks, cfg)
        if dist.get_rank() == 0:
            client = SGLangClient([url])
            if index == 0:
                transport = DistributedTransport(client, [EngineTarget(url)], "127.0.0.1", 0, backend="gloo")
                transport.connect()
            else:
                transport = DiskTransport(client, [EngineTarget(url)], sync_dir)
            update_weights(client, transport, tensors, version=5)
            transport.close()
            answer = client.call(url, "/weights_checker", {"action": "checksum"})
            digests.append(answer["ranks"][0]["checksums"])
            client.close()
        for _ in tensors:
            pass
    return digests


def _sync_and_score(rank, world_size, hf_dir, other_dir, urls=(), sync_dir=None):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.launch import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.rollout.local import LocalEngine
    from megatron_grpo.trainer.batches.batching import TrainSample, collate
    from megatron_grpo.trainer.batches.micro_batches import pad_to_common_shape
    from megatron_grpo.trainer.step.train_step import compute_logprobs

    initialize_model_parallel(ParallelLayout(tensor=2, pipeline=2), seed=3)
    cfg = ModelArchitecture.from_hf(hf_dir, tensor_parallel=2, vocab_multiple=8)
    chunks = build_model(cfg)
    load_hf_weights(chunks, cfg, hf_dir)

    # The engine starts from other weights; only the sync can make it equal to the policy.
    engine = LocalEngine.from_pretrained(other_dir) if rank == 0 else None
    tensors = gather_hf_weights_on_rank0(chunks, cfg)
    if rank == 0:
        engine.update_weights(tensors, version=7)
    for _ in tensors:
        pass

    prompt, response = [5, 17, 42, 3], [99, 7, 123, 8, 64, 2]
    samples = [TrainSample(prompt_ids=prompt, response_ids=response, advantage=0.0)]
    micro_batches = pad_to_common_shape([collate(samples, [0])])
    trainer_logp = compute_logprobs(chunks, micro_batches, temperature=0.7, vocab_size=cfg.vocab_size,
                                    device=torch.device("cpu"))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, None if trainer_logp is None else
                           trainer_logp[0][micro_batches[0].loss_mask].tolist())
    trainer_values = next(v for v in gathered if v is not None)
    server_digests = _push_to_servers(chunks, cfg, urls, sync_dir) if urls else []
    if rank != 0:
        return None
    expected = load_file(f"{hf_dir}/model.safetensors")
    state = engine.model.state_dict()
    mismatched = [name for name, tensor in expected.items() if not torch.equal(state[name], tensor)]
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    engine_values = [logp[len(prompt) - 1 + j, token].item() for j, token in enumerate(response)]
    from tests.sglang_harness.fixtures import sglang_checksums

    held = sglang_checksums(hf_dir, expected)[0]  # the engines' parameters: SGLang's fused ones
    server_mismatched = [[name for name, checksum in held.items() if digests.get(name) != checksum]
                         for digests in server_digests]
    return {"mismatched": mismatched, "count": len(expected), "version": engine.weight_version,
            "trainer": trainer_values, "engine": engine_values, "server_mismatched": server_mismatched}


@pytest.mark.slow
def test_megatron_tp2_pp2_sync_into_local_engine_and_sglang_servers(tmp_path):
    from megatron_grpo.models.tiny import save_tiny_hf_model

    hf_dir = save_tiny_hf_model("qwen3", tmp_path / "policy", seed=0)
    other_dir = save_tiny_hf_model("qwen3", tmp_path / "other", seed=1)
    launcher = launch_servers(tmp_path / "logs", [server_settings(other_dir) for _ in range(2)])
    try:
        urls = [server.url for server in launcher.servers]
        result = run_distributed(_sync_and_score, 4, (str(hf_dir), str(other_dir), urls, str(tmp_path / "sync")),
                                 timeout=600)[0]
    finally:
        launcher.shutdown(grace_s=2)
    assert result["count"] > 10 and result["mismatched"] == []
    # Through the distributed (server 0) and disk (server 1) transports too: bitwise.
    assert result["server_mismatched"] == [[], []]
    assert result["version"] == 7
    assert result["engine"] == pytest.approx(result["trainer"], abs=1e-5)
