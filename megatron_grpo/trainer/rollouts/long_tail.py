"""Cutting the long tail of generation (rollout.long_tail; docs/long-tail.md).

Over-sampling: a round submits `over_sampling_groups` prompt groups more than it needs; once the
groups it needs are complete (every sample of the group finished), the engine's call is aborted
(SGLang's /abort_request, the local engine's abort) and the round returns those groups.

Partial rollouts: the groups the abort left incomplete are kept, with each sample's tokens, log-probs
and the weight version of every token, and continued first by the next round: each unfinished sample
becomes a request for prompt + its partial response (prefix-cached by SGLang's radix cache; the local
engine prefills it again) with the rest of its token budget, under the newer weights. A sequence may so
span several weight versions; its oldest token's version is its weight_version (what the staleness
bound reads) and Sample.token_versions tells each token's. Complete groups beyond what the round needs
are kept too, scored. Without partial rollouts both are discarded and counted.

Groups stay groups: a group is returned only when all its samples are complete; scores (and GRPO's
baseline) never mix prompts. The carried state (CarryOver) holds prompts drawn from the sampler but not
started and the carried groups; it is saved with each checkpoint, so a resumed run continues them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

from megatron_grpo.data.prompts import EncodedPrompt
from megatron_grpo.data.records import PromptRecord
from megatron_grpo.environments.episodes import Episode, Trajectory, TurnOutput, close_episodes
from megatron_grpo.launch.cpu import cuda_redirect_paused
from megatron_grpo.rollout.engine import RolloutEngine
from megatron_grpo.rollout.types import GenerationRequest, Sample, SamplingParams


@dataclass(frozen=True)
class LongTailSettings:
    over_sampling_groups: int  # extra groups per round (rollout.long_tail.over_sampling_groups)
    partial_rollout: bool  # keep and continue what the abort left (rollout.long_tail.partial_rollout)


@dataclass
class CarriedGroup:
    """One prompt's n samples carried to a later round. Unfinished samples have finish_reason 'abort'
    and hold what they generated so far; `scores` is set once the group is complete and scored."""

    prompt: EncodedPrompt
    samples: list[Sample]
    scores: list[float] | None = None

    @property
    def complete(self) -> bool:
        return all(s.finish_reason != "abort" for s in self.samples)

    @property
    def oldest_version(self) -> int:
        return min((s.weight_version for s in self.samples if s.response_ids), default=_NO_TOKENS)


_NO_TOKENS = 1 << 62  # a group with no token yet is as new as any


@dataclass
class CarriedEpisodes:
    """One prompt's n multi-turn episodes carried to a later round (long_tail_episodes.py): each
    keeps its trajectory, its environment and the turn an abort cut."""

    prompt: EncodedPrompt
    group_id: str
    episodes: list[Episode]

    @property
    def ended(self) -> bool:
        return not any(e.running for e in self.episodes)

    @property
    def complete(self) -> bool:
        """Every episode ended, none by an abort."""
        return self.ended and all(e.trajectory.end != "abort" for e in self.episodes)

    @property
    def oldest_version(self) -> int:
        versions = [v for e in self.episodes for v in e.trajectory.token_versions + (
            e.partial.versions() if e.partial is not None else [])]
        return min(versions, default=_NO_TOKENS)

    def state_dict(self) -> dict:
        """JSON-safe; the environments are not saved (a resumed round rebuilds them: replay_episode)."""
        return {"prompt": _prompt_state(self.prompt), "group_id": self.group_id,
                "episodes": [{"trajectory": dataclasses.asdict(e.trajectory),
                              "partial": None if e.partial is None else dataclasses.asdict(e.partial)}
                             for e in self.episodes]}

    @classmethod
    def from_state(cls, state: dict) -> "CarriedEpisodes":
        prompt = _prompt_of(state["prompt"])
        episodes = []
        for e in state["episodes"]:
            partial = e["partial"]
            if partial is not None and partial["token_versions"] is not None:
                partial = {**partial, "token_versions": tuple(partial["token_versions"])}
            episodes.append(Episode(prompt.record, Trajectory(**e["trajectory"]), None,
                                    None if partial is None else TurnOutput(**partial)))
        return cls(prompt, state["group_id"], episodes)


@dataclass
class CarryOver:
    """What rounds leave for later ones: prompts drawn but not started, and carried groups (oldest
    first): single-turn `groups`, multi-turn `episodes`."""

    unstarted: list[EncodedPrompt] = field(default_factory=list)
    groups: list[CarriedGroup] = field(default_factory=list)
    episodes: list[CarriedEpisodes] = field(default_factory=list)

    def state_dict(self) -> dict:
        """JSON-safe (the checkpoint's trainer_state.json)."""
        return {"unstarted": [_prompt_state(p) for p in self.unstarted],
                "groups": [{"prompt": _prompt_state(g.prompt), "scores": g.scores,
                            "samples": [_sample_state(s) for s in g.samples]} for g in self.groups],
                "episodes": [g.state_dict() for g in self.episodes]}

    def load_state_dict(self, state: dict) -> None:
        self.unstarted = [_prompt_of(p) for p in state["unstarted"]]
        self.groups = [CarriedGroup(_prompt_of(g["prompt"]), [Sample(**s) for s in g["samples"]], g["scores"])
                       for g in state["groups"]]
        self.episodes = [CarriedEpisodes.from_state(g) for g in state.get("episodes", [])]

    def close(self) -> None:
        """Closes the carried episodes' environments (what they hold stays in the trajectories)."""
        for group in self.episodes:
            close_episodes(group.episodes)

    def draw(self, next_prompts: Callable[[], list[EncodedPrompt]], count: int) -> list[EncodedPrompt]:
        """`count` prompts: the unstarted ones first, then the sampler's batches; what is left of
        the last batch stays unstarted."""
        while len(self.unstarted) < count:
            self.unstarted.extend(next_prompts())
        taken, self.unstarted = self.unstarted[:max(count, 0)], self.unstarted[max(count, 0):]
        return taken


@dataclass
class RoundResult:
    """The complete groups of one round, in group order (their scores None where still to be scored),
    and the round's long-tail metrics."""

    groups: list[CarriedGroup]
    metrics: dict[str, float]


def generate_cutting_the_tail(engine: RolloutEngine, carry: CarryOver, next_prompts: Callable[[], list[EncodedPrompt]],
                              needed: int, settings: LongTailSettings, sampling: SamplingParams,
                              make_request: Callable[[EncodedPrompt, int], GenerationRequest],
                              on_group_complete: Callable[[int, CarriedGroup], None] | None = None,
                              min_version: int | None = None, in_trainer_thread: bool = True) -> RoundResult:
    """One round: the carried groups first (complete ones as they are, the others continued), then new
    prompts (carried unstarted ones first), `needed + over_sampling_groups` groups in all; the engine's
    call is aborted once `needed` groups are complete. `make_request(prompt, index)` builds a new
    group's request; on_group_complete(key, group) hears of each group completed in this call, keys
    increasing with the group's place in the round (from the engine's thread: scoring starts on it).
    Carried groups older than `min_version` are dropped first (rollout/dropped_stale)."""
    metrics = {"rollout/long_tail/aborted_groups": 0.0, "rollout/long_tail/continued_samples": 0.0,
               "rollout/long_tail/continued_tokens": 0.0, "rollout/long_tail/discarded_groups": 0.0}
    stale = [g for g in carry.groups if min_version is not None and g.oldest_version < min_version]
    metrics["rollout/dropped_stale"] = float(sum(len(g.samples) for g in stale))
    carried = [g for g in carry.groups if g not in stale]
    ready = [g for g in carried if g.complete]
    if len(ready) >= needed:  # carried complete groups fill the round: no generation
        kept = ready[:needed]
        carry.groups = [g for g in carried if g not in kept]
        metrics.update({"rollout/long_tail/submitted_groups": 0.0,
                        "rollout/long_tail/carried_groups": float(len(carry.groups))})
        return RoundResult(kept, metrics)
    target = needed + settings.over_sampling_groups
    groups, carry.groups = carried[:target], carried[target:]
    groups += [CarriedGroup(p, []) for p in carry.draw(next_prompts, target - len(groups))]

    # requests: a new group is one request of n samples; a carried one, one request per unfinished sample
    requests: list[GenerationRequest] = []
    owner: list[tuple[int, int | None]] = []  # request -> (group, sample index it continues or None)
    for g, group in enumerate(groups):
        if not group.samples:
            requests.append(make_request(group.prompt, g))
            owner.append((g, None))
            continue
        for s in group.samples:
            if s.finish_reason == "abort":
                requests.append(_continuation(group, s, sampling, g))
                owner.append((g, s.sample_index))
                metrics["rollout/long_tail/continued_samples"] += 1
                metrics["rollout/long_tail/continued_tokens"] += len(s.response_ids)
    tracker = _CompletionTracker(engine, groups, owner, needed, on_group_complete)
    if requests:
        with cuda_redirect_paused() if in_trainer_thread else contextlib.nullcontext():
            returned = engine.generate(requests, tracker.request_done)
        tracker.take_all(returned, requests)
        metrics["rollout/busy_frac"] = busy_fraction(returned)
        metrics["rollout/long_tail/generated_tokens"] = float(sum(len(s.response_ids) for s in returned))

    kept, extra = tracker.order[:needed], tracker.order[needed:]  # complete groups, as they completed
    incomplete = [g for g in range(len(groups)) if not groups[g].complete]
    metrics["rollout/long_tail/submitted_groups"] = float(len(groups))
    metrics["rollout/long_tail/aborted_groups"] = float(len(incomplete))
    if settings.partial_rollout:  # oldest first: the groups not taken this round, then this round's
        carry.groups = carry.groups + [groups[g] for g in extra] + [groups[g] for g in incomplete]
    else:
        metrics["rollout/long_tail/discarded_groups"] = float(len(extra) + len(incomplete))
    metrics["rollout/long_tail/carried_groups"] = float(len(carry.groups))
    kept.sort()  # group order: carried groups first, then new prompts in sampler order
    return RoundResult([groups[g] for g in kept], metrics)


class _CompletionTracker:
    """Gathers the engine's samples into their groups as requests finish; aborts the call once
    `needed` groups are complete (once)."""

    def __init__(self, engine: RolloutEngine, groups: list[CarriedGroup], owner: list[tuple[int, int | None]],
                 needed: int, on_group_complete):
        self.engine, self.groups, self.owner, self.needed = engine, groups, owner, needed
        self.on_group_complete = on_group_complete
        self.lock = threading.Lock()
        self.open = [0] * len(groups)  # requests still out per group
        for g, _ in owner:
            self.open[g] += 1
        self.taken = [False] * len(owner)
        self.order = [g for g, group in enumerate(groups) if group.samples and group.complete]  # done already
        self.aborted = False

    def request_done(self, index: int, samples: list[Sample]) -> None:
        with self.lock:
            complete = self._take(index, samples)
            stop = not self.aborted and len(self.order) >= self.needed
            self.aborted = self.aborted or stop
        if complete is not None and self.on_group_complete is not None:
            self.on_group_complete(complete, self.groups[complete])
        if stop:
            self.engine.abort()

    def take_all(self, returned: list[Sample], requests: Sequence[GenerationRequest]) -> None:
        """The call's samples, for requests not told (an engine may return aborted ones only here).
        The call has ended: nothing is left to abort."""
        self.aborted = True
        start = 0
        for index, request in enumerate(requests):
            batch = returned[start:start + request.sampling.n]
            start += request.sampling.n
            if not self.taken[index]:
                self.request_done(index, batch)

    def _take(self, index: int, samples: list[Sample]) -> int | None:
        """Files request `index`'s samples in its group; the group's index if that completed it."""
        if self.taken[index]:
            return None
        self.taken[index] = True
        g, continued = self.owner[index]
        group = self.groups[g]
        if continued is None:
            group.samples = list(samples)
        else:
            [new] = samples
            group.samples[continued] = _joined(group.samples[continued], new)
        self.open[g] -= 1
        if self.open[g] == 0 and group.complete:
            self.order.append(g)
            return g
        return None


def _continuation(group: CarriedGroup, sample: Sample, sampling: SamplingParams, index: int) -> GenerationRequest:
    """Prompt + the sample's partial response, with what is left of its token budget."""
    left = sampling.max_new_tokens - len(sample.response_ids)
    seed = None if sampling.seed is None else (sampling.seed * 1_000_003 + index * 7_919
                                                + sample.sample_index * 101 + len(sample.response_ids))
    params = dataclasses.replace(sampling, n=1, max_new_tokens=max(left, 1), seed=seed)
    return GenerationRequest(prompt_ids=tuple(group.prompt.input_ids) + tuple(sample.response_ids), sampling=params,
                             group_id=sample.group_id)


def _joined(partial: Sample, new: Sample) -> Sample:
    """A partial sample continued by `new` (its request's prompt was partial's prompt + response): one
    sample whose every token keeps the weight version that generated it."""
    if not partial.response_ids:  # aborted before its first token: the continuation is the sample
        return dataclasses.replace(new, group_id=partial.group_id, sample_index=partial.sample_index,
                                   prompt_ids=list(partial.prompt_ids))
    versions = token_versions(partial) + token_versions(new)
    both_exact = partial.behaviour_logprobs is None and new.behaviour_logprobs is None
    supports = (None if partial.sampling_support is None or new.sampling_support is None
                else partial.sampling_support + new.sampling_support)
    return Sample(group_id=partial.group_id, sample_index=partial.sample_index, prompt_ids=list(partial.prompt_ids),
                  response_ids=partial.response_ids + new.response_ids, logprobs=partial.logprobs + new.logprobs,
                  finish_reason=new.finish_reason, weight_version=min(versions, default=new.weight_version),
                  matched_stop=new.matched_stop,
                  behaviour_logprobs=None if both_exact else partial.sampled_logprobs + new.sampled_logprobs,
                  sampling_support=supports, engine=new.engine, token_versions=versions)


def busy_fraction(returned: Sequence[Sample]) -> float:
    """Tokens one generate call produced over what its sequences could have produced while the call
    lasted (sequences x the longest one): the share of the call's decode slots in use. Exact for
    the local engine, whose rows decode in lockstep; for SGLang an estimate (requests start and end
    at different times)."""
    longest = max((len(s.response_ids) for s in returned), default=0)
    if not longest:
        return 1.0
    return sum(len(s.response_ids) for s in returned) / (len(returned) * longest)


def token_versions(sample: Sample) -> list[int]:
    """The weight version of each response token."""
    if sample.token_versions is not None:
        return list(sample.token_versions)
    return [sample.weight_version] * len(sample.response_ids)


def version_lag_metrics(samples: Sequence[Sample], trained_version: int) -> dict[str, float]:
    """rollout/token_lag_<k>_frac: the share of response tokens generated k weight versions before
    `trained_version` (the weights the step trains), and rollout/token_lag_max."""
    counts: dict[int, int] = {}
    for sample in samples:
        for version in token_versions(sample):
            lag = trained_version - version
            counts[lag] = counts.get(lag, 0) + 1
    total = sum(counts.values()) or 1
    metrics = {f"rollout/token_lag_{lag}_frac": count / total for lag, count in sorted(counts.items())}
    metrics["rollout/token_lag_max"] = float(max(counts, default=0))
    return metrics


def _prompt_state(prompt: EncodedPrompt) -> dict:
    return {"record": dataclasses.asdict(prompt.record), "text": prompt.text, "input_ids": list(prompt.input_ids),
            "truncated": prompt.truncated}


def _prompt_of(state: dict) -> EncodedPrompt:
    return EncodedPrompt(PromptRecord(**state["record"]), state["text"], list(state["input_ids"]), state["truncated"])


def _sample_state(sample: Sample) -> dict:
    state = dataclasses.asdict(sample)
    state["routed_experts"] = None  # partial rollouts are refused with routing replay (config/validate.py)
    return state
