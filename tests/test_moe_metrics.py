"""moe/* metrics (models/moe_metrics.py): the routers' statistics of a pass at EP2 on 2 gloo
ranks equal a dense float64 recomputation from the router inputs of both ranks (logits, softmax,
top-k, per-expert counts). For GLM-4.5's sigmoid router (expert bias, groups) the per-expert counts
come from megatron-core's own router output (its routing maps), the score distribution from
megatron-core's aux-loss scores."""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed

TOP_K = 2


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe_metrics") / "hf", seed=1))


@pytest.fixture(scope="module")
def glm4_path(tmp_path_factory):
    return str(save_tiny_hf_model("glm4_moe", tmp_path_factory.mktemp("moe_metrics_glm4") / "hf", seed=1))


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
    maps: dict[int, list[torch.Tensor]] = {}  # megatron's own routing maps (the router's output)

    def capture(module, args, output, layer):
        captured.setdefault(layer, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).double())
        maps.setdefault(layer, []).append(output[1].detach().reshape(-1, module.config.num_moe_experts).clone())

    routers = moe_routers(chunks[0])
    handles = [router.register_forward_hook(partial(capture, layer=layer)) for layer, router in routers]
    with RouterStats(chunks) as stats:
        fill_logprobs(chunks, samples, cfg, "old_logprobs", model_config=mc, temperature=1.0,
                      device=torch.device("cpu"))
    for handle in handles:
        handle.remove()
    got = stats.metrics()
    local = {layer: (torch.cat(captured[layer]), torch.cat(maps[layer])) for layer in captured}
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, local)
    inputs = {layer: torch.cat([part[layer][0] for part in gathered]) for layer in local}
    routing_maps = {layer: torch.cat([part[layer][1] for part in gathered]) for layer in local}
    weights = {layer: router.weight.detach().double() for layer, router in routers}
    bias = {layer: getattr(router, "expert_bias", None) for layer, router in routers}
    return got, inputs, routing_maps, weights, bias, mc.moe_top_k, sorted(local)


def test_router_statistics_equal_a_dense_recomputation_at_ep2(moe_path):
    results = run_distributed(_stats, 2, args=(moe_path,), timeout=300)
    (got, inputs, _, weights, _, top_k, layers), (got_1, *_) = results
    expected = _reference(inputs, weights, top_k)
    assert layers == [0, 1, 3]  # the tiny model's sparse layers (layer 2 is dense)
    assert got == got_1  # reduced over the ranks: the same on both
    assert set(got) == set(expected)
    for key, value in expected.items():
        # fp32 logits and softmax against float64: a few ulp of fp32 per term, summed over ~100 positions
        assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, got[key], value)
    assert got["moe/load_max_over_mean"] > 1.0 and 0 < got["moe/router_entropy"] < math.log(8)


def _megatron_scores(logits: torch.Tensor, top_k: int, score_function: str) -> torch.Tensor:
    """megatron-core's own score distribution for its aux losses (a tuple (map, scores) in 0.16,
    the scores alone in older releases)."""
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

    out = compute_routing_scores_for_aux_loss(logits, top_k, score_function)
    return out[-1] if isinstance(out, tuple) else out


def test_sigmoid_router_statistics_count_megatrons_routes_with_bias_and_groups(glm4_path):
    """GLM-4.5's router (tiny: 16 experts, top-4 within the best 2 of 4 groups, a random expert
    bias): the loads are the counts of megatron-core's own routing maps (scores + bias, group-limited),
    the entropy and aux loss use megatron's aux-loss scores, sigmoid normalised over the experts."""
    results = run_distributed(_stats, 2, args=(glm4_path,), timeout=300)
    (got, inputs, maps, weights, bias, top_k, layers), (got_1, *_) = results
    assert layers == [1, 2, 3]  # first_k_dense_replace 1
    assert got == got_1
    loads, entropies, aux, naive_loads, softmax_entropies = [], [], [], [], []
    for layer, hidden in inputs.items():
        logits = hidden @ weights[layer].T
        routing_map = maps[layer].double()
        assert (routing_map.sum(1) == top_k).all()
        counts, tokens = routing_map.sum(0), logits.shape[0]
        scores = _megatron_scores(logits.float(), top_k, "sigmoid").double()
        torch.testing.assert_close(scores, torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True))
        experts = logits.shape[1]
        loads.append(float(counts.max() / counts.mean()))
        entropies.append(float(-(scores * scores.log()).sum(-1).mean()))
        aux.append(float(experts / (top_k * tokens ** 2) * (counts * scores.sum(0)).sum()))
        # what a re-derived map would count without the bias and the groups, and the softmax's entropy
        plain = torch.zeros_like(logits).scatter(1, torch.topk(logits, top_k, dim=-1).indices, 1.0)
        assert not plain.equal(routing_map), "the bias and the groups choose no other expert: a weak test"
        naive_loads.append(float(plain.sum(0).max() / plain.sum(0).mean()))
        probs = torch.softmax(logits, -1)
        softmax_entropies.append(float(-(probs * probs.log()).sum(-1).mean()))
        assert bias[layer] is not None and bias[layer].abs().max() > 0  # the checkpoint's random bias
    expected = {"moe/load_max_over_mean": sum(loads) / len(loads), "moe/load_max_over_mean_worst": max(loads),
                "moe/router_entropy": sum(entropies) / len(entropies), "moe/aux_loss": sum(aux) / len(aux),
                "moe/dropped_frac": 0.0, "moe/replayed_frac": 0.0}
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, got[key], value)
    # the two mistakes this test tells apart: counting the unbiased, ungrouped top-k, and the softmax entropy
    assert not math.isclose(got["moe/load_max_over_mean"], sum(naive_loads) / len(naive_loads), rel_tol=1e-3)
    assert not math.isclose(got["moe/router_entropy"], sum(softmax_entropies) / len(entropies), rel_tol=1e-3)
    assert 0 < got["moe/router_entropy"] < math.log(16)
