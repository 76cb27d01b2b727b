"""The KL penalty folded into the reward (verl's algorithm.use_kl_in_reward), with verl's controllers.

verl (trainer/ppo/ray_trainer.py apply_kl_penalty) subtracts beta * kld[i, t] from every token's
reward, kld = kl_penalty(old_log_prob, ref_log_prob) * response_mask, before the advantage. Every
outcome estimator here (grpo, rloo, reinforce_plus_plus_baseline) reads the sequence score
sum_t token_level_rewards[i, t], so the penalised score is score[i] - beta * sum_t kld[i, t]. Then
the controller sees current_kl = batch mean of each sequence's masked token mean of kld (verl's
masked_mean, +1e-8 in the denominator) with n_steps = the batch's sequence count:

    fixed      beta = kl_coef, always
    adaptive   beta *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon
               (Ziegler et al. 2019, verl's AdaptiveKLController)

The beta of a step is the one before its update (verl logs it as actor/reward_kl_penalty_coeff).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from megatron_grpo.algo.kl import kl_penalty


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class FixedKLController:
    value: float  # the whole state a checkpoint keeps (the settings come from the recipe)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@dataclass(kw_only=True)
class AdaptiveKLController(FixedKLController):
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def make_kl_controller(kind: str, kl_coef: float, target_kl: float, horizon: int) -> KLController:
    """algorithm.kl_ctrl.* (validation checks target_kl and horizon > 0 for adaptive)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target=target_kl, horizon=horizon)
    raise ValueError(f"unknown KL controller {kind!r} (fixed | adaptive)")


@dataclass(frozen=True)
class SequenceKL:
    total: float  # sum_t kld[t] over the sequence's trained tokens
    token_mean: float  # total / (trained tokens + 1e-8), as verl's masked_mean


def sequence_kl(old_logprobs: Sequence[float], ref_logprobs: Sequence[float], mask: Sequence[bool] | None,
                kind: str) -> SequenceKL:
    """One sequence's in-reward KL from its per-token log-probs (mask None: every token trains)."""
    old = torch.tensor(old_logprobs, dtype=torch.float64)
    ref = torch.tensor(ref_logprobs, dtype=torch.float64)
    weights = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float64)
    total = float((kl_penalty(old, ref, kind) * weights).sum())
    return SequenceKL(total=total, token_mean=total / (float(weights.sum()) + 1e-8))


def penalised_scores(scores: torch.Tensor, kls: Sequence[SequenceKL], beta: float) -> torch.Tensor:
    """score[i] - beta * sum_t kld[i, t]."""
    return scores - beta * torch.tensor([k.total for k in kls], dtype=scores.dtype)


def batch_kl(kls: Sequence[SequenceKL]) -> float:
    """The controller's current_kl: the batch mean of the sequences' token means."""
    return sum(k.token_mean for k in kls) / len(kls)
