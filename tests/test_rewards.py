"""Rewards: gsm8k (verl-compatible), math-verify equivalence, synthetic, user functions, the process-pool runner."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest

from megatron_grpo.errors import ConfigError, MegatronGRPOError
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


def test_stream_scores_groups_as_they_arrive_and_equals_score(pool):
    """Groups submitted from another thread, out of order, while the first ones are being scored:
    the result is score()'s on the batch in key order, and the first group is scored before the
    last is even submitted."""
    import threading

    groups = [["ok", "no"], ["okay", "ok"], ["x", "ok"], ["ok", "ok"]]
    stream = pool.stream()
    scored_before_the_rest: list[int] = []

    def engine():  # submits like an engine's callback: completion order, not request order
        for key in (2, 0):
            stream.submit(key, _requests(groups[key]))
        deadline = time.monotonic() + 30
        while not stream.feed.done_at and time.monotonic() < deadline:
            time.sleep(0.01)
        scored_before_the_rest.append(len(stream.feed.done_at))
        for key in (3, 1):
            stream.submit(key, _requests(groups[key]))

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    result = stream.result()
    assert scored_before_the_rest[0] >= 1 and len(stream.feed.done_at) == 8
    whole = pool.score(_requests([r for group in groups for r in group]))
    assert result.scores == whole.scores and result.sample_metrics == whole.sample_metrics
    assert result.metrics["reward/length"] == whole.metrics["reward/length"]
    assert 0 <= result.metrics["reward/first_latency_s"] < 30 and 0 <= result.metrics["reward/last_latency_s"] < 30
    with pytest.raises(RuntimeError, match="after result"):
        stream.submit(4, _requests(["ok"]))


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
        # 4 of 8 failed: not more than reward.max_error_frac=0.5, so the batch is scored
        assert result.metrics["reward/errors"] == 4.0
        assert result.metrics["reward/timeouts"] == 1.0
        assert {k: result.metrics[f"reward/errors/{k}"] for k in ("raised", "timeout", "bad_type", "nan")} == {
            "raised": 2.0, "timeout": 1.0, "bad_type": 1.0, "nan": 0.0}  # raised: the exception and the dead worker
        # the pool still works afterwards (the hung and the dead worker were replaced)
        again = pool.score(_requests(["ok", "raise", "ok"]))
        assert again.scores == [1.0, 0.0, 1.0] and again.metrics["reward/errors/raised"] == 1.0
    shown = [r.getMessage() for r in caplog.records if "first '" in r.getMessage()]
    # the first failure of each kind, once, with its input and traceback / reason
    assert [m.split("first '")[1].split("'")[0] for m in shown] == ["raised", "timeout", "bad_type"]
    assert "response='raise'" in shown[0] and "ValueError: this response makes the reward function raise" in shown[0]
    assert "timed out after 3.0 s" in shown[1]
    assert "returned 'not a number' (str)" in shown[2]
    assert pool.workers_replaced >= 2


def test_in_process_reward_that_hangs_times_out_and_the_run_goes_on(caplog):
    """reward.num_workers=0 (tiny_cpu's) once waited forever on a hung call. It gets the pool's
    timeout: the call is given up on after reward.timeout_s (scored 0, reward/errors/timeout, logged
    once), its thread abandoned, and the next calls and batches run in a new one."""
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.rewards.runner"), \
            RewardRunner(f"{USER_FILE}:length_match", num_workers=0, timeout_s=0.5) as runner:
        result = runner.score(_requests(["ok", "hang", "ok", "no"]))
        assert time.monotonic() - started < 30  # the 0.5 s timeout, not the 1 h sleep
        assert result.scores == [1.0, 0.0, 1.0, 0.0] and result.errors == [False, True, False, False]
        assert result.metrics["reward/timeouts"] == 1.0 and result.metrics["reward/errors/timeout"] == 1.0
        stream = runner.stream()  # reward.score_while_generating's path
        stream.submit(0, _requests(["no", "ok"]))
        assert stream.result().scores == [0.0, 1.0] and runner.abandoned_calls == 1
    [shown] = [r.getMessage() for r in caplog.records if "first 'timeout'" in r.getMessage()]
    assert "timed out after 0.5 s" in shown and "reward.num_workers >= 1 kills a hung call" in shown


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
    with pytest.raises(ConfigError, match="no callable"):
        RewardRunner(f"{USER_FILE}:absent", num_workers=0, timeout_s=None)


# -- verl reward functions, unchanged --------------------------------------------------------------

# Written as verl documents them (docs/preparation/reward_function.rst; the batched form is what
# BatchRewardManager calls): each records what it was given, so the test sees verl's arguments.
VERL_REWARDS = """
import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "openai/gsm8k":
        score = float(solution_str.strip() == ground_truth)
    else:
        raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
    return {"score": score, "seen": json.dumps([data_source, solution_str, ground_truth, extra_info])}


def my_reward_fn(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 100


def compute_score_batched(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [float(s == g) * kwargs.get("scale", 1.0) + 0.5 * (d == "b")
            for d, s, g in zip(data_sources, solution_strs, ground_truths)]


async def compute_score_async(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str == ground_truth)


def renamed(source, text, gold, info=None):
    return {"score": float(text == gold), "source_is_b": float(source == "b")}


def two_args(solution_str, ground_truth):
    return float(solution_str == ground_truth)


def needs_a_key(solution_str, ground_truth, key):
    return 1.0
"""


@pytest.fixture
def verl_file(tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_REWARDS)
    return path


def _verl_requests(rows):
    return [RewardRequest(prompt=f"question {i}", response=response, ground_truth=truth,
                          extra={"index": i, "data_source": source})
            for i, (source, response, truth) in enumerate(rows)]


def test_verl_compute_score_gets_verl_arguments_in_process_and_in_workers(verl_file):
    """An unchanged verl compute_score is called as verl calls it: data_source (not the prompt),
    solution_str, ground_truth, extra_info; in the trainer process and in a worker process."""
    from megatron_grpo.rewards.loader import RewardSpec

    rows = [("openai/gsm8k", "42", "42"), ("openai/gsm8k", "41", "42")]
    fn = load_reward_function(RewardSpec(f"{verl_file}:compute_score"))
    seen = [json.loads(fn(r.prompt, r.response, r.ground_truth, r.extra)["seen"]) for r in _verl_requests(rows)]
    assert seen == [["openai/gsm8k", "42", "42", {"index": 0, "data_source": "openai/gsm8k"}],
                    ["openai/gsm8k", "41", "42", {"index": 1, "data_source": "openai/gsm8k"}]]
    for workers, timeout in ((0, None), (1, 30.0)):
        with RewardRunner(f"{verl_file}:compute_score", num_workers=workers, timeout_s=timeout) as runner:
            result = runner.score(_verl_requests(rows))
        assert result.scores == [1.0, 0.0] and result.metrics["reward/errors"] == 0.0


def test_verl_batched_async_and_documented_example(verl_file):
    with RewardRunner(f"{verl_file}:compute_score_batched", num_workers=0, timeout_s=None,
                      kwargs={"scale": 2.0}) as runner:  # batched: decided from the parameter names
        assert runner.batched
        result = runner.score(_verl_requests([("a", "x", "x"), ("b", "x", "y"), ("b", "y", "y")]))
        assert result.scores == [2.0, 0.5, 2.5]
    with RewardRunner(f"{verl_file}:compute_score_async", num_workers=0, timeout_s=None) as runner:
        assert runner.score(_verl_requests([("a", "x", "x"), ("a", "x", "y")])).scores == [1.0, 0.0]
    with RewardRunner(f"{verl_file}:my_reward_fn", num_workers=0, timeout_s=None) as runner:
        assert runner.score(_verl_requests([("a", "abcd", "x")])).scores == [0.04]


def test_signature_override(verl_file):
    rows = [("b", "x", "x"), ("a", "x", "y")]
    # renamed parameters: auto sees a native function (called with the prompt first) ...
    with RewardRunner(f"{verl_file}:renamed", num_workers=0, timeout_s=None) as runner:
        result = runner.score(_verl_requests(rows))
        assert [m["source_is_b"] for m in result.sample_metrics] == [0.0, 0.0]
    # ... reward.signature=verl passes verl's arguments in verl's order
    with RewardRunner(f"{verl_file}:renamed", num_workers=0, timeout_s=None, signature="verl") as runner:
        result = runner.score(_verl_requests(rows))
        assert result.scores == [1.0, 0.0] and [m["source_is_b"] for m in result.sample_metrics] == [1.0, 0.0]
    # reward.signature=native on a verl-named function: the prompt goes first, as for any native one
    with RewardRunner(f"{verl_file}:compute_score", num_workers=0, timeout_s=None, signature="native",
                      max_error_frac=1.0) as runner:
        assert runner.score(_verl_requests([("openai/gsm8k", "x", "x")])).errors == [True]  # data_source = prompt


def test_some_of_verls_names_are_passed_by_keyword_and_wrong_arity_is_a_config_error(verl_file):
    # two_args(solution_str, ground_truth) declares two of verl's names: it gets those two (verl's own
    # scorers look like this: tests/test_verl_scorers.py)
    with RewardRunner(f"{verl_file}:two_args", num_workers=0, timeout_s=None) as runner:
        assert runner.score(_verl_requests([("a", "x", "x")])).scores == [1.0]
    with pytest.raises(ConfigError, match=r"needs_a_key takes \(solution_str, ground_truth, key\), but is called "
                                          r"as verl \(data_source, solution_str, ground_truth, extra_info\): "
                                          r"missing a required argument: 'key'"):
        RewardRunner(f"{verl_file}:needs_a_key", num_workers=0, timeout_s=None)
    with pytest.raises(ConfigError, match=r"my_reward_fn takes .* called as verl .*unexpected keyword argument 'k'"):
        RewardRunner(f"{verl_file}:my_reward_fn", num_workers=0, timeout_s=None, kwargs={"k": 1})


BAD_REWARDS = """
import math


def always_raises(prompt, response, ground_truth, extra):
    return 1 / 0


def returns(prompt, response, ground_truth, extra):
    return {"str": "1.0", "none": None, "nan": math.nan, "inf": -math.inf, "list": [1.0], "true": True,
            "nodict": {"acc": 1.0}, "one": 1, "float": 0.5}[response]
"""


@pytest.fixture
def bad_file(tmp_path):
    path = tmp_path / "bad_reward.py"
    path.write_text(BAD_REWARDS)
    return path


def test_mostly_failing_batch_stops_with_one_error_naming_function_input_and_exception(bad_file):
    from megatron_grpo.rewards import RewardFailure

    with RewardRunner(f"{bad_file}:always_raises", num_workers=0, timeout_s=None) as runner:
        with pytest.raises(RewardFailure) as info:
            runner.score(_verl_requests([("openai/gsm8k", "#### 3", "3"), ("x", "y", "z")]))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"reward function {bad_file}:always_raises failed on 2 of 2 calls (raised 2), "
                              "more than reward.max_error_frac=0.5; first failure (raised) on "
                              "data_source='openai/gsm8k', ground_truth='3', response='#### 3', prompt='question 0': ")
    assert message.endswith("ZeroDivisionError: division by zero")


def test_bad_results_are_counted_by_kind(bad_file, caplog):
    kinds = {"str": "bad_type", "none": "bad_type", "list": "bad_type", "nodict": "bad_type", "nan": "nan",
             "inf": "nan"}
    responses = [*kinds, "true", "one", "float"]
    with RewardRunner(f"{bad_file}:returns", num_workers=0, timeout_s=None, max_error_frac=1.0) as runner:
        with caplog.at_level(logging.WARNING, logger="megatron_grpo.rewards.runner"):
            result = runner.score(_requests(responses))
            runner.score(_requests(["str", "nan"]))  # shown already: counted, not printed again
    assert result.scores == [0.0] * 6 + [1.0, 1.0, 0.5]  # bools count as 0 / 1, as in verl's reward tensor
    assert result.errors == [True] * 6 + [False] * 3
    assert (result.metrics["reward/errors/bad_type"], result.metrics["reward/errors/nan"]) == (4.0, 2.0)
    assert result.metrics["reward/errors"] == 6.0 and result.metrics["reward/errors/raised"] == 0.0
    shown = [r.getMessage() for r in caplog.records]
    assert len(shown) == 2
    assert "first 'bad_type' failure" in shown[0] and "returned '1.0' (str)" in shown[0]
    assert "first 'nan' failure" in shown[1] and "non-finite score nan" in shown[1]
    for limit, stops in ((0.0, True), (0.5, True), (0.7, False)):  # 6 of 9 failed = 0.67
        with RewardRunner(f"{bad_file}:returns", num_workers=0, timeout_s=None, max_error_frac=limit) as runner:
            if stops:
                with pytest.raises(MegatronGRPOError, match="more than reward.max_error_frac"):
                    runner.score(_requests(responses))
            else:
                assert runner.score(_requests(responses)).metrics["reward/errors"] == 6.0


def test_by_data_source_scores_each_row_by_its_source():
    """A mixed batch: each row gets the score its own source's scorer gives (the scorers alone are
    the reference); a source with no scorer is a raised failure naming it."""
    rows = [("openai/gsm8k", "so #### 42", "42"), ("openai/gsm8k", "so #### 41", "42"),
            ("HuggingFaceH4/MATH-500", "the answer is \\boxed{\\frac{1}{2}}", "0.5"),
            ("lighteval/MATH", "\\boxed{3}", "4"), ("aime_2024", "\\boxed{17}", "17"),
            ("synthetic/digits", "314<|im_end|>", "413"), ("codecontests", "print(1)", "1")]
    with RewardRunner("by_data_source", num_workers=0, timeout_s=None) as runner:
        result = runner.score(_verl_requests(rows))
    expected = [gsm8k.compute_score("so #### 42", "42"), gsm8k.compute_score("so #### 41", "42"),
                math_equiv.compute_score("the answer is \\boxed{\\frac{1}{2}}", "0.5"),
                math_equiv.compute_score("\\boxed{3}", "4"), math_equiv.compute_score("\\boxed{17}", "17"),
                synthetic.reward("", "314<|im_end|>", "413")["score"], 0.0]
    assert result.scores == expected == [1.0, 0.0, 1.0, 0.0, 1.0, pytest.approx(1 / 3), 0.0]
    assert result.errors == [False] * 6 + [True]
    assert result.metrics["reward/errors/raised"] == 1.0
