"""A synthetic two-step tool task the embedded tiny model learns on CPU: the answer is a value only
a lookup(key) call returns.

The prompt is a key (the synthetic task's digits, e.g. "31"). Its value, a string of
`value_digits` digits over 0..num_symbols-1, is drawn per record from a hash of (seed, record
index, key), so it cannot be memorised across prompts: the policy must call the tool, then copy
what it returned. The tool-call syntax is compact so that the synthetic tokenizer's vocabulary
(words, digits, " ", ":", ".") can spell it: a turn that starts with ":" is a call, `:KEY`; its
observation is a user turn holding the value. Any other turn is the final answer, scored per
position like rewards/synthetic.py. Rewards (per turn, summed): the first call earns `lookup_reward`
x the fraction of its key's positions right; the answer earns (1 - lookup_reward) x the fraction of
its positions right, and nothing before a call with the exact key (a guess must not pay: with 4
symbols it would earn a quarter of the answer's reward, enough to settle for and never call)."""
from __future__ import annotations

import hashlib

from megatron_grpo.data.records import PromptRecord
from megatron_grpo.environments.base import Environment, Message, StepResult
from megatron_grpo.errors import ConfigError

CALL_PREFIX = ":"


def value_of(seed: int, index: int, key: str, digits: int, num_symbols: int) -> str:
    """The value the tool returns for `key` in episode `index` (stable across processes)."""
    digest = hashlib.sha256(f"{seed}:{index}:{key}".encode()).digest()
    return "".join(str(b % num_symbols) for b in digest[:digits])


def position_score(answer: str, reference: str) -> float:
    if not answer or not reference:
        return 0.0
    return sum(a == b for a, b in zip(answer, reference)) / max(len(answer), len(reference))


class LookupEnvironment(Environment):
    def __init__(self, value_digits: int = 3, num_symbols: int = 4, lookup_reward: float = 0.2, seed: int = 0):
        if not 1 <= value_digits <= 16 or not 2 <= num_symbols <= 10 or not 0.0 <= lookup_reward < 1.0:
            raise ConfigError("lookup environment: need 1 <= value_digits <= 16, 2 <= num_symbols <= 10, "
                              f"0 <= lookup_reward < 1; got {value_digits}, {num_symbols}, {lookup_reward}")
        self.value_digits, self.num_symbols, self.lookup_reward, self.seed = \
            value_digits, num_symbols, lookup_reward, seed
        self.key = self.index = None
        self.looked_up = self.called = False

    def reset(self, record: PromptRecord) -> list[Message]:
        self.key = str(record.extra_info.get("digits", record.ground_truth))
        self.index = int(record.extra_info.get("index", 0))
        self.looked_up = self.called = False
        return [{"role": "user", "content": self.key}]

    def value(self, key: str) -> str:
        return value_of(self.seed, self.index, key, self.value_digits, self.num_symbols)

    def step(self, assistant_message: str) -> StepResult:
        text = assistant_message.strip()
        if text.startswith(CALL_PREFIX):
            key = text[len(CALL_PREFIX):].strip()
            reward = None if self.called else self.lookup_reward * position_score(key, self.key)
            self.called = True
            self.looked_up = self.looked_up or key == self.key
            return StepResult(observations=[{"role": "user", "content": self.value(key) if key else "."}],
                              reward=reward, counters={"tool_calls": 1.0, "tool_call_errors": 0.0 if key else 1.0})
        if not self.looked_up:
            return StepResult(reward=0.0, done=True)
        score = (1.0 - self.lookup_reward) * position_score(text, self.value(self.key))
        return StepResult(reward=score, done=True)
