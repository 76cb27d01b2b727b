"""Preflight: is the engine-trainer pair sound before any update? (trainer.preflight=true runs it
before step 1; `megatron-grpo doctor RECIPE --mismatch` runs it alone.)

Four checks, each a figure against a bound derived from the model's dtype (sqrt(eps): 3.5e-4 for
fp32, 0.088 for bf16; a sound pair is far below it, a bug far above):

1. lr 0: `trainer.preflight_rounds` rounds of rollout -> the trainer's log-probs of the same
   tokens -> a weight sync of unchanged weights. The figure is the largest per-round p99 of
   |trainer - engine log-prob|; a second row is its trend (last round - first), which must not
   grow (a growing mismatch at unchanged weights is a sync or numerics bug).
2. weight round trip: every policy weight is negated (exactly reversible), synced, and a
   rollout's log-probs compared; then the weights are negated back and synced again. A tensor the
   sync does not deliver (SGLang skips a name it does not know, silently) keeps its old value in
   the engine and shows here; at lr 0 it would not.
3. trainer vs itself: the same sequences' log-probs under the recipe's micro-batching, the other
   layout (packed <-> padded) and one sequence per micro-batch; the largest |difference|. A
   batch-variant kernel shows here.
4. engine vs itself: the first prompt generated alone and inside the batch (same seed); the
   largest |log-prob difference| over the tokens both produced before they diverge.

"Engine log-prob" is the one of the distribution the trainer computes (TrainSample.rollout_logprobs):
the truncated one with sampling replay, the full one without; the truncation bias itself is what
mismatch/* shows during training. The trainer at TP=1 against the recipe's TP: with the local
engine (an HF model in one process) check 1 is that comparison; with SGLang it compares the
engine's TP with the trainer's. No TP=1 copy of the trainer is built (where TP is needed it would
not fit); tests/test_trainer_e2e.py holds every layout to one process.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_grpo.errors import MegatronGRPOError, RolloutFailure
from megatron_grpo.launch.collectives import agree, all_gather_objects, attempt_on_rank0
from megatron_grpo.trainer.batches.batching import TrainSample
from megatron_grpo.trainer.step.mismatch import DeltaStats
from megatron_grpo.trainer.step.train_step import fill_logprobs
from megatron_grpo.trainer.sync.weight_sync import release_engine_for_training, sync_weights

log = logging.getLogger(__name__)


class PreflightFailed(MegatronGRPOError):
    """A preflight figure exceeded its bound (the message is the table)."""


@dataclass(frozen=True)
class PreflightCheck:
    name: str
    figure: float
    bound: float
    what: str

    @property
    def ok(self) -> bool:
        return self.figure <= self.bound


def mismatch_bound(dtype: torch.dtype) -> float:
    """sqrt(eps) of the dtype: the classic bound for a computation that rounds in that dtype."""
    return math.sqrt(torch.finfo(dtype).eps)


def preflight_table(checks: list[PreflightCheck]) -> str:
    lines = ["| check | figure | bound | ok | what |", "|---|---|---|---|---|"]
    lines += [f"| {c.name} | {c.figure:.3g} | {c.bound:.3g} | {'ok' if c.ok else 'FAIL'} | {c.what} |" for c in checks]
    return "\n".join(lines)


def run_preflight(run, version: int) -> list[PreflightCheck]:
    """The four checks on this run (collective: every rank). The engine holds weight version
    `version` (the policy's weights) before and after; the prompts come from a copy of the sampler,
    so training sees the same data as without a preflight."""
    cfg = run.config
    bound = mismatch_bound(run.dtype)
    settings = run.settings.rollout
    prompts = copy.deepcopy(run.sampler) if run.is_main else None
    rounds, samples = [], []
    for _ in range(cfg.trainer.preflight_rounds):
        samples = _rollout(run, prompts, settings)
        rounds.append(_engine_vs_trainer(run, samples))
        sync_weights(run, version)  # learning rate 0: the same weights again
    p99 = [r.abs_quantile(0.99) for r in rounds]
    checks = [PreflightCheck("lr 0: engine vs trainer", max(p99), bound,
                             f"largest per-round p99 |log-prob difference|, {len(rounds)} rounds, "
                             f"{int(sum(r.count for r in rounds))} tokens"),
              PreflightCheck("lr 0: trend", max(0.0, p99[-1] - p99[0]), bound,
                             "p99 of the last round minus the first (a rising mismatch: a sync or numerics bug)")]
    _negate_policy(run)
    try:
        sync_weights(run, version)
        flipped = _engine_vs_trainer(run, _rollout(run, prompts, settings))
    finally:
        _negate_policy(run)
        sync_weights(run, version)
    checks.append(PreflightCheck("weight round trip", flipped.abs_quantile(0.99), bound,
                                 "p99 |log-prob difference| with every weight negated and synced (a tensor "
                                 "the sync misses keeps its old value in the engine)"))
    checks.append(PreflightCheck("trainer vs itself", _trainer_vs_itself(run, samples), bound,
                                 "largest |log-prob difference| between micro-batchings: the recipe's, "
                                 "packed <-> padded, one sequence each"))
    figure, tokens = _engine_vs_itself(run, prompts, settings)
    checks.append(PreflightCheck("engine vs itself", figure, bound,
                                 f"largest |log-prob difference|, the first prompt alone vs in the batch "
                                 f"({tokens} tokens before the samples diverge)"))
    return checks


def check_before_training(run, version: int) -> dict[str, float]:
    """trainer.preflight: the checks, their table on rank 0's log, and PreflightFailed (every rank)
    when a figure exceeds its bound; returns the figures as preflight/* metrics."""
    checks = run_preflight(run, version)
    table = preflight_table(checks)
    if run.is_main:
        log.info("preflight:\n%s", table)
    if not all(c.ok for c in checks):
        failed = ", ".join(c.name for c in checks if not c.ok)
        raise PreflightFailed(f"preflight failed ({failed}; bound sqrt(eps) of {run.dtype}):\n{table}")
    return {f"preflight/{c.name.replace(' ', '_').replace(':', '')}": c.figure for c in checks}


def _rollout(run, prompts, settings) -> list[TrainSample]:
    """One rollout batch of the recipe's size (rank 0 generates, every rank gets it)."""
    from megatron_grpo.trainer.rollouts.rollout_phase import collect_rollout_batch

    size = run.config.data.train_batch_size
    outcome = agree(attempt_on_rank0(collect_rollout_batch, run.engine, lambda: next(prompts), run.tokenizer,
                                     run.rewards, settings, 0, size) if run.is_main else None)
    if outcome.error is not None:
        raise RolloutFailure(f"preflight rollout: {outcome.error}")
    release_engine_for_training(run)
    return outcome.value.samples


def _holds_distinct_samples() -> bool:
    """Log-prob passes leave each DP rank's samples on its last pipeline stage, identical over TP
    and (gathered) over CP: one rank of those counts."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def _trainer_logprobs(run, samples: list[TrainSample], cfg) -> dict[int, list[float]]:
    """This rank's samples' log-probs by a forward-only pass with cfg's micro-batching."""
    for sample in samples:
        sample.old_logprobs = None
    fill_logprobs(run.policy, samples, cfg, "old_logprobs", model_config=run.model_config,
                  temperature=cfg.rollout.temperature, device=run.device)
    out = {i: s.old_logprobs for i, s in enumerate(samples) if s.old_logprobs is not None}
    for sample in samples:
        sample.old_logprobs = None
    return out if _holds_distinct_samples() else {}


def _engine_vs_trainer(run, samples: list[TrainSample]) -> DeltaStats:
    stats = DeltaStats()
    for index, values in _trainer_logprobs(run, samples, run.config).items():
        sample = samples[index]
        delta = torch.tensor(values, dtype=torch.float64) - torch.tensor(sample.rollout_logprobs, dtype=torch.float64)
        stats.add(delta if sample.response_mask is None else delta[torch.tensor(sample.response_mask)])
    merged = DeltaStats()
    for part in all_gather_objects(stats):
        merged.merge(part)
    return merged


def _trainer_vs_itself(run, samples: list[TrainSample]) -> float:
    cfg = run.config
    a = cfg.actor
    variants = [dataclasses.replace(cfg, actor=dataclasses.replace(a, packing=not a.packing)),
                dataclasses.replace(cfg, actor=dataclasses.replace(a, logprob_max_tokens_per_micro_batch=None,
                                                                   max_tokens_per_micro_batch=None,
                                                                   ppo_micro_batch_size_per_gpu=1))]
    baseline = _trainer_logprobs(run, samples, cfg)
    worst = 0.0
    for variant in variants:
        other = _trainer_logprobs(run, samples, variant)
        for index in baseline.keys() & other.keys():
            diff = torch.tensor(baseline[index], dtype=torch.float64) - torch.tensor(other[index], dtype=torch.float64)
            worst = max(worst, float(diff.abs().max()) if diff.numel() else 0.0)
    return max(all_gather_objects(worst))


def _engine_vs_itself(run, prompts, settings) -> tuple[float, int]:
    """Rank 0: the first prompt's samples alone and inside a batch, with the same seeds."""
    from megatron_grpo.launch.collectives import on_rank0
    from megatron_grpo.launch.cpu import cuda_redirect_paused
    from megatron_grpo.rollout.types import GenerationRequest

    def compare() -> tuple[float, int]:
        batch = next(prompts)
        sampling = dataclasses.replace(settings.sampling, seed=settings.sampling.seed or 0)
        requests = [GenerationRequest(prompt_ids=p.input_ids, group_id=f"preflight:{i}",
                                      sampling=dataclasses.replace(sampling, seed=sampling.seed + i))
                    for i, p in enumerate(batch)]
        with cuda_redirect_paused():  # the local HF engine needs no megatron CPU shims
            together = [s for s in run.engine.generate(requests) if s.group_id == requests[0].group_id]
            alone = run.engine.generate(requests[:1])
        worst, tokens = 0.0, 0
        for a, b in zip(sorted(together, key=lambda s: s.sample_index), sorted(alone, key=lambda s: s.sample_index)):
            for token_a, token_b, lp_a, lp_b in zip(a.response_ids, b.response_ids, a.logprobs, b.logprobs):
                if token_a != token_b:
                    break
                worst, tokens = max(worst, abs(lp_a - lp_b)), tokens + 1
        return worst, tokens

    return on_rank0(compare)


def _negate_policy(run) -> None:
    """Every policy weight times -1: exact, and exactly undone by a second call."""
    with torch.no_grad():
        for chunk in run.policy:
            for param in chunk.parameters():
                param.neg_()
    dist.barrier()


def preflight_only(cfg) -> int:
    """`megatron-grpo doctor RECIPE --mismatch`: the checks alone, on the recipe's layout (one
    process, or every rank under torchrun / srun), from model.path's weights, in
    <logging.output_dir>/preflight; prints the table on rank 0. 0 when every figure is within
    its bound, 1 otherwise."""
    from pathlib import Path

    from megatron_grpo.config.validate import validate
    from megatron_grpo.launch.distributed import shutdown
    from megatron_grpo.launch.env import discover_ranks
    from megatron_grpo.launch.mcore_compat import quiet_known_notices
    from megatron_grpo.trainer.setup import build_run

    ranks = discover_ranks(os.environ)
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(
        cfg.logging, output_dir=str(Path(cfg.logging.output_dir) / "preflight")))
    validate(cfg, world_size=ranks.world_size, ranks_per_node=ranks.local_world_size)
    quiet_known_notices()
    try:
        run = build_run(cfg, hold_folder=False)
        try:
            checks = run_preflight(run, version=0)
        finally:
            run.close()
    except BaseException:
        shutdown(failed=True)
        raise
    shutdown()
    if ranks.rank == 0:
        print(f"megatron-grpo doctor --mismatch: preflight (bound sqrt(eps) of {run.dtype})")
        print(preflight_table(checks), flush=True)
    return 0 if all(c.ok for c in checks) else 1
