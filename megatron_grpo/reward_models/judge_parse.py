"""A judge's answer -> a score, by reward.models.<name>.judge.parse (config/reward_models.py).
Anything the rule cannot read unambiguously raises JudgeParseError: the sample then scores the
scorer's failure_score and counts in reward/errors/bad_type. Nothing is guessed: an answer with
two numbers ("7/10", "between 6 and 8") is ambiguous for parse=number; parse=regex reads such
formats ("Score: (\\d+)")."""
from __future__ import annotations

import math
import re

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
SHOWN = 120  # characters of an answer in messages


class JudgeParseError(ValueError):
    pass


def parse_number(text: str, low: float, high: float) -> float:
    """The one number in `text`, if it lies in [low, high]."""
    found = NUMBER.findall(text)
    if not found:
        raise JudgeParseError(f"no number in the judge's answer {_short(text)}")
    if len(found) > 1:
        raise JudgeParseError(f"{len(found)} numbers ({', '.join(found[:4])}) in the judge's answer {_short(text)}: "
                              f"ambiguous (judge.parse=regex picks one)")
    return _in_range(float(found[0]), low, high, text)


def parse_regex(text: str, pattern: str, low: float, high: float) -> float:
    """`pattern`'s first match in `text`: its first group (else the whole match) as a number in [low, high]."""
    match = re.search(pattern, text)
    if match is None:
        raise JudgeParseError(f"judge.regex {pattern!r} does not match the judge's answer {_short(text)}")
    token = match.group(1) if match.re.groups else match.group(0)
    if token is None or not NUMBER.fullmatch(token.strip()):
        raise JudgeParseError(f"judge.regex {pattern!r} matched {token!r}, not a number, in {_short(text)}")
    return _in_range(float(token), low, high, text)


def parse_yes_no(logprobs: dict[int, float] | None, yes_id: int, no_id: int, min_mass: float) -> float:
    """P(yes) / (P(yes) + P(no)) at the answer's first token, when they hold at least min_mass."""
    if not logprobs or yes_id not in logprobs or no_id not in logprobs:
        raise JudgeParseError(f"the judge returned no log-probs of the yes / no tokens ({yes_id}, {no_id})")
    p_yes, p_no = math.exp(logprobs[yes_id]), math.exp(logprobs[no_id])
    if not math.isfinite(p_yes + p_no) or p_yes + p_no < min_mass:
        raise JudgeParseError(f"yes and no hold {p_yes + p_no:.3g} of the first token's probability, below "
                              f"judge.min_yes_no_mass={min_mass:g}: the judge answered something else")
    return p_yes / (p_yes + p_no)


def _in_range(value: float, low: float, high: float, text: str) -> float:
    if not math.isfinite(value) or not low <= value <= high:
        raise JudgeParseError(f"{value:g} is outside [{low:g}, {high:g}] in the judge's answer {_short(text)}")
    return value


def _short(text: str) -> str:
    return repr(text if len(text) <= SHOWN else text[:SHOWN] + "...")
