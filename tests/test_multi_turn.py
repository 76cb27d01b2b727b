"""Multi-turn rollouts, token in / token out (environments/episodes.py, trainer/rollouts/rollout_phase.py):
incremental rendering against whole-conversation rendering, masks and log-probs on hand-built
trajectories, the limits, micro-batch loss masks, the local engine's log-probs against a full
forward pass, and the ratio == 1 invariant at step 1 of the tiny tool recipe."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from megatron_grpo.data.records import PromptRecord
from megatron_grpo.data.synthetic import CHAT_TEMPLATE, build_tokenizer
from megatron_grpo.environments import Environment, StepResult
from megatron_grpo.environments.episodes import (ChatRenderer, EnvironmentFailure, EpisodeLimits, TurnOutput,
                                                 run_episodes)
from megatron_grpo.testing.distributed import run_distributed
from tests.tiny_hf import float64_logprobs
from megatron_grpo.trainer.batches.batching import TrainSample, collate, collate_packed

# A Qwen-style template that merges consecutive tool messages into one user turn (as Qwen3's does),
# spelled in the synthetic vocabulary.
MERGING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n: {{ m['content'] }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Rewrites earlier assistant turns (keeps what follows the last "."), as Qwen3's template drops an
# earlier turn's <think> block: it cannot be rendered incrementally.
REWRITING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('.')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def record(key="31", index=0):
    return PromptRecord(data_source="test", prompt=[{"role": "user", "content": key}], ground_truth="",
                        extra_info={"digits": key, "index": index})


class ScriptedEnvironment(Environment):
    """Answers each turn with the next of `replies` (a list of (observations, reward, done))."""

    def __init__(self, replies, delay_s=0.0, fail=False):
        self.replies, self.delay_s, self.fail = list(replies), delay_s, fail
        self.seen, self.closed = [], False

    def reset(self, record):
        return list(record.prompt)

    def step(self, assistant_message):
        self.seen.append(assistant_message)
        if self.fail:
            raise RuntimeError("boom")
        time.sleep(self.delay_s)
        observations, reward, done = self.replies.pop(0)
        return StepResult(observations=observations, reward=reward, done=done)

    def close(self):
        self.closed = True


class EchoEnvironment(Environment):
    """Answers every turn with a user turn holding the turn's length; reward 1 for "2"."""

    def reset(self, record):
        return list(record.prompt)

    def step(self, assistant_message):
        return StepResult(observations=[{"role": "user", "content": str(len(assistant_message))}],
                          reward=float(assistant_message == "2"))


