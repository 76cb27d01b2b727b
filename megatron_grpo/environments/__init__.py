"""Environments for multi-turn, tool-calling rollouts (rollout.multi_turn): what the policy talks to
between its turns. See docs/architecture.md for what this package may import.

  base        Environment (reset(record) -> messages; step(text) -> StepResult), one per trajectory
  loader      built-in names / "pkg.module:Class" / "path.py:Class" -> the class (one ConfigError)
  tool_calls  the Qwen3 / Hermes <tool_call> parser (malformed calls reported, not raised)
  episodes    the token-in / token-out multi-turn driver: ids, loss mask, limits, incremental rendering
  sandbox     Python code in a separate, limited process (CPU, memory, no network, scratch dir)
  lookup      the synthetic lookup(key) task the tiny CPU model learns
  python_tool GSM8K with a python tool
"""
from megatron_grpo.environments.base import Environment, Message, StepResult

__all__ = ["Environment", "Message", "StepResult"]
