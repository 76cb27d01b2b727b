"""The GRPO training loop, top to bottom (docs/architecture.md, "One step"):

    prompts -> rollout (n per prompt, with log-probs) -> rewards -> group advantages (+ DAPO filter)
    -> old / reference log-probs (only when needed) on this data-parallel rank's share
    -> (KL in the reward) advantages again, from the scores minus the KL penalty
    -> packed, token-balanced micro-batches -> ppo_epochs x mini-batch updates
    -> weight sync to the rollout engine -> metrics -> eval

With rollout.max_staleness = K > 0 the rollout of the next steps runs during the update
(trainer/rollouts/rollout_pipeline.py); K = 0 is the loop above, step after step.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_grpo.config import to_dict
from megatron_grpo.config.schema import Config
from megatron_grpo.errors import RolloutFailure
from megatron_grpo.launch.collectives import agree, attempt_on_rank0, broadcast_from_rank0, on_rank0, rank0_only
from megatron_grpo.launch.watchdog import HangWatchdog, is_collective_timeout
from megatron_grpo.lora.adapters import adapters_off
from megatron_grpo.trainer.step.flops import peak_flops_per_device, training_flops
from megatron_grpo.trainer.state.checkpoint import Checkpointer
from megatron_grpo.trainer.preflight import check_before_training
from megatron_grpo.trainer.metrics import MetricsLogger, NullLogger, SinkOptions, write_reward_curve
from megatron_grpo.trainer.batches.micro_batches import padding_metrics, plan_micro_batches
from megatron_grpo.trainer.state.resume import resume
from megatron_grpo.trainer.engines.local_engine import trainer_threads
from megatron_grpo.trainer.rollouts.rollout_phase import collect_rollout_batch
from megatron_grpo.trainer.rollouts.rollout_pipeline import RolloutPipeline
from megatron_grpo.trainer.setup import Run, build_run, first_mini_batch_has_old_pass, old_logprobs_needed
from megatron_grpo.trainer.signals import StopSignals
from megatron_grpo.trainer.step.reward_kl import apply_kl_in_reward
from megatron_grpo.trainer.step.mismatch import MismatchHealth
from megatron_grpo.trainer.step.train_step import fill_logprobs, holds_distinct_tokens, train_on_mini_batch
from megatron_grpo.trainer.step_settings import global_batch_info
from megatron_grpo.trainer.sync.weight_sync import release_engine_for_training, sync_weights


def train(cfg: Config) -> Path:
    """Runs the recipe; returns the output folder (metrics.jsonl, reward curve)."""
    threads = trainer_threads(cfg)
    if threads is not None:
        torch.set_num_threads(threads)
    run = build_run(cfg)  # rank 0 holds the run folder from here on (trainer/state/run_lock.py)
    try:
        return _train(run)
    finally:
        run.release_folder()  # after the run's last write there (the reward curve)


def _train(run: Run) -> Path:
    cfg = run.config
    out = Path(cfg.logging.output_dir)
    checkpoints, stop = Checkpointer(run), StopSignals().install()
    logger = NullLogger()
    pipeline = None
    watchdog = start_watchdog(out, cfg.trainer.hang_timeout_s)
    try:
        watchdog.phase("resume", 0)
        start = resume(run, checkpoints)  # newest complete checkpoint (checkpoint.resume); 0 = fresh
        preflight = check_before_training(run, version=start) if cfg.trainer.preflight else {}
        sinks = SinkOptions(output_dir=str(out), console=cfg.logging.console, tensorboard=cfg.logging.tensorboard,
                            wandb_project=cfg.logging.project if cfg.logging.wandb else None,
                            wandb_run_name=cfg.logging.experiment_name, run_config=to_dict(cfg))
        logger = rank0_only(MetricsLogger, sinks, run.total_steps, start) or logger  # rank 0's failure stops all
        if preflight:
            logger.log(start, preflight)
        if cfg.eval.before_train and start == 0:
            logger.log(0, evaluate_policy(run))
        if run.settings.asynchronous and run.is_main:
            pipeline = RolloutPipeline(run, run.settings.rollout, start_step=start,
                                       max_staleness=cfg.rollout.max_staleness).start()
        for step in range(start + 1, run.total_steps + 1):
            try:
                metrics = grpo_step(run, step, pipeline, phase=watchdog.phase)
            except RolloutFailure:
                if step - 1 > start and not checkpoints.due(step - 1):
                    checkpoints.save(step - 1)  # keep the finished steps, then fail cleanly
                raise
            if cfg.eval.interval > 0 and (step % cfg.eval.interval == 0 or step == run.total_steps):
                watchdog.phase("eval", step)
                with pipeline.paused() if pipeline is not None else contextlib.nullcontext():
                    metrics.update(evaluate_policy(run))
            watchdog.phase("metrics", step)
            logger.log(step, metrics)
            stopping = stop.requested()  # SIGTERM / SIGUSR1 on any rank; every rank agrees
            if checkpoints.due(step) or stopping:
                watchdog.phase("save", step)
                checkpoints.save(step)
            if stopping:
                logger.message(f"stopped by {stop.name} after step {step}; checkpoint {checkpoints.last_saved}")
                break
    except Exception as exc:
        if is_collective_timeout(exc):  # reported as the watchdog reports a hang, exit 3
            watchdog.report(f"a collective timed out ({str(exc).strip().splitlines()[0][:200]})")
        raise
    finally:
        watchdog.stop()
        if pipeline is not None:
            pipeline.close()  # before the engine it generates with
        stop.uninstall()
        logger.close()
        if run.stage_sync is not None:
            run.stage_sync.close()
        run.close()
    if run.is_main and cfg.logging.plot:
        write_reward_curve(out)
    return out


def grpo_step(run: Run, step: int, pipeline: RolloutPipeline | None = None,
              phase: Callable[..., None] = lambda *_: None) -> dict[str, float]:
    """One step; with `pipeline` (rank 0, asynchronous rollouts) its batch was generated ahead.
    `phase(name, step, detail)` at each phase change: the hang watchdog's heartbeat."""
    cfg = run.config
    timer = PhaseTimer()
    step_start = time.perf_counter()
    phase("rollout", step)

    # 1. rollout + rewards + advantages on rank 0 (or the pipeline's batch); every rank gets the batch.
    with timer("rollout"):
        # token ids and floats (small) to every rank; rank 0's failure (e.g. every SGLang server
        # gone) stops all of them as a RolloutFailure, which the loop checkpoints before
        outcome = agree(attempt_on_rank0(_rollout_batch, run, step, pipeline, phase) if run.is_main else None)
        if outcome.error is not None:
            raise RolloutFailure(str(outcome.error))
        batch = outcome.value
    release_engine_for_training(run)  # colocated SGLang: the GPU to training; resumed by the weight sync
    metrics = dict(batch.metrics)

    # 2. old / reference log-probs (forward only, each pass with its own token budget) on the
    # samples of this data-parallel rank's share.
    phase("logprob", step)
    with timer("logprob"):
        measured = first_mini_batch_has_old_pass(cfg, step)
        # the KL in the reward reads every sample's old log-probs before the first update
        every_mini_batch = measured or run.kl_controller is not None
        if old_logprobs_needed(cfg) or every_mini_batch:
            # Until the first update the policy is the one that sampled, so with one epoch the
            # first mini-batch uses its own detached log-probs as "old"; only later ones need a
            # pass, unless this step measures the ratio invariant against a real one.
            _fill_logprobs(run, run.policy, batch.samples, "old_logprobs",
                           skip_mini_batches=0 if every_mini_batch else 1)
        if run.reference is not None:
            with _on_device(run.reference, run.device, offloaded=cfg.ref.param_offload), adapters_off(run.reference):
                _fill_logprobs(run, run.reference, batch.samples, "ref_logprobs")
    if run.kl_controller is not None:  # algorithm.use_kl_in_reward: advantages from the penalised scores
        metrics.update(apply_kl_in_reward(batch, run.kl_controller, cfg.algorithm.kl_penalty, run.settings.rollout))

    # 3. this rank's share as micro-batches per mini-batch (packed by default).
    mini_batches = plan_micro_batches(batch.samples, cfg, model_config=run.model_config)
    metrics.update(padding_metrics(mini_batches))

    # 4. ppo_epochs x mini-batch updates.
    # weight versions each sample is behind the trained weights (version step - 1): asynchronous only
    staleness = [step - 1 - v for v in batch.versions] if run.settings.asynchronous else None
    # every trained token's trainer-vs-engine log-prob difference, on the first pass (step-start weights)
    mismatch = MismatchHealth([s.engine for s in batch.samples], staleness)
    with timer("train"):
        updates = []
        for epoch in range(cfg.actor.ppo_epochs):
            for m, micro_batches in enumerate(mini_batches):
                where = f"epoch {epoch + 1}, mini-batch {m + 1}/{len(mini_batches)}"

                def progress(k, n, where=where):
                    phase("train", step, f"{where}, micro-batch {k}/{n}")

                phase("train", step, where)
                updates.append(train_on_mini_batch(
                    run.policy, run.optimizer, micro_batches, loss_config=run.settings.loss,
                    batch_info=global_batch_info(micro_batches, cfg),
                    temperature=cfg.rollout.temperature, vocab_size=run.model_config.vocab_size,
                    device=run.device, need_entropy=True, sample_staleness=staleness,
                    mismatch=mismatch if epoch == 0 else None, progress=progress))
        run.scheduler.step(1)
    metrics.update(_mean_over_updates(updates))
    metrics.update(mismatch.reduce(contributes=holds_distinct_tokens()))
    if measured:  # max |ratio - 1| at the first mini-batch: the update's forward vs the old-log-prob pass
        metrics["invariant/ratio_dev_first_minibatch"] = updates[0]["actor/ratio_max_abs_dev"]
    if step == 1 and "actor/kl" in updates[0]:
        metrics["invariant/kl_at_step1"] = updates[0]["actor/kl"]
    metrics["actor/lr"] = run.optimizer.param_groups[0]["lr"]

    # 5. new weights to the rollout engine.
    phase("sync", step)
    with timer("sync"):
        metrics.update(sync_weights(run, version=step))
    if pipeline is not None:
        pipeline.weights_published(step)

    metrics.update(timer.seconds)
    metrics["time/step"] = time.perf_counter() - step_start
    lengths = [s.length for s in batch.samples]
    metrics["perf/tokens_per_s"] = sum(lengths) / metrics["time/step"]
    per_device = cfg.actor.ppo_epochs * training_flops(run.model_config, lengths) / dist.get_world_size()
    metrics["perf/train_tflops_per_device"] = per_device / metrics["time/train"] / 1e12
    peak = peak_flops_per_device(run.device)
    if peak:
        metrics["perf/mfu"] = per_device / metrics["time/train"] / peak
    return metrics


