"""After each step: the policy's Megatron shards -> HF-named full tensors -> the rollout engine.

Uses convert/'s streaming export, so the local engine on a CPU run goes through exactly the
resharding that feeds SGLang on a cluster. Every rank must take part (TP gathers, PP sends), so
a failure on rank 0 (e.g. every SGLang engine gone) is held until the stream is drained, then
raised on every rank as RolloutFailure.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_grpo.convert.export import gather_hf_weights_on_rank0
from megatron_grpo.errors import MegatronGRPOError, RolloutFailure
from megatron_grpo.launch.distributed import broadcast_from_rank0


def sync_weights(run, version: int) -> dict[str, float]:
    """Pushes the policy as weight version `version`; returns the engine's sync metrics (rank 0)."""
    tensors = gather_hf_weights_on_rank0(run.policy, run.model_config, dtype=None)
    failure, metrics = None, {}
    if dist.get_rank() == 0:
        try:
            run.engine.update_weights(tensors, version)
            metrics = run.engine.sync_metrics()
        except MegatronGRPOError as exc:
            failure = RolloutFailure(f"weight sync of version {version} failed: {exc}")
    # The generator must be exhausted everywhere (it holds collectives), on rank 0 too.
    for _ in tensors:
        pass
    failure = broadcast_from_rank0(failure)
    if failure is not None:
        raise failure
    return metrics