class ScriptedEngine:
    """Plays `turns[episode][turn]` = (text, finish) as the engine's output ids, log-prob -0.1 - k/10
    for its k-th id; records every request."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.requests = tokenizer, turns, []
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, requests):
        self.requests.extend(requests)
        outputs = []
        for r in requests:
            text, finish = self.turns[r.episode][r.turn]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + ([self.eos] if finish == "stop" else [])
            ids = ids[: r.max_new_tokens]
            outputs.append(TurnOutput(ids, [-0.1 - k / 10 for k in range(len(ids))], finish, weight_version=3))
        return outputs


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


LIMITS = EpisodeLimits(max_turns=4, max_new_tokens_per_turn=8, max_length=64, step_timeout_s=5.0)


# ----- incremental rendering -------------------------------------------------------------------
@pytest.mark.parametrize("template, observations", [
    (None, [[{"role": "user", "content": "203"}], [{"role": "user", "content": "1 2"}]]),  # the shipped one
    (MERGING_TEMPLATE, [[{"role": "tool", "content": "203"}, {"role": "tool", "content": "3"}],
                        [{"role": "tool", "content": "1"}]]),
])
def test_incremental_rendering_equals_the_whole_conversation(tokenizer, template, observations):
    """Engine ids (the tokenization of the turn + <|im_end|>) and the appended observation ids give
    exactly the ids of the whole conversation rendered at once, at every turn."""
    assert tokenizer.chat_template == CHAT_TEMPLATE
    turns = [":31", ": 2", "203"]
    env = ScriptedEnvironment([(observations[0], None, False), (observations[1], 0.5, False), ([], 1.0, True)])
    engine = ScriptedEngine(tokenizer, [[(t, "stop") for t in turns]])
    [trajectory] = run_episodes([record()], [env], ChatRenderer(tokenizer, template), LIMITS, engine)
    renderer = ChatRenderer(tokenizer, template)
    conversation = [{"role": "user", "content": "31"}]
    for turn, request in enumerate(engine.requests):  # every turn continues from the whole trajectory so far
        assert list(request.ids) == encode(tokenizer, renderer.render(conversation, generation_prompt=True))
        conversation.append({"role": "assistant", "content": turns[turn]})
        if turn < 2:
            conversation.extend(observations[turn])
    whole = encode(tokenizer, renderer.render(conversation, generation_prompt=False))
    # the template closes the last turn with "\n" after <|im_end|>: not generated, not in the trajectory
    assert trajectory.prompt_ids + trajectory.response_ids == whole[:-1]
    assert trajectory.counters == {} and trajectory.end == "done" and env.seen == turns


def test_a_turn_ended_by_a_stop_string_gets_the_whole_closing_and_no_mismatch(tokenizer):
    """A stop string ("1") ends the first turn without <|im_end|>: the observation ids start with
    the template's whole closing, the trajectory equals the conversation rendered at once, and
    nothing is counted as a template mismatch."""
    turns = [(":31", False), ("203", True)]  # (text, ended by the <|im_end|> token)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(requests):
        out = []
        for r in requests:
            text, by_token = turns[r.turn]
            ids = encode(tokenizer, text) + ([eos] if by_token else [])
            out.append(TurnOutput(ids, [-0.1] * len(ids), "stop", weight_version=0, stopped_by_token=by_token))
        return out

    env = ScriptedEnvironment([([{"role": "user", "content": "203"}], None, False), ([], 1.0, True)])
    [t] = run_episodes([record()], [env], ChatRenderer(tokenizer), LIMITS, generate)
    conversation = [{"role": "user", "content": "31"}, {"role": "assistant", "content": ":31"},
                    {"role": "user", "content": "203"}, {"role": "assistant", "content": "203"}]
    whole = encode(tokenizer, ChatRenderer(tokenizer).render(conversation, generation_prompt=False))
    assert t.prompt_ids + t.response_ids == whole[:-1]
    assert t.response_mask.count(True) == len(encode(tokenizer, ":31")) + len(encode(tokenizer, "203")) + 1
    assert t.counters == {} and env.seen == [":31", "203"]


def test_a_template_that_rewrites_history_keeps_the_engine_ids(tokenizer):
    """The template drops "1." from the earlier turn: the trajectory keeps the engine's ids, the
    observation is rendered after a neutral conversation, and the mismatch is counted."""
    env = ScriptedEnvironment([([{"role": "user", "content": "203"}], None, False), ([], 1.0, True)])
    engine = ScriptedEngine(tokenizer, [[("1.2", "stop"), ("3", "stop")]])
    [t] = run_episodes([record()], [env], ChatRenderer(tokenizer, REWRITING_TEMPLATE), LIMITS, engine)
    first_turn = encode(tokenizer, "1.2") + [engine.eos]
    observation = encode(tokenizer, "\n<|im_start|>user\n203<|im_end|>\n<|im_start|>assistant\n")
    assert t.response_ids == first_turn + observation + encode(tokenizer, "3") + [engine.eos]
    assert t.counters == {"template_mismatch": 1.0}
    whole = encode(tokenizer, ChatRenderer(tokenizer, REWRITING_TEMPLATE).render(t.messages, False))
    assert t.prompt_ids + t.response_ids != whole[:-1]  # what re-tokenizing would have trained on instead


# ----- masks, log-probs and limits on hand-built trajectories --------------------------------
def test_mask_and_logprobs_align_with_the_generated_ids(tokenizer):
    env = ScriptedEnvironment([([{"role": "user", "content": "203"}], 0.2, False), ([], 0.8, True)])
    engine = ScriptedEngine(tokenizer, [[(":31", "stop"), ("203", "stop")]])
    [t] = run_episodes([record()], [env], ChatRenderer(tokenizer), LIMITS, engine)
    turn1, turn2 = encode(tokenizer, ":31") + [engine.eos], encode(tokenizer, "203") + [engine.eos]
    observation = encode(tokenizer, "\n<|im_start|>user\n203<|im_end|>\n<|im_start|>assistant\n")
    assert t.prompt_ids == encode(tokenizer, "<|im_start|>user\n31<|im_end|>\n<|im_start|>assistant\n")
    assert t.response_ids == turn1 + observation + turn2
    assert t.response_mask == [True] * len(turn1) + [False] * len(observation) + [True] * len(turn2)
    logprob = [-0.1 - k / 10 for k in range(8)]
    assert t.logprobs == logprob[:len(turn1)] + [0.0] * len(observation) + logprob[:len(turn2)]
    assert t.turn_rewards == [0.2, 0.8] and t.reward(LIMITS) == pytest.approx(1.0)
    discounted = dataclasses.replace(LIMITS, turn_reward="discounted", discount=0.5)
    assert t.reward(discounted) == pytest.approx(0.2 + 0.5 * 0.8)
    assert t.weight_versions == [3, 3] and env.closed


def _one(tokenizer, turns, replies, limits, **env_kwargs):
    env = ScriptedEnvironment(replies, **env_kwargs)
    engine = ScriptedEngine(tokenizer, [turns])
    [t] = run_episodes([record()], [env], ChatRenderer(tokenizer), limits, engine)
    return t, env, engine


def test_turn_and_trajectory_limits(tokenizer):
    obs = [{"role": "user", "content": "1"}]
    # max_turns: the last turn's observation is never rendered (nothing would answer it)
    t, env, _ = _one(tokenizer, [("1", "stop")] * 2, [(obs, 0.5, False)] * 2, dataclasses.replace(LIMITS, max_turns=2))
    assert t.end == "max_turns" and t.turns == 2 and t.response_mask[-1] is True and t.turn_rewards == [0.5, 0.5]
    # a turn cut by the per-turn limit is not sent to the environment and ends the episode
    t, env, _ = _one(tokenizer, [("1 2 3 4 5 6", "length")], [], dataclasses.replace(LIMITS, max_new_tokens_per_turn=4))
    assert t.end == "turn_length" and env.seen == [] and len(t.response_ids) == 4 and all(t.response_mask)
    # the total length: a turn gets what is left; an observation that would pass it ends the episode
    prompt = len(encode(tokenizer, "<|im_start|>user\n31<|im_end|>\n<|im_start|>assistant\n"))
    observation = len(encode(tokenizer, "\n<|im_start|>user\n1<|im_end|>\n<|im_start|>assistant\n"))
    limits = dataclasses.replace(LIMITS, max_length=prompt + 16)
    t, env, engine = _one(tokenizer, [("1", "stop"), ("1 2 3 4 5 6 7 8", "length")], [(obs, None, False)], limits)
    assert [r.max_new_tokens for r in engine.requests] == [8, 16 - 2 - observation]
    assert t.end == "max_length" and len(t.prompt_ids) + len(t.response_ids) == prompt + 16
    t, env, _ = _one(tokenizer, [("1", "stop")], [([{"role": "user", "content": "1" * 20}], 0.3, False)], limits)
    assert t.end == "max_length" and t.response_mask == [True, True] and t.turn_rewards == [0.3]


def test_environment_timeouts_and_failures(tokenizer, monkeypatch):
    limits = dataclasses.replace(LIMITS, step_timeout_s=0.2)
    t, env, _ = _one(tokenizer, [("1", "stop")], [([], 1.0, True)], limits, delay_s=1.0)
    assert t.end == "step_timeout" and t.counters == {"step_timeouts": 1.0} and t.reward(limits) == 0.0
    # time queued behind other episodes' steps does not count: one thread, two 0.3 s steps, 0.5 s limit
    monkeypatch.setattr("megatron_grpo.environments.episodes.STEP_THREADS", 1)
    envs = [ScriptedEnvironment([([], 1.0, True)], delay_s=0.3) for _ in range(2)]
    engine = ScriptedEngine(tokenizer, [[("1", "stop")]] * 2)
    slow = run_episodes([record(), record()], envs, ChatRenderer(tokenizer),
                        dataclasses.replace(LIMITS, step_timeout_s=0.5), engine)
    assert [t.end for t in slow] == ["done", "done"]
    with pytest.raises(EnvironmentFailure, match="environment.step raised RuntimeError: boom"):
        _one(tokenizer, [("1", "stop")], [], LIMITS, fail=True)


# ----- micro-batches ---------------------------------------------------------------------------
def test_loss_mask_follows_the_response_mask_in_both_layouts():
    mask = [True, True, False, False, False, True]
    logprobs = [-0.5, -0.6, 0.0, 0.0, 0.0, -0.7]
    samples = [TrainSample([1, 2, 3], [4, 5, 6, 7, 8, 9], 1.5, rollout_logprobs=logprobs, response_mask=mask),
               TrainSample([1, 2], [4, 5], -1.0, rollout_logprobs=[-0.1, -0.2])]
    for mb in (collate(samples, [0, 1]), collate_packed(samples, [0, 1])):
        rows = mb.rows(mb.loss_mask)
        # response id j of a sequence is predicted at position len(prompt) - 1 + j
        assert rows[0, 2:8].tolist() == mask and rows[0].sum() == 3
        assert rows[1, 1:3].tolist() == [True, True] and rows[1].sum() == 2
        assert mb.row_token_counts.tolist() == [3, 2]
        assert mb.rows(mb.per_token["rollout_logprobs"])[0, 2:8].tolist() == pytest.approx(logprobs)
    # single-turn samples (no mask) give the same micro-batch as an all-True mask, bitwise
    plain = [TrainSample([1, 2], [4, 5, 6], 0.5, rollout_logprobs=[-0.1, -0.2, -0.3])]
    masked = [dataclasses.replace(plain[0], response_mask=[True] * 3)]
    for build in (collate, collate_packed):
        a, b = build(plain, [0]), build(masked, [0])
        for name in ("tokens", "targets", "loss_mask", "advantages", "position_ids", "row_token_counts"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


# ----- the local engine ------------------------------------------------------------------------
def test_local_engine_trajectories_logprobs_equal_a_full_forward(tokenizer):
    """collect_rollout_batch with an environment that answers every turn: n trajectories per prompt share a group;
    the engine's log-probs of generated ids equal one forward pass over the whole trajectory
    (each turn continued from the ids); observation ids carry no log-prob and no mask."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from megatron_grpo.algo import AdvantageConfig
    from megatron_grpo.data.prompts import encode_prompts
    from megatron_grpo.data.synthetic import SyntheticTaskConfig, generate_records
    from megatron_grpo.rollout.local import LocalEngine
    from megatron_grpo.rollout.types import SamplingParams
    from megatron_grpo.trainer.rollouts.multi_turn import MultiTurnSettings
    from megatron_grpo.trainer.rollouts.rollout_phase import RolloutSettings, collect_rollout_batch

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=64, vocab_size=len(tokenizer), max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    engine = LocalEngine(model, tokenizer)
    records = generate_records(SyntheticTaskConfig(task="copy", min_digits=2, max_digits=2, num_symbols=4), 3, seed=1)
    prompts, _ = encode_prompts(records, tokenizer, 16)
    limits = EpisodeLimits(max_turns=3, max_new_tokens_per_turn=4, max_length=40, step_timeout_s=5.0)
    settings = RolloutSettings(n=4, sampling=SamplingParams(
        n=4, max_new_tokens=4, seed=5, stop_token_ids=tuple(tokenizer.convert_tokens_to_ids(list("0123456789")))),
        adv_estimator="grpo",
                               advantage_config=AdvantageConfig(),
                               multi_turn=MultiTurnSettings("tests.test_multi_turn:EchoEnvironment", {}, limits))
    batch = collect_rollout_batch(engine, lambda: prompts, tokenizer, None, settings, step=1, num_prompts=3,
                                  in_trainer_thread=False)
    assert len(batch.samples) == 12 and batch.metrics["multi_turn/turns_mean"] > 1.5
    assert sum(not all(s.response_mask) for s in batch.samples) > 6
    for i, sample in enumerate(batch.samples):
        assert sample.prompt_ids == prompts[i // 4].input_ids and len(sample.response_mask) == len(sample.response_ids)
        reference = float64_logprobs(model, sample.prompt_ids, sample.response_ids)
        mask = torch.tensor(sample.response_mask)
        got = torch.tensor(sample.rollout_logprobs, dtype=torch.float64)
        assert torch.all(got[~mask] == 0)
        # fp32 engine vs a float64 log-softmax of the same fp32 logits; KV cache vs full pass
        torch.testing.assert_close(got[mask], reference[mask], atol=64 * torch.finfo(torch.float32).eps * 10, rtol=0)
    # GRPO groups: the 4 trajectories of a prompt share one group id, so their advantages sum to 0
    advantages = torch.tensor([s.advantage for s in batch.samples]).view(3, 4)
    assert torch.allclose(advantages.sum(1), torch.zeros(3), atol=1e-6)


# ----- the trainer: ratio == 1 at step 1 ------------------------------------------------------
def _tool_step(rank, world_size, overrides):
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer import loop
    from megatron_grpo.trainer.setup import build_run

    collect = loop.collect_rollout_batch
    batches = []
    loop.collect_rollout_batch = lambda *a, **k: batches.append(collect(*a, **k)) or batches[-1]
    cfg = load_config("recipes/tiny_cpu_tool.yaml", overrides)
    validate(cfg, world_size=1)
    run = build_run(cfg)
    try:
        metrics = loop.grpo_step(run, 1)
    finally:
        run.close()
    samples = batches[0].samples
    return {"metrics": metrics, "trained": sum(s.trained_tokens for s in samples),
            "masked": sum(len(s.response_ids) - s.trained_tokens for s in samples)}


@pytest.mark.slow
def test_trainer_logprobs_equal_the_engines_over_multi_turn_trajectories(tmp_path):
    """Step 1 of the tiny tool recipe: the trainer's log-probs of every generated id equal the
    engine's (|diff| max), over trajectories with observation ids masked out."""
    overrides = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=8", "logging.console=false",
                 "logging.plot=false", f"logging.output_dir={tmp_path}",
                 # every turn answered (an observation after each), turns ended by any digit (ids 14..23)
                 "rollout.multi_turn.environment=tests.test_multi_turn:EchoEnvironment",
                 "rollout.multi_turn.environment_kwargs={}",
                 f"rollout.stop_token_ids=[{','.join(map(str, range(14, 24)))}]"]
    out = run_distributed(_tool_step, 1, (overrides,), timeout=300)[0]
    metrics = out["metrics"]
    assert out["trained"] > 0 and out["masked"] > 0 and metrics["multi_turn/turns_mean"] > 1.5
    # two fp32 implementations (HF engine, megatron trainer): a few ulp of log-probs up to ~10 in size
    assert metrics["actor/logprob_abs_diff_max"] <= 64 * torch.finfo(torch.float32).eps * 10
    assert metrics["actor/ratio_max_abs_dev"] == 0.0


