"""Registry-backed names (advantage estimator, policy loss, reward function) checked at config time.

The registries live in megatron_grpo.algo, whose import costs torch; the built-in names are listed
here (tests/test_config.py checks them against the registries) so that `config show` refuses
`adv_estimator=grpoo` in milliseconds. Names registered at run time by Python code count as soon
as the module holding the registry is imported: known = built-in + whatever it holds then.
"""
from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional


@dataclass(frozen=True)
class RegistryNames:
    kind: str                       # "advantage estimator"
    builtin: tuple[str, ...]        # what the registry holds after import
    module: str                     # the module that holds the registry ...
    attribute: str                  # ... under this name (a Registry, or a mapping keyed by name)
    # verl names that have no implementation here, with the reason (shown instead of a guess)
    verl_only: Mapping[str, str] = field(default_factory=dict)

    def known(self) -> list[str]:
        registry = getattr(sys.modules.get(self.module), self.attribute, None)
        live = [] if registry is None else registry.names() if hasattr(registry, "names") else list(registry)
        return sorted({*self.builtin, *live})


ADVANTAGE_ESTIMATORS = RegistryNames(
    "advantage estimator", ("grpo", "reinforce_plus_plus_baseline", "rloo"),
    "megatron_grpo.algo.advantages", "ADVANTAGE_ESTIMATORS",
    MappingProxyType({
        "gae": "GAE needs a critic (PPO); this trainer has none",
        "reinforce_plus_plus": "token-level REINFORCE++ with discounted returns is not implemented; "
                               "reinforce_plus_plus_baseline is",
        "remax": "ReMax needs a greedy baseline rollout per prompt, which is not implemented",
        "opo": "OPO is not implemented", "grpo_passk": "grpo_passk is not implemented",
        "gpg": "GPG is not implemented", "gdpo": "GDPO is not implemented",
        "optimal_token_baseline": "not implemented here", "tir_optimal_token_baseline": "not implemented here",
        "grpo_vectorized": "use grpo (the same estimator; computed without a Python loop here)",
        "rloo_vectorized": "use rloo (the same except one-sample groups: rloo keeps A = r there, "
                           "rloo_vectorized gives 0)",
    }))

POLICY_LOSSES = RegistryNames(
    "policy loss", ("gspo", "vanilla"), "megatron_grpo.algo.policy_loss", "POLICY_LOSSES",
    MappingProxyType({
        name: "not implemented here" for name in
        ("dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo")
    } | {"bypass_mode": "use actor.tis_cap (truncated importance sampling against the rollout log-probs)"}))

REWARD_FUNCTIONS = RegistryNames(
    "built-in reward function", ("by_data_source", "gsm8k", "math", "synthetic"),
    "megatron_grpo.rewards.loader", "BUILTIN_REWARDS")


def check_name(key: str, value: str, names: RegistryNames) -> Optional[str]:
    """None if `value` is known, else one problem line with the reason or a suggestion."""
    known = names.known()
    if value in known:
        return None
    if value in names.verl_only:
        return f"{key}={value!r}: verl's {names.kind} {value!r} is not available here ({names.verl_only[value]})"
    return unknown_name(key, value, names.kind, known)


def unknown_name(key: str, value: str, kind: str, known: list[str]) -> str:
    match = difflib.get_close_matches(value, known, n=1, cutoff=0.6)
    hint = f"; did you mean {match[0]!r}?" if match else ""
    return f"{key}={value!r} is not a known {kind}{hint} (known: {', '.join(known)})"


# model.lora.target_modules: PEFT's names of the projections LoRA adapts (megatron_grpo/lora/targets.py pairs
# each with its Megatron layer; tests/test_lora.py checks the two lists are the same), or PEFT's all-linear.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_ALL_LINEAR = "all-linear"
