"""After each step: the policy's Megatron shards -> HF-named full tensors -> the rollout engine.

Uses convert/'s streaming export, so the local engine on a CPU run goes through exactly the
resharding that feeds SGLang on a cluster. Three routes (rollout.weight_sync_route):
  rank0      every stage's tensors through global rank 0, which pushes them (gather_hf_weights_on_rank0);
  per_stage  each stage's sender pushes its own layers, all stages at once (trainer/sync/stage_sync.py);
  colocated  every rank whose GPU hosts an SGLang engine rank feeds it (trainer/sync/stage_sync.py).
Every rank must take part (TP gathers, PP sends), so a failure (an SGLang engine died mid-push) is
held until the stream is drained and then told to every rank: all ranks export again and push again
(the engine pool restarts or drops the dead engine first), up to `attempts` times, on any route;
then RolloutFailure on every rank.
"""
from __future__ import annotations

import logging

import torch.distributed as dist

from megatron_grpo.config.derived import engine_memory_released
from megatron_grpo.convert.export import gather_hf_weights_on_rank0
from megatron_grpo.errors import MegatronGRPOError, Rank0Failure, RolloutFailure
from megatron_grpo.launch.collectives import agree, all_gather_objects, attempt_on_rank0, broadcast_from_rank0
from megatron_grpo.trainer.sync.stage_sync import StageSync

log = logging.getLogger(__name__)


def release_engine_for_training(run) -> None:
    """Colocated SGLang engines on GPUs (config.derived.engine_memory_released) give the GPU to training
    after a rollout; the next sync resumes them."""
    if run.is_main and engine_memory_released(run.config):
        run.engine.release_memory()


def sync_weights(run, version: int, attempts: int = 2) -> dict[str, float]:
    """Pushes the policy as weight version `version`; returns the engine's sync metrics (rank 0).
    One attempt failing with an engine's known error (_SyncFailure, on every rank) is retried."""
    error = None
    for attempt in range(attempts):
        try:
            if run.stage_sync is not None:
                metrics = _one_stage_sync(run, run.stage_sync, version)
            else:
                metrics = _one_rank0_sync(run, version)
        except _SyncFailure as exc:
            error = str(exc)
            if dist.get_rank() == 0 and attempt + 1 < attempts:
                log.warning("weight sync of version %d failed (%s); pushing again", version, error)
            continue
        if attempt:
            metrics["sync/retries"] = float(attempt)
        return metrics
    raise RolloutFailure(f"weight sync of version {version} failed {attempts} times: {error}")


class _SyncFailure(MegatronGRPOError):
    """One attempt of a sync failed on every rank (message: where and why); it is tried again."""


def _one_rank0_sync(run, version: int) -> dict[str, float]:
    """Every stage's tensors through global rank 0, which pushes them (the rank0 route)."""
    tensors = gather_hf_weights_on_rank0(run.policy, run.model_config, dtype=None)
    outcome = attempt_on_rank0(_push_and_report, run.engine, tensors, version) if dist.get_rank() == 0 else None
    for _ in tensors:  # the generator holds collectives: exhausted on every rank, rank 0 too
        pass
    outcome = agree(outcome, share_value=False)  # a bug stops every rank
    if outcome.error is not None:
        raise _SyncFailure(str(outcome.error))
    return outcome.value or {}


def _push_and_report(engine, tensors, version: int) -> dict[str, float]:
    engine.update_weights(tensors, version)
    return engine.sync_metrics()


def _on_rank0_agreed(fn, *args):
    """fn(*args) on rank 0; its result (or its project error, as _SyncFailure) on every rank."""
    outcome = agree(attempt_on_rank0(fn, *args) if dist.get_rank() == 0 else None)
    if outcome.error is not None:
        raise _SyncFailure(str(outcome.error))
    return outcome.value


def _one_stage_sync(run, stage_sync: StageSync, version: int) -> dict[str, float]:
    engine = run.engine if dist.get_rank() == 0 else None
    role, sink = stage_sync.role, stage_sync.sink
    targets = _on_rank0_agreed(lambda: engine.prepare_stage_update(version))

    def rebuild() -> str | None:  # an engine was restarted or dropped: new groups
        if targets is not None and sink is not None:
            try:
                sink.set_targets(targets)
            except MegatronGRPOError as exc:
                return f"{role.label}: {exc}"
        return None

    rebuild_errors = [e for e in all_gather_objects(stage_sync.stage_by_stage(rebuild)) if e]
    if rebuild_errors:
        _on_rank0_agreed(lambda: engine.abort_stage_update(version))  # the next attempt rebuilds again
        raise _SyncFailure(rebuild_errors[0])
    sample = _on_rank0_agreed(lambda: engine.begin_stage_update(version))  # a weight sample to fill, or None

    outcome, unexpected = stage_sync.stage_by_stage(lambda: _push_stage(run, role, sink, sample, version))
    gathered = all_gather_objects((outcome, unexpected is not None))
    fatal = [o for o, bad in gathered if bad]
    if unexpected is not None:
        raise unexpected
    if fatal:
        raise Rank0Failure(f"weight sync of version {version} failed: {fatal[0]}")
    failures = [o for o, _ in gathered if isinstance(o, str)]
    results = [o for o, _ in gathered if isinstance(o, tuple)]
    if failures:
        _on_rank0_agreed(lambda: engine.abort_stage_update(version))
        raise _SyncFailure(failures[0])
    _on_rank0_agreed(lambda: engine.end_stage_update(version, results))
    return engine.sync_metrics() if engine is not None else {}


def _push_stage(run, role, sink, sample, version: int):
    """This rank's part of the push: (outcome, unexpected error or None)."""
    stream = role.export(run.policy, run.model_config)
    outcome, unexpected = None, None
    if sink is not None:
        try:
            stats = sink.push(sample.tap(stream) if sample is not None else stream, version)
            outcome = (role.stage, stats, sample)  # the sample this sender filled (or None)
        except MegatronGRPOError as exc:
            outcome = f"{role.label}: {exc}"
        except Exception as exc:  # noqa: BLE001 - every rank stops (in _one_stage_sync)
            unexpected, outcome = exc, f"{role.label} (rank {dist.get_rank()}): {type(exc).__name__}: {exc}"
    for _ in stream:  # the export holds TP collectives: drained on every rank that exports
        pass
    return outcome, unexpected


def ensure_engine_holds_the_start(run) -> None:
    """A fresh start samples step 1 with the weights the policy starts from (version 0). Engines
    given by URL may hold something else: another run's weights, or another checkpoint (a server
    reports version 0 for whatever it was started on), so they always get the policy once."""
    stale = None
    if dist.get_rank() == 0:
        health = run.engine.health()
        given_by_url = run.config.rollout.engine == "sglang" and bool(run.config.rollout.sglang.urls)
        stale = health.weight_version != 0 or given_by_url
        if health.weight_version != 0:
            log.warning("the rollout engines report weight version %s, not the starting weights: pushing them "
                        "(%s)", health.weight_version, health.detail)
        elif stale:
            log.info("rollout.sglang.urls: pushing the starting weights once (version 0 does not say which "
                     "checkpoint a server was started on)")
    if broadcast_from_rank0(stale):
        sync_weights(run, version=0)