# ----- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["rollout.multi_turn.max_turns=0"], "rollout.multi_turn.max_turns=0 must be >= 1"),
    (["rollout.multi_turn.max_new_tokens_per_turn=0"], "max_new_tokens_per_turn=0 must be >= 1 or null"),
    (["rollout.multi_turn.max_length=16"], "max_length=16 leaves no room for a turn"),
    (["rollout.multi_turn.step_timeout_s=0"], "step_timeout_s=0.0 must be > 0"),
    (["rollout.multi_turn.turn_reward=discounted", "rollout.multi_turn.discount=0"], "discount=0.0 must be in (0, 1]"),
    (["rollout.multi_turn.discount=0.9"], "has no effect with turn_reward=sum"),
    (["rollout.multi_turn.environment=a:b:"], "expected a built-in name"),
    (["rollout.multi_turn.environment=null"], "rollout.multi_turn.environment is not set (multi-turn is off), but "
                                              "rollout.multi_turn.environment_kwargs={'value_digits': 3"),
])
def test_multi_turn_config_errors(overrides, message):
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.errors import ConfigError

    with pytest.raises(ConfigError, match=None) as info:
        validate(load_config("recipes/tiny_cpu_tool.yaml", overrides), world_size=1)
    assert message in str(info.value)


def test_shipped_tool_recipes_validate():
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer.rollouts.multi_turn import multi_turn_settings

    tiny = load_config("recipes/tiny_cpu_tool.yaml")
    validate(tiny, world_size=1)
    assert multi_turn_settings(tiny).limits == EpisodeLimits(max_turns=3, max_new_tokens_per_turn=6, max_length=48,
                                                             step_timeout_s=30.0)
    big = load_config("recipes/qwen3_8b_gsm8k_tool.yaml")
    validate(big, world_size=8)
    assert multi_turn_settings(big).limits.max_length == 768 + 2304
    assert multi_turn_settings(load_config("tiny_cpu")) is None


