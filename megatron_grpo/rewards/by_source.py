"""`by_data_source`: each row scored by the scorer of its data_source, as verl's default scorer
(verl.utils.reward_score.default_compute_score) picks one, so a mixed dataset scores every row by
its own rule.

    openai/gsm8k                                      gsm8k (strict "#### n", as verl)
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
    HuggingFaceH4/MATH-500, math, math_dapo,
    math_dapo_reasoning, aime*, numina_*              math (math-verify equivalence)
    synthetic/digits                                  synthetic (this project's tiny tasks)

verl uses its own MATH / DAPO / PRIME string matchers where this uses math-verify for every math
source: math-verify accepts equivalent forms (\\frac{1}{2} = 0.5) that string matching misses. A
source with no scorer (code, geometry3k, search-R1 ...) raises, which counts as a failed call
(reward.max_error_frac stops a run in which most calls fail); set reward.function to your own.
"""
from __future__ import annotations

from typing import Any, Callable

from megatron_grpo.data.synthetic import DATA_SOURCE as SYNTHETIC_SOURCE
from megatron_grpo.rewards import gsm8k, math_equiv, synthetic

GSM8K_SOURCES = frozenset({"openai/gsm8k"})
MATH_SOURCES = frozenset({
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
    "math", "math_dapo", "math_dapo_reasoning",
})
MATH_PREFIXES = ("aime", "numina_")


def scorer_for(data_source: Any) -> Callable[..., Any]:
    """The native reward function for one data_source; ValueError naming it when there is none."""
    if data_source in GSM8K_SOURCES:
        return gsm8k.reward
    if data_source in MATH_SOURCES or (isinstance(data_source, str) and data_source.startswith(MATH_PREFIXES)):
        return math_equiv.reward
    if data_source == SYNTHETIC_SOURCE:
        return synthetic.reward
    known = sorted(GSM8K_SOURCES | MATH_SOURCES | {SYNTHETIC_SOURCE}) + [f"{p}*" for p in MATH_PREFIXES]
    raise ValueError(f"by_data_source has no scorer for data_source={data_source!r} (known: {', '.join(known)}); "
                     "set reward.function to a function of your own")


def reward(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> Any:
    """The registered reward function ("by_data_source"): reads extra["data_source"]."""
    data_source = (extra or {}).get("data_source")
    return scorer_for(data_source)(prompt, response, ground_truth, extra)
