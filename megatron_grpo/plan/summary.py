"""The plan's figures as a JSON-ready dict (plan --json; the trainer's cached check reads it)."""
from __future__ import annotations

import dataclasses

from megatron_grpo.plan.recipe_plan import RecipePlan
from megatron_grpo.plan.report import verdict


def summary(plan: RecipePlan) -> dict:
    return {
        "fits": plan.fits,
        "verdict": verdict(plan),
        "cluster": dataclasses.asdict(plan.cluster),
        "placement": dataclasses.asdict(plan.placement),
        "model_source": plan.model_source,
        "seconds": round(plan.seconds, 1),
        "stages": [{"stage": s.stage, "rank": s.rank, "parameters": s.parameters, "resident_bytes": s.resident,
                    "peak_bytes": s.peak.peak_bytes, "peak_phase": s.peak.phase,
                    "phases": [{"phase": p.phase, "peak_bytes": p.peak_bytes, "by_category": p.by_category}
                               for p in s.phases],
                    "micro_batch_tokens": s.micro_batch_tokens, "train_micro_batches": s.train_micro_batches,
                    "save_host_bytes": s.save_host_bytes, "seconds": round(s.seconds, 1)} for s in plan.stages],
        "engines": None if plan.engines is None else dataclasses.asdict(plan.engines),
        "sync": None if plan.sync is None else dataclasses.asdict(plan.sync),
    }
