"""The interface every rollout engine implements (local HF model, SGLang servers)."""
from __future__ import annotations

import abc
from typing import Iterable, Sequence

import torch

from megatron_grpo.rollout.types import EngineHealth, GenerationRequest, Sample

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class RolloutEngine(abc.ABC):
    """Generates samples and receives new weights as a stream of HF-named tensors.

    `generate` returns, for each request in order, its `sampling.n` samples in sample order.
    `update_weights` consumes the stream once (it may be a generator that exports on the fly) and
    stamps `version` on every later sample."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Sample]: ...

    @abc.abstractmethod
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None: ...

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
