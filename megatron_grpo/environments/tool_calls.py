"""Qwen3 / Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the
assistant's text, and the `<tool_response>` observation that answers them.

A malformed call (unclosed tag, bad JSON, no name, arguments not an object) is reported, not
raised: the environment answers it with an error observation and counts it."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedToolCalls:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per malformed call


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Every `<tool_call>` block of `text`, in order; malformed ones become entries of `errors`."""
    calls, errors = [], []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith(CLOSE):
            errors.append(f"unclosed {OPEN} (no {CLOSE})")
            continue
        try:
            payload = json.loads(body)
        except ValueError as exc:
            errors.append(f"tool call is not valid JSON: {exc}")
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
            errors.append('tool call needs a JSON object with a string "name"')
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments JSON-encoded
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            errors.append(f'tool call {payload["name"]!r}: "arguments" must be a JSON object')
            continue
        calls.append(ToolCall(payload["name"], arguments))
    return ParsedToolCalls(calls, errors)


def tool_response(content: str) -> dict[str, str]:
    """The observation message answering one call: role "tool", which Qwen3's template wraps in
    `<tool_response>` inside a user turn."""
    return {"role": "tool", "content": content}
