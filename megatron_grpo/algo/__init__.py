"""GRPO algorithm core: pure tensor functions (no megatron import).

Public API:
    advantages   compute_advantages(name, scores, group_ids, response_mask=None, config=AdvantageConfig())
                 broadcast_to_tokens(advantages, response_mask); AdvantageConfig
                 register_advantage_estimator(name), get_advantage_estimator(name), ADVANTAGE_ESTIMATORS
                 estimators: grpo (Dr.GRPO: norm_adv_by_std=False), rloo, reinforce_plus_plus_baseline
    groups       make_group_index(group_ids) -> GroupIndex
    filters      filter_zero_variance_groups(scores, group_ids) -> GroupFilterResult  (DAPO dynamic sampling)
    policy_loss  compute_policy_loss(name, log_prob, old_log_prob, advantages, mask, PolicyClipConfig,
                 rollout_log_prob=None) -> (PolicyLossTerms, tis_weights); register_policy_loss(name),
                 get_policy_loss(name); losses: vanilla, gspo; truncated_is_weights(old, rollout, cap)
    kl           kl_penalty(log_prob, ref_log_prob, kind); kinds kl/k1, abs, mse/k2, low_var_kl/k3, and "+"
    aggregation  GlobalBatchInfo (.from_row_token_counts, .backward_scale); aggregate(values, mask, mode, info);
                 token_mean_share(values, mask, info); LOSS_AGG_MODES
    objective    compute_grpo_loss(log_prob, old_log_prob, advantages, mask, info, GRPOLossConfig, ...)
                 -> GRPOLossOutput(loss, share, metrics)
    off_policy   OffPolicyConfig (objective decoupled | behaviour, truncated IS, rejection / masked IS at
                 token / sequence / geometric level); off_policy_weights(prox, behav, mask, cfg);
                 staleness_gap_sums(prox, behav, mask, row_staleness)
"""
from megatron_grpo.algo.advantages import (ADVANTAGE_ESTIMATORS, AdvantageConfig, broadcast_to_tokens,
                                           compute_advantages, get_advantage_estimator,
                                           register_advantage_estimator)
from megatron_grpo.algo.aggregation import (LOSS_AGG_MODES, GlobalBatchInfo, aggregate, check_loss_agg_mode,
                                            token_mean_share)
from megatron_grpo.algo.filters import GroupFilterResult, filter_zero_variance_groups
from megatron_grpo.algo.groups import GroupIndex, make_group_index
from megatron_grpo.algo.kl import check_kl_estimator, kl_estimator_names, kl_penalty
from megatron_grpo.algo.objective import GRPOLossConfig, GRPOLossOutput, compute_grpo_loss
from megatron_grpo.algo.off_policy import OffPolicyConfig, OffPolicyWeights, off_policy_weights, staleness_gap_sums
from megatron_grpo.algo.policy_loss import (POLICY_LOSSES, PolicyClipConfig, PolicyLossTerms, compute_policy_loss,
                                            get_policy_loss, register_policy_loss, truncated_is_weights)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AdvantageConfig", "broadcast_to_tokens", "compute_advantages",
    "get_advantage_estimator", "register_advantage_estimator",
    "LOSS_AGG_MODES", "GlobalBatchInfo", "aggregate", "check_loss_agg_mode", "token_mean_share",
    "GroupFilterResult", "filter_zero_variance_groups", "GroupIndex", "make_group_index",
    "check_kl_estimator", "kl_estimator_names", "kl_penalty",
    "GRPOLossConfig", "GRPOLossOutput", "compute_grpo_loss",
    "OffPolicyConfig", "OffPolicyWeights", "off_policy_weights", "staleness_gap_sums",
    "POLICY_LOSSES", "PolicyClipConfig", "PolicyLossTerms", "compute_policy_loss", "get_policy_loss",
    "register_policy_loss", "truncated_is_weights",
]
