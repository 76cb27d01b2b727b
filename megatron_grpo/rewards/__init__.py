"""Reward functions (gsm8k, math, synthetic, by_data_source, user "module:fn" / "file.py:fn", in this
project's or verl's signature) and the process-pool runner with loud failure accounting."""
from megatron_grpo.rewards.failures import RewardFailure
from megatron_grpo.rewards.loader import (BUILTIN_REWARDS, RewardSpec, canonical_spec, load_reward_function,
                                          prepare_reward_function)
from megatron_grpo.rewards.runner import RewardBatchResult, RewardRequest, RewardRunner

__all__ = ["BUILTIN_REWARDS", "RewardSpec", "canonical_spec", "load_reward_function", "prepare_reward_function",
           "RewardBatchResult", "RewardFailure", "RewardRequest", "RewardRunner"]
