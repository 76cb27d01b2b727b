"""KL estimators between the policy and the reference, per token (names as verl's `kl_penalty`).

    "kl" / "k1"          logp - ref
    "abs"                |logp - ref|
    "mse" / "k2"         0.5 * (logp - ref)^2
    "low_var_kl" / "k3"  d = clamp(ref - logp, -20, 20); exp(d) - d - 1, clamped to [-10, 10]
    "<name>+"            straight-through: the value of <name> exactly, the gradient of k2.

k1 and k3 are unbiased estimates of KL(pi || ref) but their gradients are not the gradient of the KL;
k2's gradient is (logp - ref), which is. verl 0.8 raised NotImplementedError for every "+" name
(the suffix was never stripped); 0.9.1 fixed it. Here "+" is supported for each base name.
"full" (needs the whole distributions) is not supported and raises ConfigError.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_grpo.errors import ConfigError


def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    # Clamps as verl: the inner one keeps exp finite, the outer one bounds outliers (and their gradient).
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(log_ratio.exp() - log_ratio - 1, min=-10.0, max=10.0)


_BASE_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3,
}


def kl_estimator_names() -> list[str]:
    return sorted(_BASE_ESTIMATORS) + sorted(f"{name}+" for name in _BASE_ESTIMATORS)


def check_kl_estimator(kind: str) -> None:
    """Raises ConfigError for an unknown estimator name."""
    if kind.removesuffix("+") not in _BASE_ESTIMATORS:
        raise ConfigError(f"unknown KL estimator {kind!r}; valid names: {', '.join(kl_estimator_names())}")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [B, T] (unmasked; aggregation applies the mask)."""
    check_kl_estimator(kind)
    straight_through = kind.endswith("+")
    value = _BASE_ESTIMATORS[kind.removesuffix("+")](log_prob, ref_log_prob)
    if not straight_through:
        return value
    k2 = _k2(log_prob, ref_log_prob)
    # verl's form: k2 - k2.detach() is exactly 0, so the forward value is `value` bit for bit;
    # `k2 + (value - k2).detach()` rounds twice (in bf16, k3+ = 16 where k3 = 10).
    return k2 - k2.detach() + value.detach()
