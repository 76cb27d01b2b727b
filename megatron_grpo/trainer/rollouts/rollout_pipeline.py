"""Asynchronous GRPO (rollout.max_staleness = K > 0): the batches of the next steps are generated on
global rank 0 while the current step trains.

Bounded staleness. Step j trains the weights of version j - 1 (the ones step j - 1 synced). A
producer thread makes step j's batch (prompts, generation, rewards, advantages:
rollout_phase.collect_rollout_batch) once the engine holds a version >= j - 1 - K, and the trainer
publishes each version right after its sync, so every sample of step j was generated at most K
versions before the weights it is trained on (its staleness, (j - 1) - weight_version, is <= K).
Groups holding an older sample are dropped and counted (rollout/dropped_stale) and refilled with
fresh prompts; with the local engine one generate call uses one version, so the gating alone keeps
the bound and nothing is dropped; an SGLang request continued across syncs keeps its oldest version
and can be dropped. K = 1 is one-step off-policy (verl): step j's batch is generated while step
j - 1 trains. K = 0 never builds this pipeline (the synchronous loop).

Engines. A generate call of the producer may run while the trainer syncs weights: the local engine
in its own process stages the new version and applies it before its next generate call (the call in
flight finishes under the old version, whose staleness counts); SGLang aborts the requests in flight
at a sync (pause_generation mode=abort) and the engine resubmits their groups (EngineOptions.
resubmit_aborted, on for K > 0), which SGLang holds until generation continues: they come back whole
from the new weights, and the partial generation is lost (the cost: up to one response length of
generation per aborted group and sync). Evaluation pauses the producer
between batches (`paused`), so eval generates alone with the newest weights.

Resume. The producer draws prompts from a copy of the run's sampler; run.sampler (what a checkpoint
saves) moves on only when a step takes its batch. Batches generated but not yet trained when the run
stops (at most K + 1, in flight) are discarded: on resume their prompts are drawn again and generated
by the restored weights. No prompt is trained twice, none is skipped; the generation work in flight
at the stop is lost.

Metrics (rank 0, per step): staleness/{mean,max}, rollout/dropped_stale, time/wait_rollout (the
trainer waited for its batch), time/engine_wait_weights (the producer waited for the weights the
batch needed), time/generate (the batch's generation, overlapped with training).
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from megatron_grpo.errors import MegatronGRPOError
from megatron_grpo.trainer.rollouts.long_tail import CarryOver
from megatron_grpo.trainer.rollouts.rollout_phase import RolloutBatch, RolloutSettings, collect_rollout_batch

log = logging.getLogger(__name__)


class _Stopped(Exception):
    """The pipeline is closing: the producer leaves the batch it was making."""


@dataclass
class _Made:
    batch: RolloutBatch
    sampler_state: dict  # the producer's sampler right after this batch's prompts
    carry_state: dict | None  # rollout.long_tail: what the producer carried on right after this batch


class RolloutPipeline:
    """See the module docstring. Rank 0 only; start() runs the producer thread."""

    def __init__(self, run, settings: RolloutSettings, *, start_step: int, max_staleness: int):
        self.run = run
        self.settings = settings
        self.max_staleness = max_staleness
        self.last_step = run.total_steps
        self._sampler = copy.copy(run.sampler)  # shares the prompts; positions are its own
        self._carry = None  # rollout.long_tail: the producer's own carried groups, from the run's (checkpointed)
        if run.carry_over is not None:
            self._carry = CarryOver()
            self._carry.load_state_dict(run.carry_over.state_dict())
        self._published = start_step  # the weight version the engine holds (restored / start)
        self._start = start_step
        self._made: dict[int, _Made | BaseException] = {}
        self._cond = threading.Condition()
        self._busy = threading.Lock()  # held while a batch is made; paused() takes it
        self._stopping = False
        self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)

    def start(self) -> "RolloutPipeline":
        self._thread.start()
        return self

    def min_version(self, step: int) -> int:
        """The oldest weight version step `step` may train on (never below the start's)."""
        return max(self._start, step - 1 - self.max_staleness)

    # ----- the trainer's side ---------------------------------------------------------------
    def next_batch(self, step: int) -> RolloutBatch:
        """Step `step`'s batch (waits for it); run.sampler moves past its prompts."""
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: step in self._made)
            made = self._made.pop(step)
        if isinstance(made, BaseException):
            raise made
        self.run.sampler.load_state_dict(made.sampler_state)
        if made.carry_state is not None:
            self.run.carry_over.load_state_dict(made.carry_state)
        batch = made.batch
        staleness = [step - 1 - v for v in batch.versions]
        batch.metrics["staleness/mean"] = sum(staleness) / len(staleness)
        batch.metrics["staleness/max"] = float(max(staleness))
        batch.metrics["time/wait_rollout"] = time.perf_counter() - start
        return batch

    def weights_published(self, version: int) -> None:
        """The engine holds weight version `version` (the trainer's sync of it returned)."""
        with self._cond:
            self._published = version
            self._cond.notify_all()

    @contextmanager
    def paused(self):
        """No batch is being made inside the block (the engine and rewards are the caller's)."""
        with self._busy:
            yield

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            try:
                self.run.engine.abort()  # end a generate call in flight
            except MegatronGRPOError as exc:
                log.warning("stopping the rollout producer: abort failed (%s)", exc)
            self._thread.join(timeout=60.0)
        if self._carry is not None and not self._thread.is_alive():
            self._carry.close()  # the producer's carried episodes' environments

    # ----- the producer ---------------------------------------------------------------------
    def _next_prompts(self):
        if self._stopping:
            raise _Stopped()
        return next(self._sampler)

    def _produce(self) -> None:
        run, cfg = self.run, self.run.config
        for step in range(self._start + 1, self.last_step + 1):
            needed = self.min_version(step)
            waited = time.perf_counter()
            with self._cond:
                self._cond.wait_for(lambda needed=needed: self._stopping or self._published >= needed)
                if self._stopping:
                    return
            waited = time.perf_counter() - waited
            try:
                with self._busy:
                    start = time.perf_counter()
                    batch = collect_rollout_batch(run.engine, self._next_prompts, run.tokenizer, run.rewards,
                                                  self.settings, step, cfg.data.train_batch_size,
                                                  min_weight_version=needed, in_trainer_thread=False,
                                                  carry=self._carry)
                    batch.metrics["time/generate"] = time.perf_counter() - start
                    batch.metrics["time/engine_wait_weights"] = waited
                    made: _Made | BaseException = _Made(batch, self._sampler.state_dict(),
                                                        self._carry.state_dict() if self._carry is not None else None)
            except _Stopped:
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
                if self._stopping:
                    return
                made = exc
            with self._cond:
                self._made[step] = made
                self._cond.notify_all()
            if isinstance(made, BaseException):
                return
