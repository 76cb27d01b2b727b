"""Cutting the long tail of multi-turn rollouts (rollout.long_tail with rollout.multi_turn;
docs/long-tail.md): long_tail.py's over-sampling and partial rollouts with an episode, its trajectory
and live environment, as what a group is made of.

A round plays the carried episode groups and new ones, `needed + over_sampling_groups` in all, turn
by turn; an episode's environment step starts as soon as its turn is final, and once `needed` groups
have ended whole the engine's call in flight is aborted. With partial rollouts the groups still
running are carried: each episode keeps its trajectory, its environment and the turn the abort cut,
which the next round continues (a request for the trajectory + the partial turn with the rest of
the turn's budget), never re-runs. Without, they are closed and discarded.

Checkpoints hold the carried trajectories, not the environments (a live tool sandbox cannot be
saved): a resumed round rebuilds each environment by resetting it and replaying the trajectory's
assistant turns, and checks that it answers as recorded. A group whose environment answers
otherwise starts again from its prompt (rollout/long_tail/restarted_groups): environments are
expected to be deterministic in their record and the assistant's messages, as the built-in ones are."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from megatron_grpo.data.prompts import EncodedPrompt
from megatron_grpo.environments.episodes import (ChatRenderer, TurnGenerator, advance_episodes, close_episodes,
                                                 replay_episode)
from megatron_grpo.environments.loader import build_environment
from megatron_grpo.rollout.engine import RolloutEngine
from megatron_grpo.trainer.rollouts.long_tail import CarriedEpisodes, CarryOver, LongTailSettings
from megatron_grpo.trainer.rollouts.multi_turn import MultiTurnSettings, new_episodes

logger = logging.getLogger(__name__)


@dataclass
class EpisodeRoundResult:
    """The groups one round completed (or took complete from the carried ones), in group order, and
    the round's long-tail metrics."""

    groups: list[CarriedEpisodes]
    metrics: dict[str, float]


