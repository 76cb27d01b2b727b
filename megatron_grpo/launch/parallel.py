"""megatron parallel_state and seeds for one parallel layout (TP, PP, virtual PP, CP; DP is the rest)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_grpo.errors import ConfigError, LaunchError


@dataclass(frozen=True)
class ParallelLayout:
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    context: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "context"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)}: expected an integer >= 1")
        if self.virtual_pipeline is not None and (self.virtual_pipeline < 1 or self.pipeline < 2):
            raise ConfigError(f"parallel.virtual_pipeline={self.virtual_pipeline}: expected null, or an integer "
                              f">= 1 together with parallel.pipeline >= 2 (got {self.pipeline})")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise LaunchError(
                f"world size {world_size} is not divisible by TP*PP*CP = {self.tensor}*{self.pipeline}*"
                f"{self.context} = {self.model_parallel_size}; set parallel.tensor/pipeline/context to divide it")
        return world_size // self.model_parallel_size


def initialize_model_parallel(layout: ParallelLayout, seed: int = 1234) -> None:
    """Sets up megatron's process groups over the already-initialised default group, then seeds.

    On CPU the compatibility layer is applied first (it must precede the RNG-tracker seeding)."""
    from megatron.core import parallel_state

    from megatron_grpo.launch.cpu import apply_cpu_compat

    if not dist.is_initialized():
        raise LaunchError("torch.distributed is not initialised; call launch.init_distributed() first")
    apply_cpu_compat()
    layout.data_parallel_size(dist.get_world_size())  # raises a clear error if it does not divide
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.context,
    )
    set_seed(seed)


def set_seed(seed: int) -> None:
    """Seeds python, numpy, torch and megatron's model-parallel RNG tracker (same seed on every
    rank except for the TP-local stream, which megatron offsets by TP rank)."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
