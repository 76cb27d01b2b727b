"""Rollout routing replay (R3): the trainer's MoE layers route each token to the experts the
rollout engine routed it to, instead of their own top-k.

Definition (slime's and verl's, both on megatron-core's router-replay hook): the replayed expert
*indices* come from the engine; the gate *weights* come from the trainer's router, evaluated at
those experts. megatron's top-k routing calls `router.router_replay.get_replay_topk(scores, k, ...)`
with the router's scores (its logits when probabilities are renormalised over the top-k, as
Qwen3-MoE's norm_topk_prob does; the softmax over all experts otherwise) and expects
(scores at the chosen experts, their indices): the weights are then softmax(logits[chosen]), or
the full softmax at the chosen experts, i.e. the trainer's own gate math on the engine's choice,
so gradients still reach the router through the chosen experts' logits. slime
(utils/routing_replay.py: `probs = scores.gather(1, top_indices)`) and verl (megatron-core's
RouterReplay REPLAY_FORWARD, set per micro-batch by router_replay_utils.set_router_replay_data)
both do exactly this; so do we. The aux loss (if any) keeps the trainer's own top-k, as in both.

Data: per sequence position the engine's [num_hidden_layers, k] expert ids (rollout.types.Sample.
routed_experts); a micro-batch carries them as [b, s, num_hidden_layers, k] in its own layout
(padded rows or one packed row, this CP rank's positions), stored as expert id + 1 so that the
zeros of any padding mean "no route". Positions without a recorded route (the last token,
padding, dense layers' -1) keep the trainer's own top-k. Under sequence parallelism a
TP rank routes only its 1/TP slice of the sequence; the slice is taken here.

No module-level state: each router gets its own ReplayRouting (install_routing_replay), and
set_micro_batch_routes sets, per chunk, the routes of the micro-batch about to run forward.

Full activation recompute (model.recompute_granularity=full) runs a checkpointed layer's router a
second time inside the backward pass, and under pipeline parallelism (1F1B, interleaved) that
backward comes after later micro-batches have set their routes. As megatron-core's RouterReplay
(REPLAY_BACKWARD: a per-router list popped by the recompute), each router keeps the routes its
checkpointed forwards used, first in first out, and the recompute takes them in that order: each
chunk's backwards run in the order of its forwards in every megatron schedule. A checkpointed
forward is recognised as megatron's CheckpointFunction runs it: grad disabled inside a pass that
set its routes with grad enabled (a train pass; the log-prob passes run under no_grad and queue
nothing); the recompute as a router call inside autograd's backward.
"""
from __future__ import annotations

from collections import deque

import torch


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread (a recompute)."""
    return torch._C._current_graph_task_id() != -1


class ReplayRouting:
    """megatron's router_replay protocol for one router: the engine's experts where given."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None  # [tokens, k] long; -1 rows: the router's own choice
        self.train_pass = False  # the current micro-batch's routes were set with grad enabled
        # Routes of this router's checkpointed forwards, for their recompute in backward (see above).
        self.recompute_queue: deque[torch.Tensor | None] = deque()

    def set_target(self, target: torch.Tensor | None) -> None:
        self.target, self.train_pass = target, torch.is_grad_enabled()

    def _routes_for_this_call(self) -> torch.Tensor | None:
        if _in_backward():
            if not self.recompute_queue:
                raise RuntimeError("routing replay: a router ran in backward with no checkpointed forward "
                                   "queued (recompute order differs from megatron's)")
            return self.recompute_queue.popleft()
        if self.train_pass and not torch.is_grad_enabled():  # megatron's checkpointed forward
            self.recompute_queue.append(self.target)
        return self.target

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self._routes_for_this_call()
        if target is None:
            return own_scores, own
        target = target.to(scores.device)
        if target.shape != own.shape:
            raise ValueError(f"routing replay: {tuple(target.shape)} routes for {tuple(own.shape)} routed tokens "
                             f"(the micro-batch's routes do not match the router's input)")
        recorded = (target >= 0).all(dim=-1, keepdim=True)
        indices = torch.where(recorded, target, own)
        return scores.gather(1, indices), indices


def moe_routers(chunk: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(global layer index, router) of every MoE layer of one model chunk."""
    from megatron_grpo.models.builder import unwrap

    model = unwrap(chunk)
    return [(layer.layer_number - 1, layer.mlp.router) for layer in model.decoder.layers
            if hasattr(layer.mlp, "router")]


def install_routing_replay(chunks) -> int:
    """Gives every router of `chunks` its ReplayRouting (idempotent); returns how many routers."""
    count = 0
    for chunk in chunks:
        for _, router in moe_routers(chunk):
            if not isinstance(router.router_replay, ReplayRouting):
                router.router_replay = ReplayRouting()
            count += 1
    return count


def set_micro_batch_routes(chunk: torch.nn.Module, routes: torch.Tensor | None) -> None:
    """Routes of the micro-batch about to run through `chunk` ([b, s, num_hidden_layers, k] expert
    id + 1 in its token layout, 0 = none), or None for the routers' own top-k. Installs the
    routers' ReplayRouting on first use."""
    from megatron.core import parallel_state as ps

    routers = moe_routers(chunk)
    if not routers:
        return
    if routes is None:
        for _, router in routers:
            if isinstance(router.router_replay, ReplayRouting):
                router.router_replay.set_target(None)
        return
    config = routers[0][1].config
    by_token = routes.transpose(0, 1)  # the router sees hidden states [s, b, h] flattened
    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        by_token = by_token.chunk(config.tensor_model_parallel_size, dim=0)[ps.get_tensor_model_parallel_rank()]
    by_token = by_token.reshape(-1, *routes.shape[2:]).long() - 1
    install_routing_replay([chunk])
    for layer, router in routers:
        router.router_replay.set_target(by_token[:, layer])