def _rollout_batch(run: Run, step: int, pipeline: RolloutPipeline | None, phase: Callable[..., None]):
    """Rank 0: this step's batch, from the pipeline (asynchronous) or generated now."""
    if pipeline is not None:
        return pipeline.next_batch(step)
    # partial rollouts at max_staleness 0 (allow_off_policy): carried tokens at most one version old
    lag = run.settings.carried_staleness
    return collect_rollout_batch(run.engine, lambda: next(run.sampler), run.tokenizer,
                                 PhasedRewards(run.rewards, lambda name: phase(name, step)),
                                 run.settings.rollout, step, run.config.data.train_batch_size,
                                 min_weight_version=None if lag is None else step - 1 - lag, carry=run.carry_over)


class PhasedRewards:
    """The reward runner, telling the heartbeat when a batch is scored after its generation."""

    def __init__(self, runner, phase: Callable[[str], None]):
        self._runner, self._phase = runner, phase

    def score(self, requests):
        self._phase("reward")
        try:
            return self._runner.score(requests)
        finally:
            self._phase("rollout")

    def __getattr__(self, name):  # stream() and the rest, unchanged
        return getattr(self._runner, name)


def start_watchdog(out: Path, timeout_s: float) -> HangWatchdog:
    """Collective: every rank's watchdog over the heartbeats of this life of the run (its name from rank 0)."""
    life = broadcast_from_rank0(time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    return HangWatchdog(out / "heartbeats" / life, out / "hangs" / life, dist.get_rank(), dist.get_world_size(),
                        timeout_s).start()


def _fill_logprobs(run: Run, model_chunks, samples, name: str, skip_mini_batches: int = 0) -> None:
    fill_logprobs(model_chunks, samples, run.config, name, model_config=run.model_config,
                  temperature=run.config.rollout.temperature, device=run.device, skip_mini_batches=skip_mini_batches)


def _mean_over_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for u in updates for k in u}
    out = {k: sum(u[k] for u in updates if k in u) / sum(1 for u in updates if k in u) for k in keys}
    out["actor/updates_skipped"] = sum(u["actor/update_skipped"] for u in updates)
    out.pop("actor/update_skipped", None)
    return out


def evaluate_policy(run: Run) -> dict[str, float]:
    from megatron_grpo.trainer.evaluation.evaluate import evaluate

    return on_rank0(evaluate, run)  # rank 0's failure stops every rank


@contextlib.contextmanager
def _on_device(model_chunks, device: torch.device, offloaded: bool):
    """Moves CPU-offloaded chunks to `device` for the duration of the block (ref.param_offload)."""
    if offloaded:
        for chunk in model_chunks:
            chunk.to(device)
    try:
        yield
    finally:
        if offloaded:
            for chunk in model_chunks:
                chunk.to("cpu")


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{phase}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
