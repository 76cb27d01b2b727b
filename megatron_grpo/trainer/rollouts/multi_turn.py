"""Multi-turn rollouts in the trainer (rollout.multi_turn): the settings, the rollout engine as the
episodes' turn generator, one round of episodes against fresh environments, and their metrics.
environments/episodes.py plays the turns; long_tail_episodes.py cuts a round's tail."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from megatron_grpo.data.prompts import EncodedPrompt
from megatron_grpo.environments.episodes import (ChatRenderer, Episode, TurnGenerator, TurnOutput, TurnRequest,
                                                 Trajectory, advance_episodes, close_episodes, start_episodes)
from megatron_grpo.environments.loader import build_environment
from megatron_grpo.launch.cpu import cuda_redirect_paused
from megatron_grpo.rollout.engine import RolloutEngine
from megatron_grpo.rollout.types import GenerationRequest, Sample, SamplingParams, derive_sample_seed

MULTI_TURN_ENDS = ("done", "max_turns", "turn_length", "max_length", "abort", "step_timeout")


@dataclass(frozen=True)
class MultiTurnSettings:
    environment: str  # rollout.multi_turn.environment (a built-in name, module:Class or file.py:Class)
    environment_kwargs: dict
    limits: Any  # environments.episodes.EpisodeLimits
    chat_template: str | None = None  # data.chat_template


def multi_turn_settings(cfg) -> MultiTurnSettings | None:
    """rollout.multi_turn as the rollout phase takes it; None when no environment is set."""
    from megatron_grpo.environments.episodes import EpisodeLimits

    mt = cfg.rollout.multi_turn
    if mt.environment is None:
        return None
    per_turn = mt.max_new_tokens_per_turn or cfg.rollout.max_new_tokens or cfg.data.max_response_length
    limits = EpisodeLimits(max_turns=mt.max_turns, max_new_tokens_per_turn=per_turn,
                           max_length=mt.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length,
                           step_timeout_s=mt.step_timeout_s, turn_reward=mt.turn_reward, discount=mt.discount)
    return MultiTurnSettings(environment=mt.environment, environment_kwargs=dict(mt.environment_kwargs),
                             limits=limits, chat_template=cfg.data.chat_template)


def new_episodes(prompt: EncodedPrompt, n: int, mt: MultiTurnSettings, renderer: ChatRenderer) -> list[Episode]:
    """n episodes of one prompt, each against a fresh environment, reset."""
    return start_episodes([prompt.record] * n, [build_environment(mt.environment, mt.environment_kwargs)
                                                for _ in range(n)], renderer, mt.environment)


def engine_turns(engine: RolloutEngine, sampling: SamplingParams, seeds: Sequence[int], request_ids: Sequence[str],
                 max_turns: int, in_trainer_thread: bool = True) -> TurnGenerator:
    """The engine as the episodes' turn generator: episode i's turns are n=1 requests with
    `sampling` (max_new_tokens: the turn's budget), group id request_ids[i] (an engine that
    resubmits aborted requests, SGLang under max_staleness, matches them by it), seeded from
    seeds[i], the turn and how much of it an abort had cut."""

    def generate(turns: list[TurnRequest], on_turn_done: Callable[[int, TurnOutput], None]) -> list[TurnOutput]:
        requests = [GenerationRequest(
            prompt_ids=turn.ids, group_id=request_ids[turn.episode], keep_kv=turn.turn + 1 < max_turns,
            sampling=dataclasses.replace(sampling, n=1, max_new_tokens=turn.max_new_tokens,
                                         seed=(seeds[turn.episode] + turn.turn * 1_000_033 + turn.continued * 7_919)
                                         % (2**63 - 1)))
            for turn in turns]
        with cuda_redirect_paused() if in_trainer_thread else contextlib.nullcontext():
            samples = engine.generate(requests, lambda k, done: on_turn_done(k, turn_output(done[0])))
        return [turn_output(s) for s in samples]

    return generate


def turn_output(sample: Sample) -> TurnOutput:
    return TurnOutput(sample.response_ids, sample.logprobs, sample.finish_reason, sample.weight_version,
                      stopped_by_token=not isinstance(sample.matched_stop, str))


def trajectory_sample(t: Trajectory, group_id: str, index: int, default_version: int) -> Sample:
    """The trainer's sample of one trajectory: as stale as its oldest turn, each id's version kept
    where they differ."""
    versions = t.token_versions if len(set(t.token_versions)) > 1 else None
    return Sample(group_id=group_id, sample_index=index, prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                  logprobs=t.logprobs,
                  finish_reason="abort" if t.end == "abort" else "length" if t.end in ("turn_length", "max_length")
                  else "stop",
                  weight_version=min(t.weight_versions, default=default_version), token_versions=versions)


def run_multi_turn(engine, prompts, tokenizer, mt: MultiTurnSettings, sampling: SamplingParams, n: int,
                   group_prefix: str, seed_of, in_trainer_thread: bool = True):
    """n episodes per prompt against fresh environments, every turn one batched generate call with
    `sampling` (its max_new_tokens: the turn's budget; turn t of sample i of prompt group g seeded
    from seed_of(g), i and t): (trajectories, one Sample per trajectory, group ids group_prefix:g)."""
    renderer = ChatRenderer(tokenizer, mt.chat_template)
    episodes = [e for prompt in prompts for e in new_episodes(prompt, n, mt, renderer)]
    seeds = [derive_sample_seed(seed_of(e // n), e % n) for e in range(len(episodes))]
    # one group per episode: every turn request has n=1
    ids = [f"{group_prefix}:{e // n}:{e % n}" for e in range(len(episodes))]
    try:
        advance_episodes(episodes, renderer, mt.limits, engine_turns(engine, sampling, seeds, ids, mt.limits.max_turns,
                                                                     in_trainer_thread), mt.environment)
    finally:
        close_episodes(episodes, mt.environment)
    trajectories = [e.trajectory for e in episodes]
    samples = [trajectory_sample(t, f"{group_prefix}:{i // n}", i % n, engine.weight_version)
               for i, t in enumerate(trajectories)]
    return trajectories, samples


def multi_turn_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Turns, lengths, how episodes ended and the environments' counters (summed) of one round."""
    count = len(trajectories)
    generated = [sum(t.response_mask) for t in trajectories]
    metrics = {
        "multi_turn/turns_mean": sum(t.turns for t in trajectories) / count,
        "multi_turn/generated_tokens_mean": sum(generated) / count,
        "response/length_mean": sum(len(t.response_ids) for t in trajectories) / count,
        "response/length_max": float(max(len(t.response_ids) for t in trajectories)),
        "response/truncation_ratio": sum(t.end in ("turn_length", "max_length") for t in trajectories) / count,
    }
    for end in MULTI_TURN_ENDS:
        metrics[f"multi_turn/end_{end}_frac"] = sum(t.end == end for t in trajectories) / count
    for t in trajectories:
        for name, value in t.counters.items():
            metrics[f"multi_turn/{name}"] = metrics.get(f"multi_turn/{name}", 0.0) + value
    return metrics
