"""Cutting the long tail of multi-turn rollouts (trainer/rollouts/long_tail_episodes.py) against the
real local engine (HF transformers): the abort cuts turns mid-way; a carried episode continues the cut
turn (a request for its trajectory + the partial turn, the rest of the turn's budget) under newer
weights and its environment never sees a turn twice; each id keeps its version and log-prob; groups
come back only whole; a carried episode survives a checkpoint (its environment rebuilt by replaying
the trajectory), and one whose environment answers otherwise starts again from its prompt."""
from __future__ import annotations

import copy
import itertools
import json

import torch

from megatron_grpo.data.prompts import EncodedPrompt
from megatron_grpo.data.records import PromptRecord
from megatron_grpo.environments import Environment, StepResult
from megatron_grpo.environments.episodes import ChatRenderer, EpisodeLimits
from megatron_grpo.rollout.local import LocalEngine
from megatron_grpo.rollout.types import SamplingParams
from megatron_grpo.trainer.rollouts.long_tail import CarryOver, LongTailSettings
from megatron_grpo.trainer.rollouts.long_tail_episodes import play_cutting_the_tail
from megatron_grpo.trainer.rollouts.multi_turn import MultiTurnSettings, engine_turns
from tests.test_long_tail import RecordingEngine, fp32_tolerance
from tests.tiny_hf import CHAR_CHAT_TEMPLATE, EOS_ID, char_tokenizer, float64_logprobs, tiny_model

N = 2
LIMITS = EpisodeLimits(max_turns=3, max_new_tokens_per_turn=16, max_length=200, step_timeout_s=30.0)
# ids 2..39 end a turn: turns of 1 to 16 ids
SAMPLING = SamplingParams(n=1, temperature=1.0, max_new_tokens=16, stop_token_ids=tuple(range(2, 40)), seed=3)
_SERIAL = itertools.count()


class TallyEnvironment(Environment):
    """Answers each turn with its length; done after 1 + (the prompt's number % 3) turns. drift=True: every
    instance answers with its own serial number too (a replay cannot reproduce it)."""

    def __init__(self, drift: bool = False):
        self.drift, self.serial, self.seen = drift, next(_SERIAL), []

    def reset(self, record):
        digits = "".join(c for c in record.prompt[-1]["content"] if c.isdigit())
        self.turns = 1 + int(digits or 0) % 3
        return list(record.prompt)

    def step(self, assistant_message):
        self.seen.append(assistant_message)
        answer = f"{len(assistant_message)}" + (f"#{self.serial}" if self.drift else "")
        return StepResult(observations=[{"role": "user", "content": answer}], reward=float(len(self.seen)),
                          done=len(self.seen) >= self.turns)


def settings(drift: bool = False) -> MultiTurnSettings:
    return MultiTurnSettings(f"{__name__}:TallyEnvironment", {"drift": drift}, LIMITS, CHAR_CHAT_TEMPLATE)


def prompts(count: int, start: int = 0) -> list[EncodedPrompt]:
    out = []
    for i in range(start, start + count):
        record = PromptRecord(data_source="t", prompt=[{"role": "user", "content": str(i)}], ground_truth="")
        out.append(EncodedPrompt(record, str(i), [], False))
    return out


def play(engine, carry, feed, needed, long_tail, mt, round_index, min_version=None):
    def turns_of(groups):
        seeds = [1000 * round_index + 10 * g + i for g, group in enumerate(groups) for i in range(len(group.episodes))]
        ids = [f"{group.group_id}:{i}" for group in groups for i in range(len(group.episodes))]
        return engine_turns(engine, SAMPLING, seeds, ids, LIMITS.max_turns, in_trainer_thread=False)

    return play_cutting_the_tail(engine, carry, lambda: next(feed), needed, long_tail, mt,
                                 ChatRenderer(char_tokenizer(), CHAR_CHAT_TEMPLATE), N,
                                 lambda g: f"r{round_index}:{g}", turns_of, min_version=min_version)


def cut_turns(carry: CarryOver) -> list:
    return [e for g in carry.episodes for e in g.episodes if e.partial is not None and e.partial.ids]


def assistant_messages(trajectory) -> list[str]:
    return [m["content"] for m in trajectory.messages if m["role"] == "assistant"]