def test_python_tool_episode_puts_the_sandbox_output_in_the_trajectory():
    """The GSM8K python environment through the driver: the engine's tool call is run in the
    sandbox, its output comes back as a masked tool observation, the final answer is scored."""
    from megatron_grpo.environments.python_tool import PythonToolEnvironment
    from tests.tiny_hf import CHAR_CHAT_TEMPLATE as TEMPLATE
    from tests.tiny_hf import EOS_ID, char_tokenizer

    tok = char_tokenizer()  # no whitespace in its vocabulary: JSON, prompts and "####42" (flexible) without it
    turns = ['<tool_call>{"name":"python","arguments":{"code":"print(6*7)"}}</tool_call>', "####42"]

    def generate(requests):
        return [TurnOutput(encode(tok, turns[r.turn]) + [EOS_ID], [-0.5] * (len(encode(tok, turns[r.turn])) + 1),
                           "stop", weight_version=0) for r in requests]

    question = PromptRecord(data_source="gsm8k", prompt=[{"role": "user", "content": "6*7?"}], ground_truth="42")
    env = PythonToolEnvironment(timeout_s=5.0, cpu_s=2, memory_mb=512, method="flexible",
                                system_prompt="Use<tool_call>.")
    limits = dataclasses.replace(LIMITS, max_new_tokens_per_turn=128, max_length=400)
    [t] = run_episodes([question], [env], ChatRenderer(tok, TEMPLATE), limits, generate)
    assert t.end == "done" and t.turn_rewards == [None, 1.0]
    first = len(encode(tok, turns[0])) + 1
    # the template closes a turn with "|", not the engine's <eos>: both kept (counted as a mismatch),
    # then the tool turn (the tokenizer has no "\n")
    observation = encode(tok, "|[tool]42|[assistant]")
    assert t.response_ids == encode(tok, turns[0]) + [EOS_ID] + observation + encode(tok, turns[1]) + [EOS_ID]
    assert t.response_mask == [True] * first + [False] * len(observation) + [True] * (len(turns[1]) + 1)
    assert t.counters == {"tool_calls": 1.0, "tool_call_errors": 0.0, "template_mismatch": 1.0}
