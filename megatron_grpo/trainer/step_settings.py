"""The recipe translated, once per run, into the settings the step's parts take: the rollout
phase's (RolloutSettings), the loss's (GRPOLossConfig), and the step's own (asynchronous or not,
the staleness bound of carried tokens). Built in build_run (Run.settings); the preflight, the plan's
simulated step and the benchmarks build theirs with the same functions."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.algo import AdvantageConfig, GlobalBatchInfo, GRPOLossConfig, PolicyClipConfig
from megatron_grpo.config.derived import (carried_staleness, long_tail_enabled, overlong_cap, rollouts_run_ahead,
                                          sampling_replay_enabled)
from megatron_grpo.config.schema import Config
from megatron_grpo.config.validate import PENALISED_FILTER_METRICS
from megatron_grpo.rewards.overlong import OverlongPenalty
from megatron_grpo.rollout.types import SamplingParams
from megatron_grpo.trainer.batches.batching import MicroBatch
from megatron_grpo.trainer.rollouts.long_tail import LongTailSettings
from megatron_grpo.trainer.rollouts.multi_turn import multi_turn_settings
from megatron_grpo.trainer.rollouts.rollout_phase import RolloutSettings


@dataclass(frozen=True)
class StepSettings:
    rollout: RolloutSettings
    loss: GRPOLossConfig
    asynchronous: bool  # rollout.max_staleness > 0: batches are made ahead (config/derived.py)
    # rollout.long_tail partial rollouts at max_staleness 0: carried tokens at most this many versions old
    carried_staleness: int | None


def step_settings(cfg: Config) -> StepSettings:
    return StepSettings(rollout=rollout_settings(cfg), loss=grpo_loss_config(cfg), asynchronous=rollouts_run_ahead(cfg),
                        carried_staleness=carried_staleness(cfg))


def rollout_settings(cfg: Config) -> RolloutSettings:
    r = cfg.rollout
    sampling = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                              max_new_tokens=r.max_new_tokens or cfg.data.max_response_length,
                              stop=tuple(r.stop), stop_token_ids=tuple(r.stop_token_ids), seed=cfg.trainer.seed)
    return RolloutSettings(n=r.n, sampling=sampling, adv_estimator=cfg.algorithm.adv_estimator,
                           advantage_config=AdvantageConfig(norm_adv_by_std=cfg.algorithm.norm_adv_by_std_in_grpo),
                           filter_groups=cfg.algorithm.filter_groups.enable,
                           max_generation_rounds=cfg.algorithm.filter_groups.max_num_gen_batches,
                           routing_replay=cfg.actor.moe_routing_replay,
                           sampling_replay=sampling_replay_enabled(cfg), multi_turn=multi_turn_settings(cfg),
                           overlong=overlong_penalty(cfg),
                           filter_on_penalised=cfg.algorithm.filter_groups.metric in PENALISED_FILTER_METRICS,
                           score_while_generating=cfg.reward.score_while_generating,
                           long_tail=long_tail_settings(cfg))


def long_tail_settings(cfg: Config) -> LongTailSettings | None:
    lt = cfg.rollout.long_tail
    if not long_tail_enabled(cfg):
        return None
    return LongTailSettings(over_sampling_groups=lt.over_sampling_groups, partial_rollout=lt.partial_rollout)


def overlong_penalty(cfg: Config) -> OverlongPenalty | None:
    b = cfg.reward.overlong_buffer
    if not b.enable:
        return None
    return OverlongPenalty(max_response_length=overlong_cap(cfg), length=b.len, penalty_factor=b.penalty_factor)


def grpo_loss_config(cfg: Config) -> GRPOLossConfig:
    a = cfg.actor
    return GRPOLossConfig(
        policy_loss=a.policy_loss.loss_mode,
        policy_clip=PolicyClipConfig(clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                                     clip_ratio_c=a.clip_ratio_c, tis_cap=a.tis_cap),
        off_policy=a.off_policy.resolve(cfg.rollout.max_staleness, a.tis_cap),
        loss_agg_mode=a.loss_agg_mode, use_kl_loss=a.use_kl_loss and a.kl_loss_coef != 0, kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff)


def global_batch_info(micro_batches: list[MicroBatch], cfg: Config) -> GlobalBatchInfo:
    """Mini-batch denominators over all DP ranks (algo/aggregation.py), in this run's layout."""
    from megatron.core import parallel_state as ps

    return GlobalBatchInfo.from_row_token_counts(
        [mb.row_token_counts for mb in micro_batches], data_parallel=ps.get_data_parallel_world_size(),
        context_parallel=ps.get_context_parallel_world_size(), num_micro_batches=len(micro_batches),
        loss_scale_factor=cfg.actor.loss_scale_factor or cfg.data.max_response_length,
        process_group=ps.get_data_parallel_group())
