"""Reward calls that fail are loud: counted per kind, the first of each kind shown once with its
traceback and input, and a batch in which most calls fail stops the run.

Kinds (metrics reward/errors/<kind>; reward/errors is their sum):
    raised    the function raised, or its worker process died during the call
    timeout   the call ran past reward.timeout_s (its worker was replaced)
    bad_type  the result is not a number or {"score": number, ...} (a str, "1.0", None, a list ...),
              or a batched call returned a list of the wrong length
    nan       the score is NaN or infinite

Every failed sample scores 0. When more than reward.max_error_frac of a batch's samples fail,
RewardFailure names the function, the first failing call's input and its error: a run whose
reward function raises on every call (e.g. a verl file called with the wrong signature) stops at
the first step instead of training on reward 0.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Sequence

from megatron_grpo.errors import MegatronGRPOError

logger = logging.getLogger("megatron_grpo.rewards.runner")  # where the runner's messages always went

KINDS = ("raised", "timeout", "bad_type", "nan")
SHOWN_CHARS = 200  # of each input field in messages


class RewardFailure(MegatronGRPOError):
    """Too many reward calls of one batch failed (reward.max_error_frac)."""


class BadResult(Exception):
    """A reward result that is not a finite score; `kind` is bad_type or nan."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def normalize(result: Any) -> tuple[float, dict[str, float]]:
    """A number (bools count as 0 / 1, as verl's tensors take them) or {"score": x, **metrics}
    -> (score, numeric metrics); BadResult otherwise."""
    if isinstance(result, dict):
        if "score" not in result:
            raise BadResult("bad_type", f"returned a dict without 'score' (keys {sorted(map(str, result))})")
        extras = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, Real)}
        score = result["score"]
    else:
        score, extras = result, {}
    if not isinstance(score, Real):
        raise BadResult("bad_type", f"returned {_short(score)} ({type(score).__name__}); expected a finite "
                                    "number or {'score': number, ...}")
    if not math.isfinite(float(score)):
        raise BadResult("nan", f"returned a non-finite score {float(score)}")
    return float(score), extras


@dataclass(frozen=True)
class CallFailure:
    kind: str     # one of KINDS
    index: int    # the first sample of the failed call (batched calls cover several)
    samples: int  # how many samples the call scored
    detail: str   # traceback text, or what was wrong with the result


@dataclass(frozen=True)
class SampleView:
    """What a message shows of one call's input."""

    prompt: str
    response: str
    ground_truth: Any
    data_source: Any


class FailureReport:
    """Per runner: prints the first failure of each kind once, and applies max_error_frac per batch."""

    def __init__(self, function: str, max_error_frac: float, what: str = "reward function",
                 failure_score: float = 0.0):
        if not 0 <= max_error_frac <= 1:
            raise ValueError(f"max_error_frac must be in [0, 1], got {max_error_frac}")
        self.function = function
        self.what = what  # how messages name it: "reward function", or a model scorer's kind
        self.failure_score_text = f"{failure_score:g}"  # what a failed sample scores
        self.max_error_frac = max_error_frac
        self._shown: set[str] = set()

    def account(self, failures: Sequence[CallFailure], inputs: Sequence[SampleView]) -> dict[str, float]:
        """Metrics for one batch of len(inputs) samples; raises RewardFailure past max_error_frac."""
        counts = dict.fromkeys(KINDS, 0)
        for failure in failures:
            counts[failure.kind] += failure.samples
        failed = sum(counts.values())
        if inputs and failed / len(inputs) > self.max_error_frac:
            first = failures[0]
            raise RewardFailure(
                f"{self.what} {self.function} failed on {failed} of {len(inputs)} calls "
                f"({', '.join(f'{k} {v}' for k, v in counts.items() if v)}), more than reward.max_error_frac="
                f"{self.max_error_frac:g}; first failure ({first.kind}) on {describe_input(inputs[first.index])}: "
                f"{last_line(first.detail)}")
        for failure in failures:
            if failure.kind not in self._shown:
                self._shown.add(failure.kind)
                logger.warning("%s %s: first '%s' failure (scored %s; later ones are only counted in "
                               "reward/errors/%s), on %s:\n%s", self.what, self.function, failure.kind,
                               self.failure_score_text, failure.kind,
                               describe_input(inputs[failure.index]), failure.detail)
        metrics = {"reward/errors": float(failed), "reward/timeouts": float(counts["timeout"])}
        metrics.update({f"reward/errors/{kind}": float(count) for kind, count in counts.items()})
        return metrics


def describe_input(view: SampleView) -> str:
    return (f"data_source={_short(view.data_source)}, ground_truth={_short(view.ground_truth)}, "
            f"response={_short(view.response)}, prompt={_short(view.prompt)}")


def last_line(detail: str) -> str:
    """The exception line of a traceback (or the whole one-line detail)."""
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else detail


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."