def play_cutting_the_tail(engine: RolloutEngine, carry: CarryOver, next_prompts: Callable[[], list[EncodedPrompt]],
                          needed: int, settings: LongTailSettings, mt: MultiTurnSettings, renderer: ChatRenderer,
                          n: int, group_id_of: Callable[[int], str],
                          turns_of: Callable[[list[CarriedEpisodes]], TurnGenerator],
                          min_version: int | None = None) -> EpisodeRoundResult:
    """One multi-turn round (see the module's docstring). group_id_of(g): the id of a new group at
    place g of the round; turns_of(groups): the turn generator of the round's episodes, in group
    order. Carried groups older than `min_version` are dropped first (rollout/dropped_stale)."""
    metrics = {"rollout/long_tail/aborted_groups": 0.0, "rollout/long_tail/continued_samples": 0.0,
               "rollout/long_tail/continued_tokens": 0.0, "rollout/long_tail/discarded_groups": 0.0,
               "rollout/long_tail/restarted_groups": 0.0}
    stale = [g for g in carry.episodes if min_version is not None and g.oldest_version < min_version]
    metrics["rollout/dropped_stale"] = float(sum(len(g.episodes) for g in stale))
    _close(stale, mt)
    carried = [g for g in carry.episodes if g not in stale]
    restarted = [g for g in carried if not _environments_rebuilt(g, mt)]
    if restarted:
        logger.warning("rollout.long_tail: %d carried episode group(s) start again from their prompts: their "
                       "environments answered a replay of the saved turns otherwise than recorded", len(restarted))
        metrics["rollout/long_tail/restarted_groups"] = float(len(restarted))
        carry.unstarted = [g.prompt for g in restarted] + carry.unstarted
        carried = [g for g in carried if g not in restarted]
    ready = [g for g in carried if g.complete]
    if len(ready) >= needed:  # carried complete groups fill the round: no generation
        carry.episodes = [g for g in carried if g not in ready[:needed]]
        metrics.update({"rollout/long_tail/submitted_groups": 0.0,
                        "rollout/long_tail/carried_groups": float(len(carry.episodes))})
        return EpisodeRoundResult(ready[:needed], metrics)
    target = needed + settings.over_sampling_groups
    groups, carry.episodes = carried[:target], carried[target:]
    for group in groups:
        for e in group.episodes:
            if e.running and (e.partial is not None or e.trajectory.turns):
                metrics["rollout/long_tail/continued_samples"] += 1
                metrics["rollout/long_tail/continued_tokens"] += len(e.trajectory.response_ids) + len(
                    e.partial.ids if e.partial is not None else [])
    try:  # (a failed or stopped round leaves no environment open)
        for prompt in carry.draw(next_prompts, target - len(groups)):
            groups.append(CarriedEpisodes(prompt, group_id_of(len(groups)), new_episodes(prompt, n, mt, renderer)))
        tracker = _GroupTracker(engine, groups, needed)
        advance_episodes([e for g in groups for e in g.episodes], renderer, mt.limits,
                         tracker.guarded(turns_of(groups)), mt.environment, keep_partial=settings.partial_rollout,
                         on_end=tracker.episode_ended, stop=tracker.enough)
    except BaseException:
        _close(groups, mt)
        raise
    kept, extra = tracker.order[:needed], tracker.order[needed:]  # whole groups, as they completed
    left = [g for g in range(len(groups)) if g not in tracker.order]  # running, or ended by an abort
    metrics["rollout/long_tail/submitted_groups"] = float(len(groups))
    metrics["rollout/long_tail/aborted_groups"] = float(len(left))
    _close([groups[g] for g in kept], mt)
    if settings.partial_rollout:  # oldest first: the groups not taken this round, then this round's
        carry.episodes = carry.episodes + [groups[g] for g in extra] + [groups[g] for g in left]
        _close([groups[g] for g in extra], mt)  # ended: their environments are done
    else:
        _close([groups[g] for g in extra + left], mt)
        metrics["rollout/long_tail/discarded_groups"] = float(len(extra) + len(left))
    metrics["rollout/long_tail/carried_groups"] = float(len(carry.episodes))
    return EpisodeRoundResult([groups[g] for g in sorted(kept)], metrics)


class _GroupTracker:
    """Counts each group's episodes as they end (from the engine's or a step's thread); aborts the
    call in flight once `needed` groups have ended whole (once, and never an idle engine)."""

    def __init__(self, engine: RolloutEngine, groups: list[CarriedEpisodes], needed: int):
        self.engine, self.groups, self.needed = engine, groups, needed
        self.lock = threading.Lock()
        self.owner = [g for g, group in enumerate(groups) for _ in group.episodes]
        self.order = [g for g, group in enumerate(groups) if group.complete]  # complete already
        self.in_flight = self.aborted = False

    def episode_ended(self, episode: int) -> None:
        g = self.owner[episode]
        with self.lock:
            if g in self.order or not self.groups[g].complete:
                return
            self.order.append(g)
            if self.in_flight and not self.aborted and len(self.order) >= self.needed:
                self.aborted = True
                self.engine.abort()

    def enough(self) -> bool:
        with self.lock:
            return len(self.order) >= self.needed

    def guarded(self, generate: TurnGenerator) -> TurnGenerator:
        def call(requests, on_turn_done):
            with self.lock:
                self.in_flight = True
            try:
                return generate(requests, on_turn_done)
            finally:
                with self.lock:
                    self.in_flight = False
        return call


def _environments_rebuilt(group: CarriedEpisodes, mt: MultiTurnSettings) -> bool:
    """A restored group's running episodes get their environments back by replay; False (all
    closed) when one answers otherwise than its trajectory records."""
    for e in group.episodes:
        if e.running and e.environment is None and not replay_episode(
                e, build_environment(mt.environment, mt.environment_kwargs), mt.environment):
            _close([group], mt)
            return False
    return True


def _close(groups: list[CarriedEpisodes], mt: MultiTurnSettings) -> None:
    for group in groups:
        close_episodes(group.episodes, mt.environment)
