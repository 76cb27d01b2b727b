"""algorithm.use_kl_in_reward in the step (the arithmetic: algo/kl_in_reward.py).

The advantages of the rollout phase are computed before any log-prob pass; with the KL in the
reward they are recomputed once the old and reference log-probs exist. Those land on the last
pipeline stage of each data-parallel replica, for that replica's share of the batch, so every rank
gathers every sequence's KL (small: two floats per sequence) and recomputes the same advantages
for the whole batch, then every rank steps the same controller.
"""
from __future__ import annotations

import torch

from megatron_grpo.algo.kl_in_reward import KLController, batch_kl, penalised_scores, sequence_kl
from megatron_grpo.errors import MegatronGRPOError
from megatron_grpo.launch.collectives import all_gather_objects
from megatron_grpo.trainer.rollouts.rollout_phase import (RolloutBatch, RolloutSettings, advantage_metrics,
                                                          batch_advantages)


def apply_kl_in_reward(batch: RolloutBatch, controller: KLController, kind: str,
                       settings: RolloutSettings) -> dict[str, float]:
    """Collective: sets every sample's advantage from its penalised score; returns verl's metrics."""
    local = {i: sequence_kl(s.old_logprobs, s.ref_logprobs, s.response_mask, kind)
             for i, s in enumerate(batch.samples) if s.old_logprobs is not None and s.ref_logprobs is not None}
    kls = {}
    for part in all_gather_objects(local):  # tensor-parallel peers hold the same values
        kls.update(part)
    if len(kls) != len(batch.samples):
        raise MegatronGRPOError(f"in-reward KL: log-probs of {len(kls)} of {len(batch.samples)} samples reached "
                                "the ranks (a log-prob pass skipped some)")
    ordered = [kls[i] for i in range(len(batch.samples))]
    beta = controller.value
    scores = penalised_scores(torch.tensor(batch.scores, dtype=torch.float64), ordered, beta)
    advantages = batch_advantages(settings, scores, batch.group_ids,
                                  [(s.response_ids, s.response_mask) for s in batch.samples])
    for sample, advantage in zip(batch.samples, advantages.tolist()):
        sample.advantage = advantage
    current_kl = batch_kl(ordered)
    controller.update(current_kl, n_steps=len(batch.samples))
    return {**advantage_metrics(advantages), "actor/reward_kl_penalty": current_kl,
            "actor/reward_kl_penalty_coeff": beta}
