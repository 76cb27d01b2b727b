"""Colocated SGLang engines (rollout.sglang.weight_sync=tensor): every trainer rank whose GPU hosts
an engine TP rank feeds that engine rank, by CUDA IPC handles (shared memory on CPU).

Placement, the convention of slurm/lib/grpo_common.sh and of rollout/sglang/launcher.py: engine k
(in rollout.sglang.urls order, or launch order) takes tp_size consecutive GPUs, on node
k // per_node of the trainer's nodes, GPUs (k % per_node) * tp_size + j for its TP rank j, with
per_node = gpus_per_node // tp_size. A trainer rank runs on GPU = its local rank, so engine k's TP
rank j is fed by the trainer rank on that node with that local rank. GPUs beyond the last engine
host none; their ranks take part in the export and push nothing.

One update of one engine (ColocatedSink.push, on each of its feeding ranks, all engines at once):
per bucket every feeding rank serializes its own tensors (SGLang's MultiprocessingSerializer
format); the engine's ranks gather them to the rank feeding engine rank 0 (the poster), which
POSTs /update_weights_from_tensor with one payload per engine TP rank, as
UpdateWeightsFromTensorReqInput.serialized_named_tensors wants them; the answer is shared with
the other feeding ranks, which keep their tensors alive until then. Pause / begin / end / flush /
continue and the memory tags stay with global rank 0's SGLangEngine (the per-stage protocol of
trainer/sync/stage_sync.py), once per engine around all the pushes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.errors import ConfigError
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy
from megatron_grpo.rollout.sglang.weight_sync import (EngineTarget, SyncStats, check_answer, push_tensor_buckets,
                                                      tensor_update_request)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlace:
    """Where a trainer rank runs: its node's name and its local rank (= its GPU)."""

    host: str
    local_rank: int
    local_world_size: int


@dataclass(frozen=True)
class EngineSeat:
    """The engine TP rank on a trainer rank's GPU."""

    engine: int  # index in the engine list
    engine_rank: int  # TP rank inside the engine (0 = the poster)
    feeders: tuple[int, ...]  # global trainer ranks feeding engine ranks 0..tp_size-1
    gpu: int  # the GPU (local rank) it sits on


