"""environments/: the tool-call parser, loading environments by spec, the lookup task, the python
tool and its sandbox (stopped and reported, never crashing the run)."""
from __future__ import annotations

import json
import os
import time

import pytest

from megatron_grpo.data.records import PromptRecord
from megatron_grpo.environments import Environment, StepResult
from megatron_grpo.environments.loader import build_environment, load_environment_class
from megatron_grpo.environments.lookup import LookupEnvironment, value_of
from megatron_grpo.environments.python_tool import PythonToolEnvironment
from megatron_grpo.environments.sandbox import SandboxLimits, run_python
from megatron_grpo.environments.tool_calls import ToolCall, parse_tool_calls
from megatron_grpo.errors import ConfigError


def record(digits="31", index=0, ground_truth="", prompt=None):
    return PromptRecord(data_source="test", prompt=prompt or [{"role": "user", "content": digits}],
                        ground_truth=ground_truth, extra_info={"digits": digits, "index": index})


# ----- tool-call parser ------------------------------------------------------------------------
def call(payload) -> str:
    return f"<tool_call>\n{payload if isinstance(payload, str) else json.dumps(payload)}\n</tool_call>"


def test_parser_reads_hermes_calls_in_order():
    text = "thinking " + call({"name": "python", "arguments": {"code": "print(1)"}}) + " and " + \
        call({"name": "lookup", "arguments": json.dumps({"key": "3"})})  # JSON-encoded arguments too
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("python", {"code": "print(1)"}), ToolCall("lookup", {"key": "3"})]
    assert parsed.errors == []
    assert parse_tool_calls("no call here").calls == []


@pytest.mark.parametrize("text, error", [
    (call("{not json"), "not valid JSON"),
    (call({"arguments": {}}), 'string "name"'),
    (call([1, 2]), 'string "name"'),
    (call({"name": "python", "arguments": [1]}), '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "python"', "unclosed"),
])
def test_parser_reports_malformed_calls(text, error):
    parsed = parse_tool_calls(text + call({"name": "ok", "arguments": {}}) if "unclosed" not in error else text)
    assert len(parsed.errors) == 1 and error in parsed.errors[0]


# ----- loading ---------------------------------------------------------------------------------
class CountingEnvironment(Environment):
    def __init__(self, limit: int = 2):
        self.limit, self.turns = limit, 0

    def reset(self, record):
        return list(record.prompt)

    def step(self, assistant_message):
        self.turns += 1
        return StepResult(reward=1.0, done=self.turns >= self.limit)


def test_load_builtin_module_and_file_specs(tmp_path):
    assert load_environment_class("lookup") is LookupEnvironment
    assert load_environment_class("python_gsm8k") is PythonToolEnvironment
    assert load_environment_class("tests.test_environments:CountingEnvironment").__name__ == "CountingEnvironment"
    path = tmp_path / "my_env.py"
    path.write_text("from megatron_grpo.environments import Environment, StepResult\n"
                    "class Echo(Environment):\n"
                    "    def reset(self, record): return list(record.prompt)\n"
                    "    def step(self, text): return StepResult(done=True)\n")
    env = build_environment(f"{path}:Echo", {})
    assert type(env).__name__ == "Echo" and env.step("x").done
    assert build_environment("tests.test_environments:CountingEnvironment", {"limit": 5}).limit == 5


@pytest.mark.parametrize("spec, kwargs, message", [
    ("nonsense", {}, "expected a built-in name"),
    ("no_such_module_xyz:Env", {}, "cannot import module 'no_such_module_xyz'"),
    ("tests.data.user_rewards:Env", {}, "no Environment subclass named 'Env'"),
    ("tests.test_environments:Missing", {}, "no Environment subclass named 'Missing'"),
    ("tests.test_environments:record", {}, "no Environment subclass named 'record'"),
    ("/no/such/file.py:Env", {}, "does not exist"),
    ("lookup", {"colour": 1}, "environment_kwargs ['colour'] do not fit LookupEnvironment"),
])
def test_bad_specs_are_one_config_error_naming_them(spec, kwargs, message):
    with pytest.raises(ConfigError) as info:
        build_environment(spec, kwargs)
    assert message in str(info.value)
    if "kwargs" not in message:
        assert repr(spec) in str(info.value)


