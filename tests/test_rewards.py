"""Rewards: gsm8k (verl-compatible), math-verify equivalence, synthetic, user functions, the process-pool runner."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest

from megatron_grpo.errors import ConfigError
from megatron_grpo.rewards import RewardRequest, RewardRunner, load_reward_function
from megatron_grpo.rewards import gsm8k, math_equiv, synthetic

REPO = Path(__file__).resolve().parents[1]
GSM8K_TEST = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
USER_FILE = REPO / "tests" / "data" / "user_rewards.py"


# -- gsm8k -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gsm8k_test_records(tmp_path_factory):
    """The whole GSM8K test split through tools/prepare_gsm8k.py (falls back to the tests/data slice
    only where the shared copy is absent, and then says so)."""
    import sys
    sys.path.insert(0, str(REPO / "tools"))
    import prepare_gsm8k

    source = GSM8K_TEST if GSM8K_TEST.is_file() else REPO / "tests" / "data" / "gsm8k_test_slice.jsonl"
    out = tmp_path_factory.mktemp("gsm8k") / "test.jsonl"
    count = prepare_gsm8k.convert_file(source, out, "test", progress=False)
    raw = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert count == len(rows) == len(raw)
    return source, raw, rows


def test_prepare_gsm8k_layout_and_every_reference_answer_scores_one(gsm8k_test_records):
    source, raw, rows = gsm8k_test_records
    if source == GSM8K_TEST:
        assert len(rows) == 1319
    for original, row in zip(raw, rows):
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        content = row["prompt"][0]["content"]
        assert row["prompt"][0]["role"] == "user"
        assert content == original["question"] + ' Let\'s think step by step and output the final answer after "####".'
        # independent reading of the reference: the text after the last "####", commas removed
        expected = original["answer"].split("####")[-1].strip().replace(",", "")
        assert row["reward_model"] == {"style": "rule", "ground_truth": expected}
        # the reference solution itself is a correct response in both modes
        answer = original["answer"]
        assert gsm8k.reward(content, answer, expected) == 1.0
        assert gsm8k.reward(content, answer, expected, method="flexible") == 1.0


def test_gsm8k_changed_final_number_scores_zero(gsm8k_test_records):
    _, raw, rows = gsm8k_test_records
    for original, row in zip(raw, rows):
        truth = row["reward_model"]["ground_truth"]
        head, _, _ = original["answer"].rpartition("####")
        wrong = str(int(float(truth)) + 1)
        response = f"{head}#### {wrong}"
        assert gsm8k.reward("", response, truth) == 0.0
        assert gsm8k.reward("", response, truth, method="flexible") == 0.0
        assert gsm8k.reward("", response, truth, format_score=0.1) == 0.1


@pytest.mark.parametrize("response, strict, flexible", [
    ("We get 5 + 7 = 12.\n#### 12", 1.0, 1.0),
    ("#### 1,200", None, None),                     # commas stripped: scores against 1200 below
    ("The answer is 12", 0.0, 1.0),                 # no "####": only flexible finds it
    ("#### 12 apples, 3 left", 1.0, 0.0),           # strict takes the #### number, flexible the last
    ("####12", 0.0, 1.0),                           # strict needs "#### " with a space
    ("#### 10\n#### 12", 1.0, 1.0),                 # the last #### wins
    ("#### 12\nso " + "x" * 300, 0.0, 0.0),         # answer outside the last 300 characters
    ("The answer is 12.", 0.0, 1.0),                # flexible strips a sentence-final period
    ("no numbers here", 0.0, 0.0),
])
def test_gsm8k_strict_vs_flexible(response, strict, flexible):
    if strict is None:
        assert gsm8k.reward("", response, "1200") == 1.0
        assert gsm8k.reward("", response, "1200", method="flexible") == 1.0
        return
    assert gsm8k.reward("", response, "12") == strict
    assert gsm8k.reward("", response, "12", method="flexible") == flexible


def test_gsm8k_boxed_option_and_format_score():
    assert gsm8k.reward("", r"so \boxed{42}", "42") == 0.0
    assert gsm8k.reward("", r"so \boxed{42}", "42", accept_boxed=True) == 1.0
    assert gsm8k.reward("", r"so \boxed{4,200}", "4200", accept_boxed=True) == 1.0
    assert gsm8k.reward("", r"\boxed{41}", "42", accept_boxed=True, format_score=0.1) == 0.1
    assert gsm8k.reward("", "#### 41", "42", format_score=0.1) == 0.1
    assert gsm8k.reward("", "no answer", "42", format_score=0.1) == 0.0  # no answer: not even format
    assert gsm8k.reward("", "#### 42", "42", score=2.0) == 2.0
    with pytest.raises(ValueError):
        gsm8k.extract_answer("#### 1", method="loose")


# -- math ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, truth, expected", [
    (r"The answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{3/4}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\dfrac{2}{4}}", r"\frac12", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"$x = 2$", "2", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{2\pi}", r"2 \pi", 1.0),
    (r"\boxed{(1, 2)}", r"(1,2)", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    (r"\boxed{5}", "6", 0.0),
    ("I don't know", "6", 0.0),
])
def test_math_verify_equivalences(response, truth, expected):
    assert math_equiv.reward("", response, truth) == expected


# -- synthetic -----------------------------------------------------------------------------------------

def test_synthetic_reward_partial_credit():
    assert synthetic.reward("", "413", "413") == {"score": 1.0, "exact": 1.0}
    assert synthetic.reward("", "4 1 3<|im_end|>99", "413")["score"] == 1.0   # stops at end of turn
    assert synthetic.reward("", "410", "413")["score"] == pytest.approx(2 / 3)
    assert synthetic.reward("", "4130", "413") == {"score": 0.75, "exact": 0.0}  # too long loses credit
    assert synthetic.reward("", "", "413")["score"] == 0.0
    assert synthetic.reward("", "assistant", "413")["score"] == 0.0


# -- user functions and the runner ---------------------------------------------------------------------

def test_load_reward_function_specs(tmp_path, monkeypatch):
    assert load_reward_function("gsm8k") is gsm8k.reward
    assert load_reward_function("megatron_grpo.rewards.math_equiv:reward") is math_equiv.reward
    fn = load_reward_function(f"{USER_FILE}:length_match")
    assert fn("", "a", "a", {}) == {"score": 1.0, "length": 1.0}
    monkeypatch.chdir(REPO)
    assert load_reward_function("tests/data/user_rewards.py:length_match") is fn  # same file, same module
    for bad, words in [("nope", "built-in name"), ("missing.py:fn", "does not exist"),
                       (f"{USER_FILE}:absent", "no callable named 'absent'"),
                       ("no_such_module_xyz:fn", "cannot import module")]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_reward_function(bad)


@pytest.fixture(scope="module")
def pool():
    """One two-worker pool for the module: spawning workers costs seconds on a busy machine."""
    with RewardRunner(f"{USER_FILE}:length_match", num_workers=2, timeout_s=3.0) as runner:
        yield runner


def _requests(responses, truth="ok"):
    return [RewardRequest(prompt=f"p{i}", response=r, ground_truth=truth, extra={}) for i, r in enumerate(responses)]


def test_runner_results_in_input_order_with_metrics(pool):
    responses = ["ok", "no", "ok", "okay", "ok", "x"]
    result = pool.score(_requests(responses))
    assert result.scores == [float(r == "ok") for r in responses]
    assert result.metrics["reward/errors"] == 0.0
    assert result.metrics["reward/length"] == pytest.approx(sum(map(len, responses)) / len(responses))
    assert [m["length"] for m in result.sample_metrics] == [float(len(r)) for r in responses]


@pytest.mark.slow
def test_runner_survives_raising_hanging_dying_and_bad_results(pool, caplog):
    responses = ["ok", "raise", "hang", "ok", "die", "text", "ok", "no"]
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.rewards.runner"):
        result = pool.score(_requests(responses))
        elapsed = time.monotonic() - started
        # the batch finished although one call never returns: the 3 s timeout, not the 1 h sleep
        assert elapsed < 60
        assert result.scores == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
        assert result.errors == [False, True, True, False, True, True, False, False]
        assert result.metrics["reward/errors"] == 4.0
        assert result.metrics["reward/timeouts"] == 1.0
        # the pool still works afterwards (the hung and the dead worker were replaced)
        again = pool.score(_requests(["ok", "raise", "ok"]))
        assert again.scores == [1.0, 0.0, 1.0] and again.metrics["reward/errors"] == 1.0
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1  # the first traceback only
    assert "ValueError: this response makes the reward function raise" in failures[0].getMessage()
    assert pool.workers_replaced >= 2


def test_runner_batched_form_and_kwargs():
    with RewardRunner(f"{USER_FILE}:batched_match", num_workers=0, timeout_s=None, batched=True,
                      chunk_size=2) as runner:
        reqs = [RewardRequest("", r, "ok", {"bonus": b}) for r, b in
                [("ok", 0.0), ("no", 0.5), ("ok", 0.25), ("raise", 0.0), ("ok", 0.0)]]
        result = runner.score(reqs)
        # chunks of 2: [ok, no] [ok, raise] [ok]; the chunk with "raise" fails as a whole
        assert result.scores == [1.0, 0.5, 0.0, 0.0, 1.0]
        assert result.metrics["reward/errors"] == 2.0
    with RewardRunner(f"{USER_FILE}:scaled", num_workers=0, timeout_s=None, kwargs={"factor": 3.0}) as runner:
        assert runner.score(_requests(["ok", "no"])).scores == [3.0, 0.0]


def test_runner_builtin_in_process_and_config_errors():
    with RewardRunner("synthetic", num_workers=0, timeout_s=None) as runner:
        result = runner.score(_requests(["413", "410"], truth="413"))
        assert result.scores == pytest.approx([1.0, 2 / 3])
        assert result.metrics["reward/exact"] == 0.5
    with pytest.raises(ConfigError, match="timeout_s"):
        RewardRunner("gsm8k", num_workers=0, timeout_s=5.0)
    with pytest.raises(ConfigError, match="no callable"):
        RewardRunner(f"{USER_FILE}:absent", num_workers=0, timeout_s=None)
