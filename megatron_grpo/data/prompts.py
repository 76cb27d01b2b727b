"""Chat formatting and tokenization of prompt records, with a policy for over-long prompts.

The chat template is the tokenizer's own (apply_chat_template) or a Jinja template string from the
recipe, rendered by the same HF machinery; the generation prompt (assistant header) is appended.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Sequence

from megatron_grpo.data.records import PromptRecord
from megatron_grpo.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

OverlongPolicy = Literal["filter", "truncate_left", "truncate_right", "error"]
OVERLONG_POLICIES = ("filter", "truncate_left", "truncate_right", "error")


@dataclass(frozen=True)
class EncodedPrompt:
    record: PromptRecord
    text: str              # the chat-formatted prompt, before truncation
    input_ids: list[int]   # at most max_prompt_length tokens
    truncated: bool


@dataclass(frozen=True)
class EncodeStats:
    total: int
    kept: int
    filtered: int
    truncated: int


def render_chat(messages: Sequence[dict], tokenizer, chat_template: str | None = None) -> str:
    """The prompt text: messages formatted by `chat_template` (a Jinja string) or the tokenizer's own."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the tokenizer has no chat template: set data.chat_template to a Jinja template string")
    return tokenizer.apply_chat_template(list(messages), chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=True)


def encode_prompts(records: Sequence[PromptRecord], tokenizer, max_prompt_length: int,
                   overlong: OverlongPolicy = "filter", chat_template: str | None = None,
                   source: str = "dataset") -> tuple[list[EncodedPrompt], EncodeStats]:
    """Formats and tokenizes every record. Prompts longer than max_prompt_length tokens are dropped
    ("filter", counted and logged), cut ("truncate_left" keeps the end, where the question and the
    assistant header are; "truncate_right" keeps the start) or rejected ("error": DataError)."""
    if overlong not in OVERLONG_POLICIES:
        raise ConfigError(f"data.overlong_prompts must be one of {', '.join(OVERLONG_POLICIES)}, got {overlong!r}")
    if max_prompt_length < 1:
        raise ConfigError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
    kept: list[EncodedPrompt] = []
    filtered = truncated = 0
    for index, record in enumerate(records):
        text = render_chat(record.prompt, tokenizer, chat_template)
        # the template already holds the special tokens; adding BOS again would double it
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) <= max_prompt_length:
            kept.append(EncodedPrompt(record, text, ids, False))
        elif overlong == "filter":
            filtered += 1
        elif overlong == "error":
            raise DataError(f"{source}: record {index + 1} has a {len(ids)}-token prompt, more than "
                            f"data.max_prompt_length={max_prompt_length}")
        else:
            truncated += 1
            ids = ids[-max_prompt_length:] if overlong == "truncate_left" else ids[:max_prompt_length]
            kept.append(EncodedPrompt(record, text, ids, True))
    if filtered or truncated:
        logger.warning("%s: %d of %d prompts are longer than %d tokens: %d filtered out, %d truncated",
                       source, filtered + truncated, len(records), max_prompt_length, filtered, truncated)
    if not kept:
        raise DataError(f"{source}: every prompt is longer than data.max_prompt_length={max_prompt_length}")
    return kept, EncodeStats(len(records), len(kept), filtered, truncated)