def test_a_cut_turn_is_continued_with_its_versions_and_logprobs_and_never_replayed():
    """Round 1 plays 6 groups for 1 and aborts: episodes are cut mid-turn. After a weight update
    (version 1) round 2 continues each cut turn from trajectory + partial turn with the rest of the
    turn's budget: the joined turn's first ids and log-probs are the partial ones (old weights, float64
    recomputation), the rest the new weights', token_versions says which; every environment saw each
    assistant turn once; only whole groups come back."""
    old = tiny_model(seed=0, scale=3.0)
    engine = RecordingEngine(copy.deepcopy(old), eos_token_ids=[EOS_ID])
    carry = CarryOver()
    feed = iter([prompts(4), prompts(4, start=4)])
    first = play(engine, carry, feed, 1, LongTailSettings(over_sampling_groups=5, partial_rollout=True), settings(), 1)
    assert len(first.groups) == 1 and first.groups[0].complete and len(carry.unstarted) == 2
    assert first.metrics["rollout/long_tail/submitted_groups"] == 6
    cut = cut_turns(carry)
    assert cut, "no turn was cut mid-way: nothing to test"
    before = {id(e): (copy.deepcopy(e.trajectory), e.partial, e.environment) for g in carry.episodes
              for e in g.episodes}

    new = tiny_model(seed=1, scale=3.0)
    engine.update_weights(new.state_dict().items(), version=1)
    engine.calls.clear()
    carried = list(carry.episodes)
    second = play(engine, carry, iter([]), len(carried), LongTailSettings(0, True), settings(), 2)
    assert [g.group_id for g in second.groups] == [g.group_id for g in carried] and not carry.episodes
    continued = [r for r in engine.calls[0] if r.sampling.max_new_tokens < LIMITS.max_new_tokens_per_turn]
    assert len(continued) == len(cut)  # the first call continues every cut turn; no group is new
    old64, new64 = copy.deepcopy(old).double(), copy.deepcopy(new).double()
    for group in second.groups:
        assert group.complete and len(group.episodes) == N
        for e in group.episodes:
            trajectory, partial, environment = before[id(e)]
            t = e.trajectory
            if environment is None:  # ended in round 1 (a complete group beyond the one needed): unchanged
                assert t == trajectory
                continue
            # each turn stepped once, in order (a last turn cut by a length limit is not stepped)
            stepped = assistant_messages(t)[:-1] if t.end in ("turn_length", "max_length") else assistant_messages(t)
            assert environment.seen == stepped
            k = len(trajectory.response_ids)
            assert t.response_ids[:k] == trajectory.response_ids and t.logprobs[:k] == trajectory.logprobs
            if partial is not None and partial.ids:
                head = trajectory.prompt_ids + trajectory.response_ids + list(partial.ids)
                [request] = [r for r in continued if r.prompt_ids == tuple(head)]
                assert request.sampling.max_new_tokens == LIMITS.max_new_tokens_per_turn - len(partial.ids)
                assert t.response_ids[k:k + len(partial.ids)] == list(partial.ids)
                assert t.token_versions[k:k + len(partial.ids)] == [0] * len(partial.ids)
            assert set(t.token_versions[:k]) <= {0}
            versions = torch.tensor(t.token_versions)
            mask = torch.tensor(t.response_mask)
            got = torch.tensor(t.logprobs, dtype=torch.float64)
            for version, model in ((0, old64), (1, new64)):
                want = float64_logprobs(model, t.prompt_ids, t.response_ids)
                chosen = mask & (versions == version)
                if chosen.any():
                    assert (got[chosen] - want[chosen]).abs().max() <= fp32_tolerance(len(t.prompt_ids) + len(
                        t.response_ids))
            assert torch.all(got[~mask] == 0)
    assert any(1 in e.trajectory.token_versions and 0 in e.trajectory.token_versions
               for g in second.groups for e in g.episodes)


