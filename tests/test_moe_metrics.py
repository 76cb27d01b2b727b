"""moe/* metrics (models/moe_metrics.py): the routers' statistics of a pass at EP2 on 2 gloo
ranks equal a dense float64 recomputation from the router inputs of both ranks (logits, softmax,
top-k, per-expert counts), and the train step logs them."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed

TOP_K = 2


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe_metrics") / "hf", seed=1))


def _reference(inputs_by_layer, weights, top_k):
    """Dense float64 statistics from every rank's router inputs."""
    loads, entropies, aux = [], [], []
    for layer, hidden in inputs_by_layer.items():
        logits = hidden @ weights[layer].T
        probs = torch.softmax(logits, dim=-1)
        experts = logits.shape[1]
        chosen = torch.topk(logits, top_k, dim=-1).indices
        counts = torch.zeros(experts, dtype=torch.float64).index_add_(0, chosen.reshape(-1),
                                                                       torch.ones(chosen.numel(), dtype=torch.float64))
        tokens = logits.shape[0]
        loads.append(float(counts.max() / counts.mean()))
        entropies.append(float(-(probs * probs.log()).sum(-1).mean()))
        aux.append(float(experts / (top_k * tokens ** 2) * (counts * probs.sum(0)).sum()))
    return {"moe/load_max_over_mean": sum(loads) / len(loads), "moe/load_max_over_mean_worst": max(loads),
            "moe/router_entropy": sum(entropies) / len(entropies), "moe/aux_loss": sum(aux) / len(aux),
            "moe/dropped_frac": 0.0, "moe/replayed_frac": 0.0}


def _stats(rank, world_size, path):
    import torch.distributed as dist

    from megatron_grpo.config import load_config
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_reference_model
    from megatron_grpo.models.moe_metrics import RouterStats
    from megatron_grpo.models.routing_replay import moe_routers
    from megatron_grpo.trainer.batches.batching import TrainSample
    from megatron_grpo.trainer.step.train_step import fill_logprobs

    cfg = load_config("tiny_cpu", ["rollout.n=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                                   "parallel.expert=2"])
    initialize_model_parallel(ParallelLayout(expert=2), seed=1)
    mc = ModelArchitecture.from_hf(path, vocab_multiple=8)
    chunks = build_reference_model(mc)
    load_hf_weights(chunks, mc, path)
    generator = torch.Generator().manual_seed(3 + rank)
    samples = [TrainSample(torch.randint(0, 250, (4 + i,), generator=generator).tolist(),
                           torch.randint(0, 250, (3 + 2 * i,), generator=generator).tolist(), 1.0) for i in range(4)]
    captured: dict[int, list[torch.Tensor]] = {}
    routers = moe_routers(chunks[0])
    handles = [router.register_forward_hook(
        lambda module, args, output, layer=layer: captured.setdefault(layer, []).append(
            args[0].detach().reshape(-1, args[0].shape[-1]).double())) for layer, router in routers]
    with RouterStats(chunks) as stats:
        fill_logprobs(chunks, samples, cfg, "old_logprobs", model_config=mc, temperature=1.0,
                      device=torch.device("cpu"))
    for handle in handles:
        handle.remove()
    got = stats.metrics()
    local = {layer: torch.cat(parts) for layer, parts in captured.items()}
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, local)
    inputs = {layer: torch.cat([part[layer] for part in gathered]) for layer in local}
    weights = {layer: router.weight.detach().double() for layer, router in routers}
    return got, _reference(inputs, weights, mc.moe_top_k), sorted(local)


def test_router_statistics_equal_a_dense_recomputation_at_ep2(moe_path):
    results = run_distributed(_stats, 2, args=(moe_path,), timeout=300)
    (got, expected, layers), (got_1, _, _) = results
    assert layers == [0, 1, 3]  # the tiny model's sparse layers (layer 2 is dense)
    assert got == got_1  # reduced over the ranks: the same on both
    assert set(got) == set(expected)
    for key, value in expected.items():
        # fp32 logits and softmax against float64: a few ulp of fp32 per term, summed over ~100 positions
        assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, got[key], value)
    assert got["moe/load_max_over_mean"] > 1.0 and 0 < got["moe/router_entropy"] < math.log(8)
