"""Math answer equivalence with `math-verify` (boxed answers, LaTeX, plain numbers).

Both gold and response are parsed by math-verify; the score is 1.0 if any parsed form of the response
is equivalent to the gold answer. math-verify's own timeouts use SIGALRM, which only works in a
main thread; the RewardRunner's per-call timeout is the guarantee, these bound the common case.
"""
from __future__ import annotations

import threading
from typing import Any


def _timeout_or_none(timeout_s: int) -> int | None:
    # signal.alarm cannot be armed outside the main thread; there, rely on the runner's timeout.
    return timeout_s if threading.current_thread() is threading.main_thread() else None


def compute_score(response: str, ground_truth: str, timeout_s: int = 5) -> float:
    from math_verify import parse, verify  # lazy: importing sympy costs ~1 s

    limit = _timeout_or_none(timeout_s)
    gold_text = str(ground_truth)
    # a bare gold like "3/4" or "\frac{3}{4}" parses best when wrapped as a LaTeX formula
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = f"${gold_text}$"
    gold = parse(gold_text, parsing_timeout=limit)
    answer = parse(response, parsing_timeout=limit)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=limit) else 0.0


def reward(prompt: str, response: str, ground_truth: Any, extra: dict | None = None, *,
           timeout_s: int = 5) -> float:
    """The registered reward function."""
    return compute_score(response, str(ground_truth), timeout_s)
