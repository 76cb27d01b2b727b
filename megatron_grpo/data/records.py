"""Prompt records in verl's column layout, validated field by field.

    {"data_source": str, "prompt": [{"role": str, "content": str}, ...], "ability": str,
     "reward_model": {"style": str, "ground_truth": any}, "extra_info": {...}}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_grpo.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PromptRecord:
    data_source: str
    prompt: list[dict[str, str]]
    ground_truth: Any
    ability: str = ""
    reward_style: str = "rule"
    extra_info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"data_source": self.data_source, "prompt": [dict(m) for m in self.prompt],
                "ability": self.ability,
                "reward_model": {"style": self.reward_style, "ground_truth": self.ground_truth},
                "extra_info": dict(self.extra_info)}


@dataclass(frozen=True)
class RecordFormat:
    """How a dataset's rows are read (from the recipe's data.* and reward.* keys)."""

    prompt_key: str = "prompt"  # the column with the chat messages (verl's data.prompt_key)
    reward_fn_key: str = "data_source"  # the column read as the row's data_source (verl's data.reward_fn_key)
    # A scorer that compares one answer (the built-in gsm8k / math): a list or object ground truth
    # is refused, since it would score every response 0, and the answer is normalised as
    # scalar_answer() says. None: any JSON value, as the file has it, for the user's function.
    scalar_ground_truth_for: str | None = None
    # That scorer's own test of a (normalised) answer, given the row's data_source: why it can never
    # score a response correct, or None (rewards/answers.py; the trainer passes it). None: no test.
    ground_truth_problem: Callable[[str, Any], str | None] | None = None


def scalar_answer(value: Any) -> Any:
    """The answer a one-answer scorer compares as str(ground_truth): an integral float (what a
    pandas or parquet float column holds for the answer 72) as "72", a string without surrounding
    whitespace; anything else unchanged. str(72.0) is "72.0", which "#### 72" never equals."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str):
        return value.strip()
    return value


def _column_problem(obj: dict, column: str, default: str, config_key: str, expected: str) -> str:
    """'<column>' (<config_key> when renamed) must be <expected>; the row's keys when it is absent."""
    named = "" if column == default else f" ({config_key})"
    keys = f"; the row's keys: {', '.join(map(str, obj))}" if column not in obj else ""
    return f"'{column}'{named} must be {expected}{keys}"


def parse_record(obj: Any, where: str, fmt: RecordFormat = RecordFormat()) -> PromptRecord:
    """A PromptRecord from one decoded row; DataError "<where>: <what is wrong>" otherwise."""
    def fail(what: str) -> DataError:
        return DataError(f"{where}: {what}")

    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    prompt_key, source_key = fmt.prompt_key, fmt.reward_fn_key
    data_source = obj.get(source_key)
    if not isinstance(data_source, str) or not data_source:
        raise fail(_column_problem(obj, source_key, "data_source", "data.reward_fn_key", "a non-empty string"))
    prompt = obj.get(prompt_key)
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise fail(_column_problem(obj, prompt_key, "prompt", "data.prompt_key",
                                   "a non-empty list of chat messages {role, content}"))
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise fail(f"{prompt_key}[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise fail(f"{prompt_key}[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise fail(f"{prompt_key}[{i}].content must be a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    asked = [m["content"] for m in messages if m["role"] == "user"] or [m["content"] for m in messages]
    if not any(text.strip() for text in asked):
        which = "user message" if any(m["role"] == "user" for m in messages) else "message"
        raise fail(f"'{prompt_key}' asks nothing: every {which}'s content is empty or whitespace only")
    reward_model = obj.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise fail("'reward_model' must be an object with 'ground_truth' (and 'style')")
    if reward_model["ground_truth"] is None:
        raise fail("reward_model.ground_truth is null")
    ability = obj.get("ability") or ""
    if not isinstance(ability, str):
        raise fail("'ability' must be a string")
    extra_info = obj.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise fail("'extra_info' must be an object")
    return PromptRecord(data_source=data_source, prompt=messages, ground_truth=reward_model["ground_truth"],
                        ability=ability, reward_style=str(reward_model.get("style") or "rule"),
                        extra_info=dict(extra_info))