# ----- the lookup task -------------------------------------------------------------------------
def test_lookup_needs_the_tool_and_rewards_per_turn():
    env = LookupEnvironment(value_digits=3, num_symbols=4, lookup_reward=0.2, seed=7)
    assert env.reset(record("31", index=5)) == [{"role": "user", "content": "31"}]
    value = value_of(7, 5, "31", 3, 4)
    assert len(value) == 3 and set(value) <= set("0123")
    first = env.step(":31")
    assert first.observations == [{"role": "user", "content": value}] and first.reward == 0.2 and not first.done
    assert env.step(": 31").reward is None  # the lookup reward is paid once
    final = env.step(value)
    assert final.done and final.reward == pytest.approx(0.8)
    wrong = "".join("1" if c != "1" else "2" for c in value)
    assert env.step(wrong).reward == 0.0
    # a fresh episode (another record) has another value: nothing to memorise
    values = {value_of(7, i, "31", 3, 4) for i in range(20)}
    assert len(values) > 5
    # a guess without the lookup earns nothing; a call with a half-right key earns half the call's reward
    guess = LookupEnvironment(seed=7)
    guess.reset(record("31", index=5))
    assert guess.step(value) == StepResult(reward=0.0, done=True)
    half = LookupEnvironment(seed=7)
    half.reset(record("31", index=5))
    assert half.step(":30").reward == pytest.approx(0.1)
    assert half.step(value_of(7, 5, "30", 3, 4)).reward == 0.0


# ----- sandbox ---------------------------------------------------------------------------------
FAST = SandboxLimits(timeout_s=3.0, cpu_s=1, memory_bytes=512 << 20)


@pytest.mark.parametrize("code, status, words", [
    ("while True:\n    pass", "timeout", "time limit"),            # CPU limit (SIGXCPU)
    ("import time\ntime.sleep(60)", "timeout", "time limit"),        # wall clock: the group is killed
    ("x = bytearray(10 * 1024 ** 3)", "memory", "memory limit"),
    ("import socket\nsocket.socket()", "blocked", "socket"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "blocked", "socket"),
    ("import subprocess\nsubprocess.run(['true'])", "blocked", "subprocess"),
    ("import ctypes\nctypes.CDLL(None).socket(2, 1, 0)", "blocked", "ctypes"),
])
def test_sandbox_stops_and_reports(code, status, words):
    start = time.monotonic()
    result = run_python(code, FAST)
    assert result.status == status, result
    assert words in result.report()
    assert time.monotonic() - start < FAST.timeout_s + 2
    assert run_python("print(6 * 7)", FAST).report().strip() == "42"  # the next call goes on


def test_sandbox_writes_only_inside_its_scratch_directory(tmp_path):
    outside = tmp_path / "outside.txt"
    for code in (f"open({str(outside)!r}, 'w').write('x')",
                 f"import os\nos.open({str(outside)!r}, os.O_CREAT | os.O_WRONLY)",
                 f"import os\nos.chdir('/')\nopen({str(tmp_path.relative_to('/') / 'outside.txt')!r}, 'a')"):
        result = run_python(code, FAST)
        assert result.status == "blocked" and "outside the scratch directory" in result.report(), result
    assert not outside.exists()
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    assert run_python(f"import os\nos.remove({str(victim)!r})", FAST).status == "blocked"
    assert victim.read_text() == "keep"
    inside = run_python("open('a.txt', 'w').write('hi')\nimport os\nprint(open('a.txt').read(), os.getcwd())", FAST,
                        scratch_root=str(tmp_path))
    assert inside.status == "ok" and inside.stdout.startswith("hi ")
    assert not os.path.exists(inside.stdout.split()[1])  # the scratch directory is removed afterwards


# ----- the python tool -------------------------------------------------------------------------
def test_python_tool_runs_calls_reports_errors_and_scores_the_answer():
    env = PythonToolEnvironment(timeout_s=3.0, cpu_s=1, memory_mb=512)
    question = [{"role": "user", "content": "What is 6 x 7?"}]
    messages = env.reset(record(prompt=question, ground_truth="42"))
    assert messages[0]["role"] == "system" and "<tool_call>" in messages[0]["content"] and messages[1:] == question
    ran = env.step("Let me compute. " + call({"name": "python", "arguments": {"code": "print(6 * 7)"}}))
    assert ran.observations == [{"role": "tool", "content": "42\n"}] and not ran.done and ran.reward is None
    assert ran.counters == {"tool_calls": 1.0, "tool_call_errors": 0.0}
    bad = env.step(call("{oops") + call({"name": "shell", "arguments": {"cmd": "ls"}}))
    assert [o["content"].split(":")[0] for o in bad.observations] == ["error", "error"]
    assert bad.counters["tool_call_errors"] == 2.0 and not bad.done
    looped = env.step(call({"name": "python", "arguments": {"code": "while True: pass"}}))
    assert "time limit" in looped.observations[0]["content"] and looped.counters["sandbox_timeout"] == 1.0
    final = env.step("The answer is 42.\n#### 42")
    assert final.done and final.reward == 1.0
    assert env.step("#### 41").reward == 0.0


@pytest.mark.parametrize("answer", [42.0, " 42 "])
def test_python_tool_scores_a_float_or_padded_ground_truth_as_the_loader_gives_gsm8k(answer):
    """An environment gets the row as the file has it (the loader normalises only for
    reward.function); python_gsm8k's own gsm8k scoring reads 42.0 (a float column's 42) as "42"."""
    env = PythonToolEnvironment()
    env.reset(record(prompt=[{"role": "user", "content": "What is 6 x 7?"}], ground_truth=answer))
    assert env.step("#### 42").reward == 1.0
