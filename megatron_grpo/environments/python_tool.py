"""GSM8K with a `python` tool (built-in "python_gsm8k"): the policy may run Python code in the
sandbox (sandbox.py) through Qwen3 / Hermes tool calls, then answers; the answer is scored with
the gsm8k reward (rewards/gsm8k.py) on the final turn.

A turn with `<tool_call>` blocks is answered with one `tool` message per call (the code's output,
or why it was stopped); a malformed call or an unknown tool gets an error message instead and is
counted (multi_turn/tool_call_errors). A turn without a tool call is the final answer."""
from __future__ import annotations

import json

from megatron_grpo.data.records import PromptRecord, scalar_answer
from megatron_grpo.environments.base import Environment, Message, StepResult
from megatron_grpo.environments.sandbox import SandboxLimits, run_python
from megatron_grpo.environments.tool_calls import parse_tool_calls, tool_response
from megatron_grpo.rewards.gsm8k import reward as gsm8k_reward

PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Runs Python 3 code and returns what it prints (no network, no files "
                                     "outside a scratch directory, a few seconds of CPU).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the code"}},
                   "required": ["code"]}}}
SYSTEM_PROMPT = (
    "You can call a Python tool. To call it, write\n<tool_call>\n{\"name\": \"python\", \"arguments\": "
    "{\"code\": \"print(1 + 1)\"}}\n</tool_call>\nand wait for its output. Tool:\n" + json.dumps(PYTHON_TOOL) +
    "\nWhen you know the answer, reply without a tool call and end with \"#### <number>\".")


class PythonToolEnvironment(Environment):
    def __init__(self, timeout_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 1024, method: str = "strict",
                 system_prompt: str = SYSTEM_PROMPT, scratch_root: str | None = None):
        self.limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_bytes=memory_mb << 20)
        self.method, self.system_prompt, self.scratch_root = method, system_prompt, scratch_root
        self.record: PromptRecord | None = None

    def reset(self, record: PromptRecord) -> list[Message]:
        self.record = record
        return [{"role": "system", "content": self.system_prompt}, *record.prompt]

    def step(self, assistant_message: str) -> StepResult:
        parsed = parse_tool_calls(assistant_message)
        if not parsed.calls and not parsed.errors:
            # as the data loader gives reward.function's gsm8k: 72.0 (a float column's 72) compares as "72"
            answer = scalar_answer(self.record.ground_truth)
            score = gsm8k_reward("", assistant_message, answer, method=self.method)
            return StepResult(reward=float(score), done=True)
        observations = [tool_response(f"error: {error}") for error in parsed.errors]
        counters = {"tool_calls": float(len(parsed.calls) + len(parsed.errors)),
                    "tool_call_errors": float(len(parsed.errors))}
        for call in parsed.calls:
            code = call.arguments.get("code")
            if call.name != "python" or not isinstance(code, str):
                observations.append(tool_response(f"error: unknown tool {call.name!r} or no \"code\" string; "
                                                  "the only tool is python(code)"))
                counters["tool_call_errors"] += 1
                continue
            result = run_python(code, self.limits, self.scratch_root)
            if result.status != "ok":
                counters[f"sandbox_{result.status}"] = counters.get(f"sandbox_{result.status}", 0.0) + 1
            observations.append(tool_response(result.report()))
        return StepResult(observations=observations, counters=counters)
