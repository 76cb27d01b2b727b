"""Multi-turn trajectories under the real Qwen3 chat templates, as TRL 1.16 ships them
(trl/chat_templates/qwen3.jinja, "the original Qwen3 chat template", and qwen3_instruct_2507.jinja,
from the TRL venv scripts/test.sh installs): where the template renders the conversation
incrementally the trajectory is exactly the whole conversation rendered at once; where Qwen3
rewrites history (an earlier turn's empty <think> block is dropped) the engine's ids win, the
observation follows the template's closing, and the mismatch is counted.

The tokenizer is Qwen's real one, built offline from its BPE ranks with Qwen3's added tokens at
their ids (megatron_grpo/testing/qwen_tokenizer.py, tests/test_qwen_tokenizer.py): the ids are the
ones a Qwen3 engine would produce, BPE merges across the template's boundaries included."""
from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from megatron_grpo.data.records import PromptRecord
from megatron_grpo.environments import Environment, StepResult
from megatron_grpo.environments.episodes import ChatRenderer, EpisodeLimits, TurnOutput, run_episodes
from megatron_grpo.environments.tool_calls import tool_response
from tests.requirements import missing

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = sorted(glob.glob(str(REPO / "build/bench-trl-venv/lib/python*/site-packages/trl/chat_templates")))
SPECIAL = ["<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LIMITS = EpisodeLimits(max_turns=4, max_new_tokens_per_turn=200, max_length=2000, step_timeout_s=5.0)


def template(name: str) -> str:
    if not TEMPLATES:
        missing("TRL's chat templates are not installed (build/bench-trl-venv: scripts/test.sh, or "
                "python benchmarks/bench_e2e.py --setup-trl)")
    return (Path(TEMPLATES[-1]) / name).read_text()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from megatron_grpo.testing.qwen_tokenizer import DEFAULT_VOCAB, build_qwen_tokenizer

    if not DEFAULT_VOCAB.is_file():
        missing(f"{DEFAULT_VOCAB} is missing (bash scripts/install_qwen_vocab.sh)")
    tok = AutoTokenizer.from_pretrained(build_qwen_tokenizer())
    assert tok.convert_tokens_to_ids([*SPECIAL, *ADDED]) == [151644, 151645, 151667, 151668, 151657, 151658,
                                                             151665, 151666]
    return tok


def call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


class ToolEnvironment(Environment):
    """Answers a turn with a <tool_call> with two tool messages; any other turn ends the episode
    (with final="user", the first one gets a follow-up user question instead)."""

    def __init__(self, final="done"):
        self.final, self.asked = final, False

    def reset(self, record):
        return list(record.prompt)

    def step(self, assistant_message):
        if "<tool_call>" in assistant_message:
            return StepResult(observations=[tool_response("42"), tool_response("7")])
        if self.final == "user" and not self.asked:  # once: a follow-up question
            self.asked = True
            return StepResult(observations=[{"role": "user", "content": "Are you sure?"}])
        return StepResult(reward=1.0, done=True)


def episode(tokenizer, chat_template, turns, final="done"):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(requests):
        out = []
        for r in requests:
            ids = tokenizer(turns[r.turn], add_special_tokens=False)["input_ids"] + [end]
            out.append(TurnOutput(ids, [-0.5] * len(ids), "stop", weight_version=0))
        return out

    record = PromptRecord("gsm8k", [{"role": "system", "content": "Use python."},
                                    {"role": "user", "content": "What is 6*7?"}], "42")
    [t] = run_episodes([record], [ToolEnvironment(final)], ChatRenderer(tokenizer, chat_template), LIMITS, generate)
    return t


def whole(tokenizer, chat_template, messages):
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name, turns", [
    # Qwen3 thinking: non-empty <think> blocks are kept in the turns after the last user query
    ("qwen3.jinja", ["<think>\nMultiply.\n</think>\n\n" + call("print(6*7)"),
                     "<think>\nIt printed 42.\n</think>\n\n#### 42"]),
    ("qwen3_instruct_2507.jinja", [call("print(6*7)"), "#### 42"]),
])
def test_qwen3_templates_render_tool_episodes_incrementally(tokenizer, name, turns):
    chat_template = template(name)
    t = episode(tokenizer, chat_template, turns)
    assert t.end == "done" and t.counters == {}
    # the template closes the last turn with "\n" after <|im_end|>: not generated, not in the trajectory
    assert t.prompt_ids + t.response_ids == whole(tokenizer, chat_template, t.messages)[:-1]
    observation = tokenizer.decode([i for i, m in zip(t.response_ids, t.response_mask) if not m])
    assert observation == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n"
                           "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_dropping_an_empty_think_block_keeps_the_engine_ids(tokenizer):
    """Qwen3 renders an earlier assistant turn's empty <think> block away: the trajectory keeps the
    engine's ids (what it generated), the observation follows the template's closing, and the
    mismatch is counted; re-rendering would train on ids the engine never produced."""
    chat_template = template("qwen3.jinja")
    turns = ["<think>\n\n</think>\n\n" + call("print(6*7)"), "<think>\n\n</think>\n\n#### 42"]
    t = episode(tokenizer, chat_template, turns)
    assert t.end == "done" and t.counters == {"template_mismatch": 1.0}
    generated = [i for i, m in zip(t.response_ids, t.response_mask) if m]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generated == [i for turn in turns for i in tokenizer(turn, add_special_tokens=False)["input_ids"] + [end]]
    observation = tokenizer.decode([i for i, m in zip(t.response_ids, t.response_mask) if not m])
    assert observation == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n"
                           "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert t.prompt_ids + t.response_ids != whole(tokenizer, chat_template, t.messages)[:-1]


def test_qwen3_a_new_user_query_drops_earlier_reasoning_and_is_counted(tokenizer):
    """A user observation (not a tool response) is a new query: Qwen3 drops the reasoning of the
    turns before it, so the conversation is not rendered incrementally there; the ids still win."""
    chat_template = template("qwen3.jinja")
    turns = ["<think>\nMultiply.\n</think>\n\n42", "<think>\nYes.\n</think>\n\n#### 42"]
    t = episode(tokenizer, chat_template, turns, final="user")
    assert t.counters.get("template_mismatch", 0) >= 1
    first_turn = tokenizer(turns[0], add_special_tokens=False)["input_ids"]
    assert t.response_ids[:len(first_turn)] == first_turn  # the reasoning the engine wrote stays
