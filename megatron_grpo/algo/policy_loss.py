"""Per-token policy-gradient losses (verl 0.9.x semantics) and truncated importance sampling.

A policy loss returns `PolicyLossTerms`: the per-token loss matrix and the per-token metric
ingredients, all unaggregated; `aggregation.py` reduces them with global denominators in one place.

    vanilla  r = exp(clamp(logp - old, -20, 20));  L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));
             dual clip for A < 0: L = min(L, -A c), c = clip_ratio_c > 1.
    gspo     sequence ratio s_i = exp(mean_t (logp - old)) over the valid tokens of row i;
             token form log s_it = logp - sg(logp) + sg(log s_i), clamped to max 10, then the PPO clip
             (no dual clip). Its value per token is s_i, its gradient s_i * d logp_t (GSPO-token).
             verl 0.8.0.dev and 0.10.0.dev force `seq-mean-token-mean` for gspo (the paper's mean);
             verl 0.9.1 uses the configured loss_agg_mode, and so do we: set
             loss_agg_mode="seq-mean-token-mean" to get the paper's objective.
             The row must hold the whole response (no context-parallel split of the sequence).

TIS (truncated importance sampling, `tis_cap`): the rollout engine's log-probs differ from the
trainer's; each token's loss is multiplied by w = min(exp(old - rollout), cap), detached.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_grpo.algo.registry import Registry
from megatron_grpo.config.policy_clip import PolicyClipConfig

LOG_RATIO_CLAMP = 20.0  # verl clamps the token log-ratio to [-20, 20] before exp
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps the GSPO token log-ratio to max 10


@dataclass
class PolicyLossTerms:
    """Per-token [B, T] tensors; masked positions hold values that aggregation ignores."""

    loss: torch.Tensor  # differentiable
    clipped: torch.Tensor  # bool: the ratio clip was active (pg_clipfrac)
    clipped_lower: torch.Tensor  # bool: the dual clip was active (pg_clipfrac_lower)
    approx_kl: torch.Tensor  # old - new log-prob (ppo_kl), detached


PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyClipConfig],
                        PolicyLossTerms]
"""(log_prob, old_log_prob, advantages, response_mask, config) -> PolicyLossTerms; all [B, T]."""

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    return POLICY_LOSSES.get(name)


@register_policy_loss("vanilla")
def vanilla_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, config: PolicyClipConfig) -> PolicyLossTerms:
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    ppo_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * config.clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(ppo_loss, dual_bound), ppo_loss)
    return PolicyLossTerms(loss=loss, clipped=(clipped > unclipped).detach(),
                           clipped_lower=((ppo_loss > dual_bound) & negative).detach(),
                           approx_kl=(-log_ratio).detach())


@register_policy_loss("gspo")
def gspo_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                     response_mask: torch.Tensor, config: PolicyClipConfig) -> PolicyLossTerms:
    valid = response_mask.bool()
    token_log_ratio = log_prob - old_log_prob
    lengths = valid.sum(-1).clamp(min=1)
    seq_log_ratio = torch.where(valid, token_log_ratio, 0.0).sum(-1) / lengths
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.clamp(log_ratio, max=GSPO_LOG_RATIO_MAX).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    return PolicyLossTerms(loss=torch.maximum(unclipped, clipped), clipped=(clipped > unclipped).detach(),
                           clipped_lower=torch.zeros_like(valid),
                           approx_kl=(-token_log_ratio).detach())


def truncated_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(exp(old - rollout), cap), detached; computed as exp(min(d, log cap)) so it never overflows."""
    log_w = torch.clamp((old_log_prob - rollout_log_prob).detach(), max=math.log(cap))
    return log_w.exp()


def compute_policy_loss(name: str, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, config: PolicyClipConfig,
                        rollout_log_prob: Optional[torch.Tensor] = None) -> tuple[PolicyLossTerms,
                                                                                   Optional[torch.Tensor]]:
    """The named loss, with TIS weights applied when config.tis_cap is set; returns (terms, weights or None)."""
    fn = get_policy_loss(name)
    if advantages.shape != log_prob.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must match log_prob {tuple(log_prob.shape)}; "
                         f"use broadcast_to_tokens for per-sequence advantages")
    terms = fn(log_prob, old_log_prob.detach(), advantages.detach(), response_mask, config)
    if config.tis_cap is None:
        return terms, None
    if rollout_log_prob is None:
        raise ValueError("tis_cap is set but no rollout_log_prob was given")
    weights = truncated_is_weights(old_log_prob, rollout_log_prob, config.tis_cap)
    terms.loss = terms.loss * weights
    return terms, weights
