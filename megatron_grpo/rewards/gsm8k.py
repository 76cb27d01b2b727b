"""GSM8K reward, compatible with verl's `reward_score/gsm8k.py` (strict / flexible extraction).

strict:   the last "#### <number>" in the final 300 characters ("," and "$" stripped);
flexible: the last number in the final 300 characters.
accept_boxed additionally takes the last \\boxed{<number>} when the chosen method finds nothing.

Deliberate differences from verl 0.9 (flexible only; strict is identical):
- verl keeps "," and a sentence-final "." in the flexible answer, so "The answer is 1,000." never
  matches "1000"; we strip both, as strict already strips ",".
- when every candidate is "" or ".", verl returns that last candidate instead of None; we return None.
"""
from __future__ import annotations

import re
from typing import Any, Literal

Method = Literal["strict", "flexible"]

# verl only looks at the tail of the response: regexes on long strings are slow and the answer is last.
TAIL_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_BOXED = re.compile(r"\\boxed\{\s*\$?(\-?[0-9\.\,]+)\s*\}")
# A number as extract_answer returns one (its regexes' characters, "," removed), with a digit: a
# ground truth must look like this for any response to score (checked when the data is loaded).
_ANSWER_FORM = re.compile(r"-?[0-9.]*[0-9][0-9.]*")


def extract_answer(response: str, method: Method = "strict", accept_boxed: bool = False) -> str | None:
    """The final answer string found in `response`, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = response[-TAIL_CHARS:]
    answer: str | None = None
    if method == "strict":
        found = _STRICT.findall(tail)
        if found:
            answer = found[-1].replace(",", "").replace("$", "")
    else:
        for candidate in reversed(_NUMBER.findall(tail)):
            cleaned = candidate.replace(",", "").rstrip(".")
            if cleaned not in ("", "-"):
                answer = cleaned
                break
    if answer is None and accept_boxed:
        boxed = _BOXED.findall(tail)
        if boxed:
            answer = boxed[-1].replace(",", "")
    return answer


def compute_score(
    response: str,
    ground_truth: str,
    method: Method = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    accept_boxed: bool = False,
) -> float:
    """`score` if the extracted answer equals the ground truth (as strings, like verl), `format_score`
    if an answer was found but differs, 0.0 if none was found."""
    answer = extract_answer(response, method, accept_boxed)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score


def reward(prompt: str, response: str, ground_truth: Any, extra: dict | None = None, *,
           method: Method = "strict", format_score: float = 0.0, score: float = 1.0,
           accept_boxed: bool = False) -> float:
    """The registered reward function (signature shared by every reward function)."""
    return compute_score(response, str(ground_truth), method, format_score, score, accept_boxed)


def ground_truth_problem(ground_truth: Any) -> str | None:
    """Why str(ground_truth) can never equal an extracted answer (every response would score 0),
    or None. Scoring itself is unchanged: this only names a ground truth no response can match."""
    if _ANSWER_FORM.fullmatch(str(ground_truth)):
        return None
    return ("it compares the ground truth, as text, with the number it extracts from a response: digits, "
            "'.' and a leading '-', ',' removed; e.g. 1000, not 1,000, $1000 or 1e3")
