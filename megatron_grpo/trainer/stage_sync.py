"""Weight sync per pipeline stage: each stage's sender streams its own layers to the rollout
engines, all stages at once, with no hop through global rank 0 (rollout.weight_sync_route).

connect_stage_sync (collective, once, in build_run) gives every rank a StageSync: its StageRole
(convert/stage_export.py: one sender per stage, tensor-parallel rank 0 of the first data-parallel
replica) and, on senders, a sink opened from the endpoint rank 0's engine describes:
    local engine in its own process  SharedWeightSender into its shared-memory receiver
    SGLang (weight_sync=distributed) a DistributedTransport of the stage's own (group
                                     megatron-grpo-pp<stage>, a port of the sender's), joined by every
                                     engine TP rank (rollout/sglang/stage_sync.py); SGLang runs the
                                     stages' updates of one engine one after another (its tokenizer
                                     manager queues them); with several engines the stages push in
                                     turn (endpoint.push_in_turn), since two engines' queues may
                                     order the stages differently and the broadcasts would deadlock
One sync (trainer/weight_sync.py) is then: rank 0 prepares the engines (engine.prepare_stage_update:
a restarted or dropped SGLang engine means new targets, and every sink rebuilds its group), rank 0
opens the update (engine.begin_stage_update: SGLang pauses generation and opens ONE begin/end
session per engine around all stages' pushes), every sender pushes, the results are gathered, and
rank 0 ends it (engine.end_stage_update: SGLang ends the sessions, flushes, continues, verifies).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol

import torch
import torch.distributed as dist

from megatron_grpo.config.schema import Config
from megatron_grpo.convert.stage_export import StageRole
from megatron_grpo.errors import MegatronGRPOError, RolloutFailure
from megatron_grpo.launch.distributed import broadcast_from_rank0


class StageSink(Protocol):
    """A stage sender's connection to the engines."""

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Any: ...

    def set_targets(self, targets) -> None: ...

    def close(self) -> None: ...


class StageEndpoint(Protocol):
    """Picklable: what a stage sender needs to open its sink (made by rank 0's engine)."""

    push_in_turn: bool  # the stages must push one after another (several SGLang engines)

    def open(self, role: StageRole, bucket_bytes: int) -> StageSink: ...


@dataclass
class StageSync:
    role: StageRole
    sink: Optional[StageSink]  # senders only
    in_turn: bool = False  # the endpoint's push_in_turn

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.sink = None


def stage_route(cfg: Config) -> str:
    """per_stage or rank0, for this recipe (rollout.weight_sync_route; validate.py refuses per_stage
    where the engine cannot take it)."""
    from megatron_grpo.trainer.local_engine import engine_in_own_process

    route = cfg.rollout.weight_sync_route
    if route != "auto":
        return route
    r = cfg.rollout
    if r.engine == "sglang":  # the disk and tensor transports have one writer / one colocated rank
        # Without pipeline stages the one sender is rank 0 either way: keep the rank-0 route, whose
        # engine-fault recovery (restarts, dropped URLs mid-sync) the fault tests exercise most.
        distributed = r.sglang.weight_sync == "distributed"
        return "per_stage" if distributed and cfg.parallel.pipeline > 1 else "rank0"
    return "per_stage" if engine_in_own_process(cfg) else "rank0"


def connect_stage_sync(cfg: Config, rank0) -> StageSync | None:
    """Collective: every rank's StageSync, or None when the weights go through rank 0."""
    if stage_route(cfg) != "per_stage":
        return None
    endpoint = broadcast_from_rank0(rank0.engine.stage_endpoint() if rank0 is not None else None)
    role = StageRole.current()
    sink, error = None, None
    if role.sends:
        try:
            sink = endpoint.open(role, cfg.rollout.weight_bucket_mb * 2**20)
        except MegatronGRPOError as exc:
            error = f"stage {role.stage}: {exc}"
    errors = [e for e in all_gather(error) if e]
    if errors:
        if sink is not None:
            sink.close()
        raise RolloutFailure(f"the per-stage weight senders could not reach the rollout engines: {errors[0]}")
    return StageSync(role=role, sink=sink, in_turn=bool(endpoint.push_in_turn))


def all_gather(value: Any) -> list[Any]:
    """Every rank's `value` (small, picklable), in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
