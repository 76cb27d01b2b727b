"""Each pipeline stage streams its own HF tensors from one rank: no hop through global rank 0.

stage_hf_weights(chunks, cfg)
    This stage's HF tensors (convert/export.py export_hf_weights: its layers with global HF indices,
    the embedding on the first stage, final norm / untied lm_head on the last), yielded only on the
    stage's SENDER: tensor-parallel rank 0 of the first data-parallel (and context-parallel)
    replica. The other TP ranks of that replica must exhaust it too (they take part in the TP
    all-gathers, and with expert parallelism the EP ranks in the EP gathers); every other replica
    does no work at all, so DP replicas do not all send.

WholeModelRole is the colocated counterpart: every rank streams the whole model
(export.hf_weights_on_every_rank), since each feeds the engine rank on its own GPU.

Compared with gather_hf_weights_on_rank0 (every stage's tensors sent to global rank 0 point to
point, one stage after another), the stages export in parallel and each sender pushes straight to
the rollout engines, so the sync time stops growing with the number of stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from megatron_grpo.convert.export import export_hf_weights, hf_weights_on_every_rank
from megatron_grpo.models.hf_config import ModelArchitecture


@dataclass(frozen=True)
class StageRole:
    """What this rank does in a per-stage export."""

    stage: int  # pipeline stage (rank in the pipeline group)
    num_stages: int
    exports: bool  # takes part in the stage's export (TP / EP gathers)
    sends: bool  # yields the tensors (one rank per stage)

    @classmethod
    def current(cls) -> "StageRole":
        from megatron.core import parallel_state as ps

        expert_parallel = ps.get_expert_model_parallel_world_size() > 1
        if expert_parallel:  # every EP rank holds other experts: all of one expert-DP replica export
            exports = ps.get_expert_data_parallel_rank() == 0
        else:
            exports = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        sends = (exports and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                 and ps.get_context_parallel_rank() == 0)
        return cls(stage=ps.get_pipeline_model_parallel_rank(), num_stages=ps.get_pipeline_model_parallel_world_size(),
                   exports=exports, sends=sends)

    @property
    def label(self) -> str:
        return f"stage {self.stage}"

    def export(self, model_chunks: Sequence[torch.nn.Module],
               cfg: ModelArchitecture) -> Iterator[tuple[str, torch.Tensor]]:
        return stage_hf_weights(model_chunks, cfg, role=self)


@dataclass(frozen=True)
class WholeModelRole:
    """Every rank exports (and yields) the whole model; `label` names what this rank feeds."""

    label: str
    sends: bool  # this rank has a sink (an engine rank on its GPU)
    stage: int = 0  # one turn: all senders at once
    num_stages: int = 1

    def export(self, model_chunks: Sequence[torch.nn.Module],
               cfg: ModelArchitecture) -> Iterator[tuple[str, torch.Tensor]]:
        return hf_weights_on_every_rank(model_chunks, cfg)


def stage_hf_weights(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture, dtype: torch.dtype | None = None,
                     role: StageRole | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) of this stage on its sender; see the module docstring."""
    role = role or StageRole.current()
    if not role.exports:
        return
    for name, tensor in export_hf_weights(model_chunks, cfg, dtype):
        if role.sends:
            yield name, tensor
