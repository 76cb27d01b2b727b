"""Weight sync from several sender ranks at once, with no hop through global rank 0
(rollout.weight_sync_route, trainer/sync/weight_sync.py runs one sync):

per_stage  each pipeline stage's sender streams its own layers (convert/stage_export.py StageRole:
           tensor-parallel rank 0 of the first data-parallel replica), all stages at once:
    local engine in its own process  SharedWeightSender into its shared-memory receiver
    SGLang (weight_sync=distributed) a DistributedTransport of the stage's own (group
                                     megatron-grpo-pp<stage>, a port of the sender's), joined by every
                                     engine TP rank (rollout/sglang/stage_sync.py); SGLang runs the
                                     stages' requests to one engine one after another (its tokenizer
                                     manager queues them); with several engines the stages open,
                                     rebuild and push their groups in turn (endpoint.push_in_turn),
                                     since two engines' queues may order the stages differently and
                                     each engine would wait in a group the other has not joined yet
colocated  SGLang weight_sync=tensor: every trainer rank whose GPU hosts an engine TP rank streams
           the whole model (WholeModelRole) and feeds that engine rank by CUDA IPC (shared memory on
           CPU); the engine's feeding ranks gather their payloads to the one that posts
           (rollout/sglang/colocated.py, which also defines the placement). Engines are fed at once.

connect_stage_sync (collective, once, in build_run) gives every rank a StageSync: its role and, on
senders, a sink opened from the endpoint rank 0's engine describes. One sync is then: rank 0
prepares the engines (engine.prepare_stage_update: a restarted or dropped SGLang engine means new
targets, and every sink is told), rank 0 opens the update (engine.begin_stage_update: SGLang
pauses generation, takes the weight memory back and opens ONE begin/end session per engine around
all pushes), every sender pushes, the results are gathered, and rank 0 ends it
(engine.end_stage_update: SGLang ends the sessions, flushes, continues, resumes the KV cache,
verifies).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, TypeVar

import torch
import torch.distributed as dist

from megatron_grpo.config.derived import weight_sync_route
from megatron_grpo.config.schema import Config
from megatron_grpo.convert.stage_export import StageRole, WholeModelRole
from megatron_grpo.errors import ConfigError, MegatronGRPOError, RolloutFailure
from megatron_grpo.launch.collectives import (all_gather_objects, broadcast_from_rank0, in_turns, on_rank0,
                                              raise_if_any_failed)
from megatron_grpo.rollout.engine import ColocatedWeightUpdates, StagedWeightUpdates

T = TypeVar("T")


class StageSink(Protocol):
    """A sender's connection to the engines."""

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Any: ...

    def set_targets(self, targets) -> None: ...

    def close(self) -> None: ...


class StageEndpoint(Protocol):
    """Picklable: what a stage sender needs to open its sink (made by rank 0's engine)."""

    push_in_turn: bool  # the stages must push one after another (several SGLang engines)

    def open(self, role: StageRole, bucket_bytes: int) -> StageSink: ...


class SenderRole(Protocol):
    """What a rank streams in a sync (convert/stage_export.py: StageRole, WholeModelRole)."""

    stage: int  # its turn when senders push in turn
    num_stages: int
    sends: bool
    label: str  # for messages: "stage 1", "engine 3 rank 0"

    def export(self, model_chunks, cfg) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass
class StageSync:
    role: SenderRole
    sink: Optional[StageSink]  # senders only
    in_turn: bool = False  # the endpoint's push_in_turn

    def stage_by_stage(self, fn: Callable[[], T]) -> T:
        """Collective: fn() on this rank, every stage at once or (in_turn) stage 0 first, then 1, ..."""
        return in_turns(self.role.stage if self.in_turn else None, self.role.num_stages, fn)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.sink = None


def connect_stage_sync(cfg: Config, rank0) -> StageSync | None:
    """Collective: every rank's StageSync, or None when the weights go through rank 0."""
    route = weight_sync_route(cfg)
    if route == "rank0":
        return None
    bucket_bytes = cfg.rollout.weight_bucket_mb * 2**20
    protocol = ColocatedWeightUpdates if route == "colocated" else StagedWeightUpdates
    engine_kind = broadcast_from_rank0(None if rank0 is None else (type(rank0.engine).__name__, isinstance(
        rank0.engine, protocol)))
    if not engine_kind[1]:  # validation refuses such recipes first; every rank stops here too
        raise ConfigError(f"rollout.weight_sync_route={route}: the {engine_kind[0]} takes its weights from rank 0 "
                          "only; use rollout.weight_sync_route=rank0")
    # on_rank0: an engine that cannot give an endpoint (the wrong transport) stops every rank with its error
    if route == "colocated":
        endpoint = on_rank0(lambda: rank0.engine.colocated_endpoint())
        role, opener = _colocated_sender(endpoint, bucket_bytes)
    else:
        endpoint = on_rank0(lambda: rank0.engine.stage_endpoint())
        role = StageRole.current()
        opener = (lambda: endpoint.open(role, bucket_bytes)) if role.sends else None
    stage_sync = StageSync(role=role, sink=None, in_turn=bool(endpoint.push_in_turn))

    def open_sink() -> Optional[str]:
        if opener is not None:
            try:
                stage_sync.sink = opener()
            except MegatronGRPOError as exc:
                return f"the weight senders could not reach the rollout engines: {role.label}: {exc}"
        return None

    try:
        raise_if_any_failed(stage_sync.stage_by_stage(open_sink), RolloutFailure)
    except RolloutFailure:
        stage_sync.close()
        raise
    return stage_sync


def _colocated_sender(endpoint, bucket_bytes: int):
    """Collective: this rank's WholeModelRole and sink opener. Every rank learns every rank's node
    and local rank (= GPU), computes the same placement, and takes part in creating each engine's
    gloo group of feeding ranks (tp_size > 1), in engine order."""
    from megatron_grpo.launch.env import discover_ranks
    from megatron_grpo.rollout.sglang.colocated import RankPlace, colocated_seats

    ranks = discover_ranks(os.environ)
    places = all_gather_objects(RankPlace(socket.gethostname(), ranks.local_rank, ranks.local_world_size))
    tp_sizes = {t.tp_size for t in endpoint.targets}
    if len(tp_sizes) > 1:
        raise ConfigError(f"colocated engines serve with different tp_size ({sorted(tp_sizes)}); give them one")
    seats = colocated_seats(places, len(endpoint.targets), tp_sizes.pop())
    groups = {}
    for seat in sorted({s.engine: s for s in seats.values()}.values(), key=lambda s: s.engine):
        if len(seat.feeders) > 1:  # every rank creates every group, in the same order
            groups[seat.engine] = dist.new_group(list(seat.feeders), backend="gloo")
    seat = seats.get(dist.get_rank())
    if seat is None:
        return WholeModelRole(label=f"rank {dist.get_rank()} (no engine on its GPU)", sends=False), None
    role = WholeModelRole(label=f"engine {seat.engine} rank {seat.engine_rank} ({endpoint.targets[seat.engine].url})",
                          sends=True)
    return role, lambda: endpoint.open(seat, groups.get(seat.engine), bucket_bytes)