def test_a_checkpointed_carry_over_resumes_as_the_uninterrupted_one():
    """The carried episodes through JSON (a checkpoint's trainer_state.json) and back: their
    environments rebuilt by replaying the trajectories, the next round plays exactly what it plays
    without the round trip; an environment that answers a replay otherwise restarts its group."""
    def first_round(mt):
        engine = LocalEngine(tiny_model(seed=0, scale=3.0), eos_token_ids=[EOS_ID])
        carry = CarryOver()
        play(engine, carry, iter([prompts(6)]), 1, LongTailSettings(5, partial_rollout=True), mt, 1)
        engine.update_weights(tiny_model(seed=1, scale=3.0).state_dict().items(), version=1)
        return engine, carry

    engine, carry = first_round(settings())
    assert cut_turns(carry), "no turn was cut mid-way: nothing to test"
    saved = json.dumps(carry.state_dict())  # (which turns an abort cuts depends on when steps finish)
    needed = len(carry.episodes)
    uninterrupted = play(engine, carry, iter([]), needed, LongTailSettings(0, True), settings(), 2)

    engine = LocalEngine(tiny_model(seed=0, scale=3.0), eos_token_ids=[EOS_ID])
    engine.update_weights(tiny_model(seed=1, scale=3.0).state_dict().items(), version=1)
    restored = CarryOver()
    restored.load_state_dict(json.loads(saved))
    assert all(e.environment is None for g in restored.episodes for e in g.episodes)
    resumed = play(engine, restored, iter([]), needed, LongTailSettings(0, True), settings(), 2)
    assert resumed.metrics["rollout/long_tail/restarted_groups"] == 0
    assert [g.group_id for g in resumed.groups] == [g.group_id for g in uninterrupted.groups]
    for a, b in zip(uninterrupted.groups, resumed.groups):
        for x, y in zip(a.episodes, b.episodes):
            assert x.trajectory == y.trajectory

    engine, carry = first_round(settings(drift=True))
    # a group replays otherwise once one of its running episodes has had an observation
    drifted = [g.prompt.text for g in carry.episodes if any(e.running and e.trajectory.turns for e in g.episodes)]
    restored = CarryOver()
    restored.load_state_dict(json.loads(json.dumps(carry.state_dict())))
    result = play(engine, restored, iter([]), 1, LongTailSettings(0, True), settings(drift=True), 2)
    assert result.metrics["rollout/long_tail/restarted_groups"] == len(drifted) > 0
    assert [p.text for p in restored.unstarted] == drifted  # their prompts go first, to be played afresh
    assert not {g.prompt.text for g in restored.episodes} & set(drifted)


# ----- the trainer ---------------------------------------------------------------------------------
TOOL_LONG_TAIL = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "logging.console=false",
                  "logging.plot=false", "rollout.long_tail.over_sampling_groups=4",
                  "rollout.long_tail.partial_rollout=true", "rollout.long_tail.allow_off_policy=true",
                  # episodes of 1 to 3 turns (the recipe's keys mod 3): the 3-turn ones are the tail
                  f"rollout.multi_turn.environment={__name__}:TallyEnvironment",
                  "rollout.multi_turn.environment_kwargs={}", "checkpoint.save_interval=2"]


def _train_tool(rank, world_size, overrides):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.loop import train

    train(load_config("recipes/tiny_cpu_tool.yaml", overrides))


def test_the_tool_recipe_carries_episodes_through_a_checkpoint_and_continues_them(tmp_path):
    """tiny_cpu_tool (TallyEnvironment) with over-sampling and partial rollouts: the step-2
    checkpoint holds running episodes (trajectories and cut turns); the run resumed from it rebuilds
    their environments by replay (none restarted) and continues them at step 3."""
    from megatron_grpo.testing.distributed import run_distributed
    from tests.test_checkpoint import _metrics

    run_distributed(_train_tool, 1, ([*TOOL_LONG_TAIL, "trainer.total_steps=2", f"logging.output_dir={tmp_path}"],),
                    timeout=300)
    state = json.loads((tmp_path / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    running = [e for g in state["carry_over"]["episodes"] for e in g["episodes"]
               if e["trajectory"]["end"] == "running" and (e["partial"] or e["trajectory"]["weight_versions"])]
    assert running, "no episode was carried mid-way at step 2: the test would not test the resume"
    run_distributed(_train_tool, 1, ([*TOOL_LONG_TAIL, "trainer.total_steps=3", f"logging.output_dir={tmp_path}"],),
                    timeout=300)
    records = _metrics(tmp_path)
    assert sorted(records) == [1, 2, 3]
    assert records[3]["rollout/long_tail/restarted_groups"] == 0
    assert records[3]["rollout/long_tail/continued_samples"] > 0
    assert all(r["rollout/long_tail/submitted_groups"] >= 6 for r in records.values())
    assert any(r.get("rollout/token_lag_1_frac", 0) > 0 for r in records.values())
