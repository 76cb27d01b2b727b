"""verl's own built-in scorers as reward.function, unchanged: verl 0.9.1's code installed --no-deps
(scripts/install_verl_code.sh -> build/verl-0.9.1) and named by file path, as a verl user names a
file in custom_reward_function.path. They declare only some of verl's parameter names
(`compute_score(solution_str, ground_truth, method="strict", ...)`), so they get those by keyword
and keep their own defaults; before, they were called positionally in verl's four-argument order
and failed on every call."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from megatron_grpo.rewards.loader import RewardSpec, load_reward_function
from megatron_grpo.rewards.runner import RewardRequest, RewardRunner
from tests.requirements import missing

REPO = Path(__file__).resolve().parents[1]
REWARD_SCORE = REPO / "build/verl-0.9.1/verl/utils/reward_score"
# verl's scorers whose files import only the standard library (geo3k needs mathruler, math_verify
# math-verify in a process pool, prime_* / sandbox_fusion their own packages).
SCORERS = ("gsm8k", "math_reward", "math_dapo", "search_r1_like_qa_em")


@pytest.fixture(scope="module")
def reward_score() -> Path:
    if not (REWARD_SCORE / "gsm8k.py").is_file():
        missing("verl 0.9.1's code is not in build/verl-0.9.1 (bash scripts/install_verl_code.sh)")
    return REWARD_SCORE


def _verl_module(path: Path):
    """verl's file imported by path (its package __init__ would import Ray): the reference."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"verl_reference_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases(scorer: str, rng: random.Random) -> list[tuple[str, object]]:
    """(response, ground truth) pairs each scorer gets right, wrong or malformed, in its data's
    ground-truth form (search-R1 rows hold {"target": [answers]})."""
    cases = []
    for _ in range(12):
        a = str(rng.randint(0, 999))
        wrong = str(int(a) + 1)
        if scorer == "gsm8k":
            cases += [(f"so it is\n#### {a}", a), (f"#### {wrong}", a), (f"the answer is {a}", a), (f"#### {a}.0", a)]
        elif scorer == "math_reward":
            cases += [(f"so \\boxed{{{a}}}", a), (f"\\boxed{{{wrong}}}", a), (a, a), (f"\\boxed{{{a}.0}}", a)]
        elif scorer == "math_dapo":
            cases += [(f"Answer: {a}", a), (f"Answer: \\boxed{{{a}}}", a), (f"Answer: {wrong}", a), ("none", a)]
        else:
            truth = {"target": [a]}
            cases += [(f"<answer>{a}</answer>", truth), (f"<answer> {a} </answer>", truth),
                      ("<answer>x</answer>", truth), (a, truth)]
    return cases


def _score(result) -> float:
    return float(result["score"] if isinstance(result, dict) else result)


@pytest.mark.parametrize("scorer", SCORERS)
def test_verl_scorer_scores_as_verl_calls_it(reward_score, scorer):
    """Every case scored through reward.function equals verl's function called directly (0 disagreements)."""
    path = reward_score / f"{scorer}.py"
    reference = _verl_module(path).compute_score
    ours = load_reward_function(RewardSpec(f"{path}:compute_score"))
    cases = _cases(scorer, random.Random(0))
    got = [ours(f"question {i}", response, truth, {"data_source": "x", "index": i})
           for i, (response, truth) in enumerate(cases)]
    want = [reference(solution_str=response, ground_truth=truth) for response, truth in cases]
    assert got == want
    assert len({_score(w) for w in want}) > 1, "the cases must tell right from wrong"


def test_verl_gsm8k_in_a_reward_worker_with_its_own_keywords(reward_score):
    """The same in a spawned reward worker, with reward.kwargs reaching verl's own parameters."""
    requests = [RewardRequest(prompt="q", response=response, ground_truth="18", extra={"data_source": "openai/gsm8k"})
                for response in ("#### 18", "the answer is 18", "#### 17")]
    spec = f"{reward_score / 'gsm8k.py'}:compute_score"
    with RewardRunner(spec, num_workers=1, timeout_s=30.0) as runner:
        assert runner.score(requests).scores == [1.0, 0.0, 0.0]
    flexible = {"method": "flexible", "format_score": 0.1}
    with RewardRunner(spec, num_workers=0, timeout_s=None, kwargs=flexible) as runner:
        assert runner.score(requests).scores == [1.0, 1.0, 0.1]  # flexible: the last number; wrong: format_score
