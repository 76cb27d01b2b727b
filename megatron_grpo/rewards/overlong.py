"""DAPO's soft overlong punishment (verl's `dapo` reward manager, `overlong_buffer_cfg`).

A response of L tokens (its EOS included, as verl's valid response length counts it) under a cap
of `max_response_length` tokens, with a buffer of `length` tokens before the cap, gets

    penalty(L) = min(-(L - (max_response_length - length)) / length * penalty_factor, 0)

added to its score: 0 up to `max_response_length - length` tokens, then falling linearly to
-penalty_factor at the cap (DAPO paper, eq. 13). The score before it stays the group filter's
`acc` / `score` metric, as in verl's DAPO trainer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class OverlongPenalty:
    max_response_length: int  # verl's reward_kwargs.max_resp_len (normally data.max_response_length)
    length: int  # the buffer: tokens before the cap where the penalty grows
    penalty_factor: float

    def __call__(self, response_length: int) -> float:
        expected = self.max_response_length - self.length
        return min(-(response_length - expected) / self.length * self.penalty_factor, 0.0)

    def penalties(self, response_lengths: Sequence[int]) -> list[float]:
        return [self(length) for length in response_lengths]


def overlong_metrics(penalties: Sequence[float]) -> dict[str, float]:
    """What verl logs with overlong_buffer_cfg.log: the mean penalty and the penalised fraction."""
    count = max(len(penalties), 1)
    return {"reward/overlong_penalty_mean": sum(penalties) / count,
            "reward/overlong_frac": sum(1 for p in penalties if p < 0) / count}
