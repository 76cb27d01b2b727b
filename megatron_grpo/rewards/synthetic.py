"""Reward of the synthetic digit tasks (data/synthetic.py): the fraction of answer positions right.

The response's digits, up to the first <|im_end|>, are compared position by position with the target;
dividing by max(len(target), len(answer)) makes an over-long answer lose credit, so the policy learns
to stop. "exact" (1.0 only for the exact answer) is reported as an extra metric.
"""
from __future__ import annotations

from typing import Any

END_OF_TURN = "<|im_end|>"


def answer_digits(response: str) -> str:
    """The digits of the response before the end-of-turn marker; other characters are ignored."""
    return "".join(ch for ch in response.split(END_OF_TURN, 1)[0] if ch in "0123456789")


def score_digits(answer: str, target: str) -> float:
    if not answer and not target:
        return 1.0
    hits = sum(a == b for a, b in zip(answer, target))
    return hits / max(len(answer), len(target))


def reward(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> dict[str, float]:
    """The registered reward function ("synthetic")."""
    target = str(ground_truth)
    answer = answer_digits(response)
    return {"score": score_digits(answer, target), "exact": float(answer == target)}


def leading_zero(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> dict[str, float]:
    """recipes/tiny_cpu_rm.yaml's probe: whether the answer starts with the digit 0, the property its
    reward model was trained to prefer (reward_models/tiny_rm.py), reported as reward/leading_zero.
    It scores 0: the reward is the reward model's; this only shows what the policy learned."""
    return {"score": 0.0, "leading_zero": float(has_leading_zero(response))}


def has_leading_zero(response: str) -> bool:
    return response.startswith("0")
