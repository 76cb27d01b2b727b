"""The interfaces of rollout engines: RolloutEngine, which every engine implements (local HF
model in the trainer's process or its own, SGLang servers), and StagedWeightUpdates, which an
engine implements when it can take its weights from sender ranks other than global rank 0
(trainer/sync/stage_sync.py: per pipeline stage, colocated)."""
from __future__ import annotations

import abc
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

import torch

from megatron_grpo.rollout.types import EngineHealth, GenerationRequest, Sample

NamedTensors = Iterable[tuple[str, torch.Tensor]]
# Told (request index, that request's samples) as soon as a request's samples are all final, from
# the engine's thread: reward scoring starts on them while the rest generate (trainer/rollouts/).
RequestDone = Callable[[int, list[Sample]], None]


class RolloutEngine(abc.ABC):
    """Generates samples and receives new weights as a stream of HF-named tensors.

    `generate` returns, for each request in order, its `sampling.n` samples in sample order, and
    tells `on_request_done` each request's samples once they are final (engines that finish a
    call at once tell them all at the end: `report_each_request`).
    `update_weights` consumes the stream once (it may be a generator that exports on the fly) and
    stamps `version` on every later sample."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest],
                 on_request_done: RequestDone | None = None) -> list[Sample]: ...

    @abc.abstractmethod
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None:
        """Ends a generate call in flight (from another thread): its unfinished samples come back
        with finish_reason 'abort'."""

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Free accelerator memory (weights, KV cache) while the trainer runs (colocated mode)."""

    @abc.abstractmethod
    def resume_memory(self) -> None:
        """Take the memory back before the next weight update / generation."""

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    @property
    @abc.abstractmethod
    def weight_version(self) -> int: ...

    def sync_metrics(self) -> dict[str, float]:
        """Metrics of the last update_weights (e.g. sync/seconds, sync/verified); default none."""
        return {}

    def close(self) -> None:
        """Releases processes / connections; the default has nothing to release."""


def report_each_request(requests: Sequence[GenerationRequest], samples: list[Sample],
                        on_request_done: RequestDone | None) -> list[Sample]:
    """For engines that return a whole call at once: tells on_request_done every request's samples
    (n each, in order); returns `samples`."""
    if on_request_done is not None:
        start = 0
        for index, request in enumerate(requests):
            on_request_done(index, samples[start:start + request.sampling.n])
            start += request.sampling.n
    return samples


@runtime_checkable
class StagedWeightUpdates(Protocol):
    """One weight update driven by global rank 0 in steps while sender ranks push (trainer/
    weight_sync.py runs it): prepare (engines restarted or dropped: the senders' new targets),
    begin (pause generation, open the update; a weight sample for the senders to fill, or None),
    the senders push through sinks opened from stage_endpoint(), then end (apply, continue,
    verify the samples) or abort."""

    def stage_endpoint(self) -> Any:
        """Picklable: what a pipeline stage's sender opens its sink from (trainer/sync/stage_sync.py)."""

    def prepare_stage_update(self, version: int) -> Optional[list]: ...

    def begin_stage_update(self, version: int) -> Any: ...

    def end_stage_update(self, version: int, results: list) -> None:
        """results: every sender's (stage, stats, sampled tensors or None) of a successful push."""

    def abort_stage_update(self, version: int) -> None: ...


@runtime_checkable
class ColocatedWeightUpdates(StagedWeightUpdates, Protocol):
    """A staged update fed not by one sender per pipeline stage but by every trainer rank whose GPU
    hosts an engine TP rank (weight_sync=tensor: rollout/sglang/colocated.py)."""

    def colocated_endpoint(self) -> Any:
        """Picklable: what each such rank opens its feed from (trainer/sync/stage_sync.py)."""
