"""Prompt records in verl's column layout, validated field by field.

    {"data_source": str, "prompt": [{"role": str, "content": str}, ...], "ability": str,
     "reward_model": {"style": str, "ground_truth": any}, "extra_info": {...}}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # is refused, since it would score every response 0. None: any JSON value, for the user's function.
    scalar_ground_truth_for: str | None = None


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
