"""Ground truths a built-in one-answer scorer can never match, named when the data is loaded
(data/io.py reads them through RecordFormat.ground_truth_problem) instead of scoring every
response 0 for the whole run. The scorers themselves are unchanged (verl's semantics)."""
from __future__ import annotations

from typing import Any, Callable

from megatron_grpo.rewards import by_source, gsm8k

# reward.function -> its check of one normalised answer; math-verify parses any non-empty text
# (the empty answer is refused for every one-answer scorer, data/io.py)
_CHECKS: dict[str, Callable[[Any], str | None]] = {"gsm8k": gsm8k.ground_truth_problem}


def ground_truth_problem(function: str, data_source: str, ground_truth: Any) -> str | None:
    """Why the built-in reward `function` can never score a response correct against
    `ground_truth` in a row of `data_source`, or None. by_data_source checks by the row's scorer."""
    if function == "by_data_source":
        try:
            scorer = by_source.scorer_for(data_source)
        except ValueError:
            return None  # no scorer for that source: each call fails and is counted (by_source.py)
        check = gsm8k.ground_truth_problem if scorer is gsm8k.reward else None
    else:
        check = _CHECKS.get(function)
    return check(ground_truth) if check is not None else None
