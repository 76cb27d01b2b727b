"""megatron parallel_state and seeds for one parallel layout (TP, PP, virtual PP, CP; DP is the rest).

Experts (MoE layers) are laid out over the same ranks by megatron's second decomposition:
world = PP x EP x ETP x expert-DP, where ETP (expert tensor parallelism) defaults to TP. Every rank
of an EP group holds num_experts / EP experts; tokens reach them through the token dispatcher's
all-to-all over that group, and expert grads are reduced over the expert-DP group."""
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
    expert: int = 1                      # EP: ranks the experts of a layer are spread over
    expert_tensor: int | None = None     # ETP: tensor parallelism inside an expert; None = tensor

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "context", "expert"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)}: expected an integer >= 1")
        if self.expert_tensor is not None and self.expert_tensor < 1:
            raise ConfigError(f"parallel.expert_tensor={self.expert_tensor}: expected null or an integer >= 1")
        if self.virtual_pipeline is not None and (self.virtual_pipeline < 1 or self.pipeline < 2):
            raise ConfigError(f"parallel.virtual_pipeline={self.virtual_pipeline}: expected null, or an integer "
                              f">= 1 together with parallel.pipeline >= 2 (got {self.pipeline})")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context

    @property
    def expert_tensor_size(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise LaunchError(
                f"world size {world_size} is not divisible by TP*PP*CP = {self.tensor}*{self.pipeline}*"
                f"{self.context} = {self.model_parallel_size}; set parallel.tensor/pipeline/context to divide it")
        expert_ranks = self.expert * self.expert_tensor_size * self.pipeline
        if world_size % expert_ranks:
            raise LaunchError(
                f"world size {world_size} is not divisible by EP*ETP*PP = {self.expert}*{self.expert_tensor_size}*"
                f"{self.pipeline} = {expert_ranks}; set parallel.expert/expert_tensor to divide it")
        return world_size // self.model_parallel_size

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Replicas of each expert (its gradients are reduced over them)."""
        self.data_parallel_size(world_size)
        return world_size // (self.expert * self.expert_tensor_size * self.pipeline)


def initialize_model_parallel(layout: ParallelLayout, seed: int = 1234, timeout_minutes: float = 30.0) -> None:
    """Sets up megatron's process groups over the already-initialised default group, then seeds.
    `timeout_minutes`: their collectives' timeout (megatron annotates an int; a timedelta takes any).

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
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
        distributed_timeout_minutes=timeout_minutes,
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