def colocated_seats(places: Sequence[RankPlace], num_engines: int, tp_size: int) -> dict[int, EngineSeat]:
    """{global trainer rank: its seat} for `num_engines` engines of `tp_size` GPUs each, by the
    module docstring's placement; ranks without an engine are absent."""
    nodes: list[str] = []
    for place in places:  # nodes in the order of their lowest rank, as the launchers number them
        if place.host not in nodes:
            nodes.append(place.host)
    gpus_per_node = {p.local_world_size for p in places}
    if len(gpus_per_node) != 1:
        raise ConfigError(f"colocated engines (rollout.sglang.weight_sync=tensor) need the same number of trainer "
                          f"ranks on every node; got {sorted(gpus_per_node)}")
    gpus = gpus_per_node.pop()
    if gpus % tp_size:
        raise ConfigError(f"rollout.sglang.tp_size={tp_size} does not divide the {gpus} trainer GPUs of a node: "
                          f"colocated engines sit on the trainer's GPUs, one engine TP rank per GPU")
    per_node = gpus // tp_size
    if num_engines > per_node * len(nodes):
        raise ConfigError(f"{num_engines} colocated engines x tp_size {tp_size} need {num_engines * tp_size} GPUs; "
                          f"the trainer has {gpus} per node on {len(nodes)} node(s) = {gpus * len(nodes)} "
                          f"(colocated engines sit on the trainer's GPUs)")
    rank_at = {(p.host, p.local_rank): rank for rank, p in enumerate(places)}
    seats = {}
    for engine in range(num_engines):
        node, first = nodes[engine // per_node], (engine % per_node) * tp_size
        feeders = tuple(rank_at[(node, first + j)] for j in range(tp_size))
        for j, rank in enumerate(feeders):
            seats[rank] = EngineSeat(engine=engine, engine_rank=j, feeders=feeders, gpu=first + j)
    return seats


@dataclass(frozen=True)
class SGLangColocatedEndpoint:
    """Picklable: what a feeding rank needs to reach its engine (made by rank 0's SGLangEngine)."""

    targets: tuple[EngineTarget, ...]  # in placement order
    api_key: str | None
    request_timeout_s: float
    timeout_s: float  # one /update_weights_from_tensor call
    max_attempts: int
    push_in_turn: bool = False  # engines are fed independently: all at once

    def open(self, seat: EngineSeat, group: Any, bucket_bytes: int) -> "ColocatedSink":
        """This rank's sink into engine `seat.engine`; `group` is the feeding ranks' gloo group
        (None for tp_size 1), created collectively by the caller."""
        target = self.targets[seat.engine]
        if target.tp_size != len(seat.feeders):
            raise ConfigError(f"engine {target.url} serves with tp_size {target.tp_size}, but the placement gives it "
                              f"{len(seat.feeders)} GPUs (rollout.sglang.tp_size)")
        client = SGLangClient([target.url], timeout_s=self.request_timeout_s,
                              retry=RetryPolicy(max_attempts=self.max_attempts), api_key=self.api_key)
        if seat.engine_rank == 0:
            _warn_if_elsewhere(client, target, seat)
        return ColocatedSink(client, target, seat, group, bucket_bytes=bucket_bytes, timeout_s=self.timeout_s)


class ColocatedSink:
    """One feeding rank's side of its engine's update (module docstring)."""

    def __init__(self, client: SGLangClient, target: EngineTarget, seat: EngineSeat, group: Any, *,
                 bucket_bytes: int, timeout_s: float, flattened: bool | None = None):
        self.client, self.target, self.seat, self.group = client, target, seat, group
        self.bucket_bytes, self.timeout_s, self.flattened = bucket_bytes, timeout_s, flattened
        self.active = True  # False once rank 0's pool dropped this engine (set_targets)

    @property
    def posts(self) -> bool:
        return self.seat.engine_rank == 0

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        if not self.active:
            return SyncStats()  # the caller drains the export

        def post(serialized: Callable[[], str], load_format: str | None) -> None:
            payloads, error = self._gather(serialized()), None
            if self.posts:
                try:
                    answer = self.client.call(self.target.url, "/update_weights_from_tensor", tensor_update_request(
                        payloads, load_format, version), timeout_s=self.timeout_s)
                    check_answer(self.target.url, "/update_weights_from_tensor", answer)
                except SGLangError as exc:
                    error = str(exc)
            error = self._from_poster(error)
            if error is not None:
                raise SGLangError(error, self.target.url)

        return push_tensor_buckets(named_tensors, self.bucket_bytes, self.flattened, post)

    def _gather(self, serialized: str) -> list[str] | None:
        """Every feeding rank's payload on the poster, in engine TP rank order; None elsewhere."""
        if self.group is None:
            return [serialized]
        gathered: list[Any] | None = [None] * len(self.seat.feeders) if self.posts else None
        dist.gather_object(serialized, gathered, dst=self.seat.feeders[0], group=self.group)
        return gathered

    def _from_poster(self, error: str | None) -> str | None:
        """The poster's outcome on every feeding rank (they raise together, and free their
        tensors only once the engine has copied them)."""
        if self.group is None:
            return error
        holder = [error]
        dist.broadcast_object_list(holder, src=self.seat.feeders[0], group=self.group)
        return holder[0]

    def set_targets(self, targets: Sequence[EngineTarget]) -> None:
        """The engines rank 0's pool keeps; a dropped engine's feeders push nothing (a restarted
        one keeps its URL and GPU)."""
        self.active = self.target.url in {t.url for t in targets}

    def close(self) -> None:
        self.client.close()


def _warn_if_elsewhere(client: SGLangClient, target: EngineTarget, seat: EngineSeat) -> None:
    """An engine started on other GPUs than the placement says still works (CUDA IPC maps memory
    across GPUs of a node), but every push then crosses GPUs: say so once."""
    try:
        info = client.call(target.url, "/server_info", method="GET", timeout_s=60.0)
    except SGLangError as exc:
        log.warning("cannot read %s/server_info (%s): the engine's GPUs are unchecked", target.url, exc)
        return
    base = info.get("base_gpu_id") if isinstance(info, dict) else None
    if base is not None and int(base) != seat.gpu:
        log.warning("engine %d (%s) runs on GPUs from %s, but the trainer rank feeding it is on GPU %d: list "
                    "rollout.sglang.urls in GPU order (engine k on GPUs k*tp_size...) so that weights stay on "
                    "their GPU", seat.engine, target.url, base, seat.gpu)
