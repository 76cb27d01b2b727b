"""Reward functions (gsm8k, math, synthetic, user "module:fn" / "file.py:fn") and the process-pool runner."""
from megatron_grpo.rewards.loader import BUILTIN_REWARDS, canonical_spec, load_reward_function
from megatron_grpo.rewards.runner import RewardBatchResult, RewardRequest, RewardRunner

__all__ = ["BUILTIN_REWARDS", "canonical_spec", "load_reward_function",
           "RewardBatchResult", "RewardRequest", "RewardRunner"]
