"""A recipe's memory plan on a cluster: every distinct pipeline stage simulated (plan/stage.py),
the engines and the weight sync in arithmetic (plan/engines.py), and the verdict."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.launch.parallel import ParallelLayout
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.plan.cluster import Cluster, Placement, model_config_dict, placement
from megatron_grpo.plan.engines import EnginePlan, SyncPlan, engine_plan, sync_plan
from megatron_grpo.plan.stage import StageJob, StageMemory, simulate_stage


@dataclass
class RecipePlan:
    config: Config
    cluster: Cluster
    placement: Placement
    layout: ParallelLayout
    model_source: str
    arch: ModelArchitecture
    stages: list[StageMemory]
    engines: EnginePlan | None
    sync: SyncPlan | None
    seconds: float

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.peak.peak_bytes)

    @property
    def fits(self) -> bool:
        engines_ok = self.engines is None or self.engines.fits
        return self.trainer_fits and engines_ok

    @property
    def trainer_fits(self) -> bool:
        # Colocated engines release their weights and KV cache while the trainer runs
        # (release_memory_occupation), so the trainer has the same budget either way.
        return self.peak_stage.peak.peak_bytes <= self.cluster.trainer_budget_bytes


def layout_of(cfg: Config) -> ParallelLayout:
    p = cfg.parallel
    return ParallelLayout(tensor=p.tensor, pipeline=p.pipeline, virtual_pipeline=p.virtual_pipeline,
                          context=p.context, sequence_parallel=p.sequence_parallel, expert=p.expert,
                          expert_tensor=p.expert_tensor)


def model_dtype(cfg: Config) -> torch.dtype:
    """The GPU's dtype for the recipe (model.dtype auto = bf16 on CUDA, as trainer/setup.py)."""
    return torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16


def plan_recipe(cfg: Config, cluster: Cluster, progress: Callable[[str], None] = lambda _: None) -> RecipePlan:
    start = time.perf_counter()
    where = placement(cfg, cluster)
    layout = layout_of(cfg)
    layout.data_parallel_size(where.trainer_gpus)  # a clear error when the layout does not divide
    hf, source = model_config_dict(cfg)
    arch = ModelArchitecture.from_hf(hf, tensor_parallel=layout.tensor,
                                     vocab_multiple=cfg.model.make_vocab_size_divisible_by)
    job = StageJob(cfg, arch, layout, world_size=where.trainer_gpus, dtype=model_dtype(cfg))
    stages = []
    for stage in range(layout.pipeline):
        progress(f"simulating pipeline stage {stage + 1}/{layout.pipeline} ...")
        stages.append(simulate_stage(job, stage))
        progress(f"  stage {stage + 1}: {stages[-1].seconds:.1f} s")
    return RecipePlan(config=cfg, cluster=cluster, placement=where, layout=layout, model_source=source, arch=arch,
                      stages=stages, engines=engine_plan(cfg, arch, cluster),
                      sync=sync_plan(cfg, arch, where, cluster), seconds=time.perf_counter() - start)
