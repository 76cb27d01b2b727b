"""After each step: the policy's Megatron shards -> HF-named full tensors -> the rollout engine.

Uses convert/'s streaming export, so the local engine on a CPU run goes through exactly the
resharding that feeds SGLang on a cluster. Every rank must take part (TP gathers, PP sends), so a
failure on rank 0 (an SGLang engine died mid-push) is held until the stream is drained and then
told to every rank: all ranks export again and rank 0 pushes again (the engine pool restarts or
drops the dead engine first), up to `attempts` times; then RolloutFailure on every rank.
"""
from __future__ import annotations

import logging

import torch.distributed as dist

from megatron_grpo.convert.export import gather_hf_weights_on_rank0
from megatron_grpo.errors import MegatronGRPOError, Rank0Failure, RolloutFailure
from megatron_grpo.launch.distributed import broadcast_from_rank0

log = logging.getLogger(__name__)


def sync_weights(run, version: int, attempts: int = 2) -> dict[str, float]:
    """Pushes the policy as weight version `version`; returns the engine's sync metrics (rank 0)."""
    error = None
    for attempt in range(attempts):
        tensors = gather_hf_weights_on_rank0(run.policy, run.model_config, dtype=None)
        error, unexpected, metrics = None, None, {}
        if dist.get_rank() == 0:
            try:
                run.engine.update_weights(tensors, version)
                metrics = run.engine.sync_metrics()
            except MegatronGRPOError as exc:
                error = str(exc)
            except Exception as exc:  # not the engine's known failure: no retry; every rank stops
                unexpected, error = exc, f"{type(exc).__name__}: {exc}"
        # The generator must be exhausted everywhere (it holds collectives), on rank 0 too.
        for _ in tensors:
            pass
        error, fatal = broadcast_from_rank0((error, unexpected is not None))
        if unexpected is not None:
            raise unexpected
        if fatal:
            raise Rank0Failure(f"weight sync of version {version} failed on rank 0: {error}")
        if error is None:
            if attempt:
                metrics["sync/retries"] = float(attempt)
            return metrics
        if dist.get_rank() == 0 and attempt + 1 < attempts:
            log.warning("weight sync of version %d failed (%s); pushing again", version, error)
    raise RolloutFailure(f"weight sync of version {version} failed {attempts} times: {error}")


def ensure_engine_holds_the_start(run) -> None:
    """A fresh start samples step 1 with the weights the policy starts from (version 0). Engines
    given by URL may hold something else (another run's weights): then they get the policy."""
    stale = None
    if dist.get_rank() == 0:
        health = run.engine.health()
        stale = health.weight_version != 0
        if stale:
            log.warning("the rollout engines report weight version %s, not the starting weights: pushing them "
                        "(%s)", health.weight_version, health.detail)
    if broadcast_from_rank0(stale):
        sync_weights(run, version=0)
