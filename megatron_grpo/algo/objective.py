"""The GRPO actor loss of one micro-batch: policy loss + KL loss - entropy bonus, aggregated in one place.

    L = agg(pg) + kl_loss_coef * agg(kl)  - entropy_coeff * agg(entropy)       (verl 0.9.x)

every term aggregated with the same loss_agg_mode and the same global denominators. `loss` is what
this rank back-propagates (share * GlobalBatchInfo.backward_scale); `share` and every metric are the
micro-batch's additive shares: sum them over micro-batches and DP ranks to get mini-batch values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_grpo.algo.aggregation import GlobalBatchInfo, aggregate, check_loss_agg_mode, token_mean_share
from megatron_grpo.algo.kl import check_kl_estimator, kl_penalty
from megatron_grpo.algo.off_policy import OffPolicyConfig, off_policy_weights
from megatron_grpo.algo.policy_loss import POLICY_LOSSES, PolicyClipConfig, compute_policy_loss


@dataclass(frozen=True)
class GRPOLossConfig:
    policy_loss: str = "vanilla"
    policy_clip: PolicyClipConfig = field(default_factory=PolicyClipConfig)
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)  # config/off_policy.py

    def __post_init__(self):
        POLICY_LOSSES.get(self.policy_loss)  # raises ConfigError listing the valid names
        check_loss_agg_mode(self.loss_agg_mode)
        check_kl_estimator(self.kl_loss_type)
        self.off_policy.check()


@dataclass
class GRPOLossOutput:
    loss: torch.Tensor  # back-propagate this on the rank (already scaled for DP averaging)
    share: torch.Tensor  # detached; sums over micro-batches and ranks to the mini-batch loss
    metrics: dict[str, torch.Tensor]  # detached additive shares


def compute_grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor, batch_info: GlobalBatchInfo, config: GRPOLossConfig, *,
                      ref_log_prob: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
                      rollout_log_prob: Optional[torch.Tensor] = None,
                      seq_token_counts: Optional[torch.Tensor] = None) -> GRPOLossOutput:
    """All tensors [B, T] (advantages may be [B]: broadcast over the row); `entropy` is the per-token entropy."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(log_prob)
    mode = config.loss_agg_mode

    def agg(values: torch.Tensor) -> torch.Tensor:
        return aggregate(values, response_mask, mode, batch_info, seq_token_counts)

    def mean(values: torch.Tensor) -> torch.Tensor:
        # bool flags and bf16 values are averaged in (at least) float32
        dtype = torch.promote_types(values.dtype, torch.float32) if values.is_floating_point() else torch.float32
        return token_mean_share(values.detach().to(dtype), response_mask, batch_info)

    off_policy = config.off_policy
    if (off_policy.objective == "behaviour" or off_policy.weighted) and rollout_log_prob is None:
        raise ValueError(f"off_policy {off_policy} needs the rollout (behaviour) log-probs")
    if off_policy.objective == "behaviour":  # one policy: clip against the engine's log-probs
        old_log_prob = rollout_log_prob
    terms, tis_weights = compute_policy_loss(config.policy_loss, log_prob, old_log_prob, advantages,
                                             response_mask, config.policy_clip, rollout_log_prob)
    weights = None
    if off_policy.weighted:  # w(pi_prox / pi_behav) on each token's policy loss (algo/off_policy.py)
        weights = off_policy_weights(old_log_prob, rollout_log_prob, response_mask, off_policy)
        terms.loss = terms.loss * weights.weights
    pg_loss = agg(terms.loss)
    total = pg_loss
    metrics = {"actor/pg_loss": pg_loss.detach(), "actor/pg_clipfrac": mean(terms.clipped),
               "actor/pg_clipfrac_lower": mean(terms.clipped_lower), "actor/ppo_kl": mean(terms.approx_kl)}
    if tis_weights is not None:
        metrics["actor/tis_weight"] = mean(tis_weights)
    if weights is not None:
        metrics.update({"off_policy/weight_mean": mean(weights.weights),
                        "off_policy/is_ratio_mean": mean(weights.ratio),
                        "off_policy/truncated_frac": mean(weights.truncated),
                        "off_policy/masked_frac": mean(weights.rejected)})
    if config.use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("use_kl_loss is set but no ref_log_prob was given")
        kl = kl_penalty(log_prob, ref_log_prob.detach(), config.kl_loss_type)
        kl_loss = agg(kl)
        total = total + config.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
        metrics["actor/kl"] = mean(kl)
    if entropy is not None:
        metrics["actor/entropy"] = mean(entropy)
        if config.entropy_coeff != 0.0:
            entropy_loss = agg(entropy)
            total = total - config.entropy_coeff * entropy_loss
            metrics["actor/entropy_loss"] = entropy_loss.detach()
    elif config.entropy_coeff != 0.0:
        raise ValueError(f"entropy_coeff={config.entropy_coeff} but no entropy was given")
    return GRPOLossOutput(loss=total * batch_info.backward_scale, share=total.detach(), metrics=metrics)
