"""MoE router statistics of one pass (the train step's moe/* metrics), read by forward hooks on
megatron's routers: per layer the tokens each expert received, the router's entropy and the
Switch load-balancing loss, summed over micro-batches and reduced over all ranks.

Per layer l, with T routed positions (padding included: the router sees it), k experts per token,
E experts, p_t the router's score distribution over the E experts at position t and c_e the
positions dispatched to expert e (the routing map the layer's router returned: top-k of the
scores, plus the expert bias and within the chosen groups for GLM-4.5 / DeepSeek-V3's sigmoid
routers; the engine's experts under routing replay):
  load_max_over_mean_l = max_e c_e / mean_e c_e          (1 = perfectly balanced)
  router_entropy_l     = mean_t H(p_t)  (nats; log E = uniform)
  aux_loss_l           = E / (k T^2) * sum_e c_e * sum_t p_te   (megatron's switch aux loss without
                         its coefficient, over the whole pass's positions at once)
  dropped_frac         = 1 - sum_e c_e / (k T)   (0 without a capacity factor: nothing is dropped)
  replayed_frac        = positions routed by the engine's recorded experts / T
p_t is megatron's score distribution for its aux losses (moe_utils.compute_routing_scores_for_aux_loss):
softmax(logits) for a softmax router; for a sigmoid router sigmoid(logits) normalised to sum 1
over the experts (no bias: the bias only chooses). A sigmoid router's own aux loss would count
the top-k of those unbiased scores; here c_e is always the routing actually used, so aux_loss is
the balance of the dispatch (GLM-4.5 trains no aux loss: the metric is a diagnostic only).
Reported: the mean over MoE layers of each, and the worst layer's load (moe/load_max_over_mean_worst).
The sums are reduced over all ranks (a stage's absent layers add zeros); TP ranks without sequence
parallelism see the same positions, which scales every sum of a layer alike and leaves the ratios
unchanged. Cost: one [T, E] logits matmul per layer in fp32 (the router's own, repeated detached).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

# per-layer accumulator columns after the E expert counts: positions, sum of entropies,
# replayed positions, then E columns of summed probabilities
_TOKENS, _ENTROPY, _REPLAYED = 0, 1, 2


class RouterStats:
    """Context manager: hooks every router of `chunks` while open; `metrics()` afterwards (a
    collective: every rank calls it). No MoE layers in the model: no hooks, no metrics."""

    def __init__(self, chunks) -> None:
        from megatron_grpo.models.builder import unwrap
        from megatron_grpo.models.routing_replay import moe_routers

        config = unwrap(chunks[0]).config
        self.num_experts = config.num_moe_experts or 0
        self.top_k = config.moe_router_topk
        self.num_layers = config.num_layers
        self.routers = [pair for chunk in chunks for pair in moe_routers(chunk)] if self.num_experts else []
        width = 3 + 2 * self.num_experts
        self.sums = torch.zeros(self.num_layers, width, dtype=torch.float64)
        self.moe_layers = torch.zeros(self.num_layers, dtype=torch.float64)
        self._handles: list = []

    def __enter__(self) -> "RouterStats":
        for layer, router in self.routers:
            self._handles.append(router.register_forward_hook(partial(self._hook, layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @torch.no_grad()
    def _hook(self, layer: int, router, args, output) -> None:
        hidden = args[0].detach()
        logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), router.weight.float(),
                                            None if router.bias is None else router.bias.float())
        probs = router_scores(logits, router.config.moe_router_score_function)
        routing_map = output[1].reshape(logits.shape[0], -1)
        row = self.sums[layer]
        experts = self.num_experts
        row[3:3 + experts] += routing_map.sum(0).double().cpu()
        row[3 + experts:] += probs.sum(0).double().cpu()
        row[_TOKENS] += logits.shape[0]
        row[_ENTROPY] += float(-(probs * torch.log(probs.clamp_min(1e-30))).sum())
        replay = getattr(router, "router_replay", None)
        target = getattr(replay, "target", None)
        if target is not None:
            row[_REPLAYED] += float((target >= 0).all(dim=-1).sum())
        self.moe_layers[layer] = 1.0

    def metrics(self) -> dict[str, float]:
        if not self.num_experts:
            return {}
        sums = torch.cat([self.sums, self.moe_layers[:, None]], dim=1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        layers = sums[:, -1] > 0
        sums = sums[layers, :-1]
        if not len(sums):
            return {}
        experts, k = self.num_experts, self.top_k
        tokens = sums[:, _TOKENS].clamp_min(1)
        counts, prob_sums = sums[:, 3:3 + experts], sums[:, 3 + experts:]
        load = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-30)
        aux = experts / (k * tokens ** 2) * (counts * prob_sums).sum(dim=1)
        return {"moe/load_max_over_mean": float(load.mean()),
                "moe/load_max_over_mean_worst": float(load.max()),
                "moe/router_entropy": float((sums[:, _ENTROPY] / tokens).mean()),
                "moe/aux_loss": float(aux.mean()),
                "moe/dropped_frac": float((1 - counts.sum(dim=1) / (k * tokens)).mean()),
                "moe/replayed_frac": float((sums[:, _REPLAYED] / tokens).mean())}


def router_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The router's score distribution over the experts per position ([T, E], rows summing to 1):
    megatron-core's scores for its aux losses (moe_utils.compute_routing_scores_for_aux_loss)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    raise ValueError(f"moe metrics: router score function {score_function!r} is not supported")
