"""The interface a multi-turn environment implements, and what one step returns.

One instance per trajectory (the driver builds a fresh one for every sample of every prompt), so
per-episode state lives on `self`. Messages are chat messages, {"role": ..., "content": ...}, as
the chat template renders them."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_grpo.data.records import PromptRecord

Message = dict[str, Any]


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one assistant turn.

    `observations` are appended to the conversation (rendered by the chat template, never trained
    on); `reward` is this turn's reward (None: none this turn); `done` ends the episode."""

    observations: list[Message] = field(default_factory=list)
    reward: Optional[float] = None
    done: bool = False
    # counters summed over the batch into multi_turn/<name> metrics (e.g. tool_call_errors)
    counters: dict[str, float] = field(default_factory=dict)


class Environment(abc.ABC):
    """What the policy talks to between its turns. Built as `Class(**rollout.multi_turn.environment_kwargs)`."""

    @abc.abstractmethod
    def reset(self, record: PromptRecord) -> list[Message]:
        """Starts an episode for one prompt record; returns the initial conversation (rendered with
        the generation prompt to give the first turn's input ids)."""

    @abc.abstractmethod
    def step(self, assistant_message: str) -> StepResult:
        """The assistant's turn, decoded from the engine's ids (the turn's end-of-turn token
        stripped); returns the observations, this turn's reward and whether the episode is over."""

    def close(self) -> None:
        """Releases what the episode holds (processes, scratch directories); called once at its end."""
