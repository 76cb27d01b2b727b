"""Rollout engines: the interface, the in-process HF engine, SGLang client/launcher/weight sync."""
from megatron_grpo.rollout.engine import NamedTensors, RolloutEngine
from megatron_grpo.rollout.types import EngineHealth, GenerationRequest, Sample, SamplingParams

__all__ = ["EngineHealth", "GenerationRequest", "NamedTensors", "RolloutEngine", "Sample", "SamplingParams"]
