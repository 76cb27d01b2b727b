"""Aggregation with global denominators: golden values, and the micro-batch x data-parallel property.

The property: a mini-batch split over 2 DP ranks x 4 micro-batches (different sizes and padded lengths),
each micro-batch back-propagating its `compute_grpo_loss(...).loss` (divided by num_microbatches, as
megatron's schedule does), gradients then averaged over the ranks, gives the loss and the gradient of
one dense pass over the whole mini-batch, for every aggregation mode, with KL, entropy and TIS terms.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_grpo.algo import (LOSS_AGG_MODES, AdvantageConfig, GlobalBatchInfo, GRPOLossConfig,
                                PolicyClipConfig, aggregate, broadcast_to_tokens, compute_advantages,
                                compute_grpo_loss, compute_policy_loss, kl_penalty)
from megatron_grpo.errors import ConfigError
from megatron_grpo.testing.distributed import run_distributed

def info_of(masks, **kwargs):
    """GlobalBatchInfo as the trainer computes it (loop.global_batch_info): from each
    micro-batch's per-row loss-mask token counts."""
    return GlobalBatchInfo.from_row_token_counts([m.sum(-1) for m in masks], **kwargs)


# ---- golden values computed with verl's core_algos.py (docs/architecture.md, "Reference values") ----
GOLDEN_L = torch.tensor([[1.0, 2, 3, 4], [5, 6, 0, 0]])
GOLDEN_M = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
GOLDEN_AGG = {"token-mean": 3.5, "seq-mean-token-sum": 10.5, "seq-mean-token-mean": 4.0,
              "seq-mean-token-sum-norm": 2.625}  # 0.9.1 meaning; verl 0.8.0.dev gave 5.25 (= 2.625 * B)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_golden_aggregation(mode):
    info = info_of([GOLDEN_M], loss_scale_factor=GOLDEN_L.shape[-1])
    assert (info.num_valid_tokens, info.num_sequences) == (6, 2)
    assert aggregate(GOLDEN_L, GOLDEN_M, mode, info).item() == pytest.approx(GOLDEN_AGG[mode])


def test_sum_norm_needs_a_global_scale_factor():
    info = info_of([GOLDEN_M])
    with pytest.raises(ConfigError, match="loss_scale_factor"):
        aggregate(GOLDEN_L, GOLDEN_M, "seq-mean-token-sum-norm", info)
    with pytest.raises(ConfigError, match="seq-mean-token-mean"):
        aggregate(GOLDEN_L, GOLDEN_M, "seq_mean", info)


def test_counts_skip_empty_rows_and_masked_garbage_stays_out():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    info = info_of([mask, mask[:1]])
    assert (info.num_valid_tokens, info.num_sequences) == (5, 3)
    values = torch.tensor([[1.0, 2.0, float("nan")], [float("inf"), 3.0, 4.0], [5.0, float("-inf"), 0.0]],
                          requires_grad=True)
    for mode in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]:
        aggregate(values, mask, mode, info).backward()
    assert torch.isfinite(values.grad).all() and (values.grad[~mask.bool()] == 0).all()
    with pytest.raises(ValueError, match="process_group"):
        info_of([mask], data_parallel=2)


@pytest.mark.parametrize("context_parallel", [1, 2, 4])
def test_backward_scale_undoes_ddp_and_megatron_for_any_cp(context_parallel):
    """DDP averages over DP x CP and megatron divides a 2-tuple loss by num_microbatches / CP: the
    product, backward_scale, is DP x num_microbatches whatever CP is."""
    info = GlobalBatchInfo.from_row_token_counts([torch.tensor([3, 0, 2])], context_parallel=context_parallel,
                                                 num_micro_batches=4)
    assert (info.num_valid_tokens, info.num_sequences) == (5, 2)
    assert info.dp_size == context_parallel and info.framework_loss_divisor == 4 / context_parallel
    assert info.backward_scale == 4


# ---- the micro-batch x DP property ----

NUM_SEQ, MAX_LEN, DIM = 16, 12, 5
RANK_MICRO_BATCHES = [[[3], [0, 7, 12], [5, 9], [1, 14]],  # DP rank 0: 4 micro-batches of sequence ids
                      [[2, 15], [4, 10], [11], [6, 8, 13]]]  # DP rank 1
NUM_MICRO_BATCHES = 4
KL_COEF, ENTROPY_COEF, LOSS_SCALE_FACTOR = 0.1, 0.05, float(MAX_LEN)


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_LEN + 1, (NUM_SEQ,), generator=g)
    lengths[[4, 9]] = 0  # empty responses: no tokens, not counted as sequences
    mask = torch.arange(MAX_LEN).unsqueeze(0) < lengths.unsqueeze(1)
    features = torch.randn(NUM_SEQ, MAX_LEN, DIM, generator=g, dtype=torch.float64)
    theta = torch.randn(DIM, generator=g, dtype=torch.float64)
    old_theta = theta + 0.3 * torch.randn(DIM, generator=g, dtype=torch.float64)
    ref_theta = theta + 0.3 * torch.randn(DIM, generator=g, dtype=torch.float64)
    rollout_theta = old_theta + 0.2 * torch.randn(DIM, generator=g, dtype=torch.float64)
    scores = torch.randint(0, 3, (NUM_SEQ,), generator=g).double()
    uids = [i // 4 for i in range(NUM_SEQ)]
    advantages = broadcast_to_tokens(compute_advantages("grpo", scores, uids), mask)
    return dict(mask=mask, features=features, theta=theta, advantages=advantages,
                old=log_prob_of(features, old_theta).detach(), ref=log_prob_of(features, ref_theta).detach(),
                rollout=log_prob_of(features, rollout_theta).detach())


def log_prob_of(features, theta):
    """A toy policy: token log-prob log sigmoid(x . theta); its entropy is the Bernoulli entropy."""
    return F.logsigmoid(features @ theta)


def entropy_of(features, theta):
    p = torch.sigmoid(features @ theta)
    return -(p * torch.log(p) + (1 - p) * torch.log1p(-p))


def loss_config(mode, policy_loss):
    return GRPOLossConfig(policy_loss=policy_loss, loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=KL_COEF,
                          kl_loss_type="low_var_kl", entropy_coeff=ENTROPY_COEF,
                          policy_clip=PolicyClipConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, tis_cap=2.0))


def dense_reference(batch, mode, policy_loss):
    """One pass over the whole mini-batch with the aggregation formulas written out densely."""
    theta = batch["theta"].clone().requires_grad_()
    mask, features = batch["mask"], batch["features"]
    m = mask.double()
    logp = log_prob_of(features, theta)
    terms, _ = compute_policy_loss(policy_loss, logp, batch["old"], batch["advantages"], mask,
                                   loss_config(mode, policy_loss).policy_clip, batch["rollout"])
    nonempty = mask.any(-1)

    def agg(x):
        token_sums = (x * m).sum(-1)[nonempty]
        if mode == "token-mean":
            return (x * m).sum() / m.sum()
        if mode == "seq-mean-token-sum":
            return token_sums.mean()
        if mode == "seq-mean-token-mean":
            return (token_sums / m.sum(-1)[nonempty]).mean()
        return token_sums.mean() / LOSS_SCALE_FACTOR

    kl = kl_penalty(logp, batch["ref"], "low_var_kl")
    entropy = entropy_of(features, theta)
    total = agg(terms.loss) + KL_COEF * agg(kl) - ENTROPY_COEF * agg(entropy)
    total.backward()
    token_means = {"actor/pg_clipfrac": terms.clipped, "actor/ppo_kl": terms.approx_kl, "actor/kl": kl.detach(),
                   "actor/entropy": entropy.detach()}
    metrics = {key: (value * m).sum() / m.sum() for key, value in token_means.items()}
    return total.detach(), theta.grad, metrics


def micro_batch(batch, rows, theta):
    """The rows of one micro-batch, padded only to their own longest response (as a packer would)."""
    length = max(int(batch["mask"][rows].sum(-1).max()), 1)
    pick = {k: batch[k][rows][:, :length] for k in ["mask", "features", "advantages", "old", "ref", "rollout"]}
    return dict(pick, log_prob=log_prob_of(pick["features"], theta), entropy=entropy_of(pick["features"], theta))


def rank_pass(batch, micro_batches, info, mode, policy_loss):
    """One DP rank: back-propagate each micro-batch's loss / num_microbatches (megatron's 2-tuple path)."""
    theta = batch["theta"].clone().requires_grad_()
    share, metrics = torch.zeros((), dtype=torch.float64), {}
    for rows in micro_batches:
        mb = micro_batch(batch, rows, theta)
        out = compute_grpo_loss(mb["log_prob"], mb["old"], mb["advantages"], mb["mask"], info,
                                loss_config(mode, policy_loss), ref_log_prob=mb["ref"], entropy=mb["entropy"],
                                rollout_log_prob=mb["rollout"])
        (out.loss / NUM_MICRO_BATCHES).backward()
        share = share + out.share
        for key, value in out.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value.double()
    return share, theta.grad, metrics


def global_info(batch, dp_size):
    """The counts over every rank's micro-batches, computed in this one process (what the DP
    all-reduce gives; the gloo test below runs the all-reduce), for `dp_size` ranks."""
    masks = [batch["mask"][rows] for rank in RANK_MICRO_BATCHES for rows in rank]
    info = info_of(masks, loss_scale_factor=LOSS_SCALE_FACTOR, num_micro_batches=NUM_MICRO_BATCHES)
    return dataclasses.replace(info, dp_size=dp_size)


CASES = [(mode, policy) for mode in LOSS_AGG_MODES for policy in ["vanilla", "gspo"]]


@pytest.mark.parametrize("mode,policy_loss", CASES)
def test_micro_batches_and_dp_ranks_equal_one_pass(mode, policy_loss):
    batch = make_batch()
    ref_loss, ref_grad, ref_metrics = dense_reference(batch, mode, policy_loss)
    info = global_info(batch, dp_size=len(RANK_MICRO_BATCHES))
    assert info.num_sequences == NUM_SEQ - 2
    results = [rank_pass(batch, mbs, info, mode, policy_loss) for mbs in RANK_MICRO_BATCHES]
    total_share = sum(r[0] for r in results)
    averaged_grad = sum(r[1] for r in results) / len(results)  # DDP: average over DP ranks
    torch.testing.assert_close(total_share, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(averaged_grad, ref_grad, rtol=1e-10, atol=1e-12)
    for key, value in ref_metrics.items():
        torch.testing.assert_close(sum(r[2][key] for r in results), value.double(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_local_denominators_would_not_match(mode):
    """Sensitivity check: averaging per-micro-batch local aggregates (legacy gradient accumulation) differs."""
    batch = make_batch()
    ref_loss, _, _ = dense_reference(batch, mode, "vanilla")
    local = []
    for rows in [rows for rank in RANK_MICRO_BATCHES for rows in rank]:
        mb = micro_batch(batch, rows, batch["theta"])
        mb_info = info_of([mb["mask"]], loss_scale_factor=mb["mask"].shape[-1])
        local.append(compute_grpo_loss(mb["log_prob"], mb["old"], mb["advantages"], mb["mask"], mb_info,
                                       loss_config(mode, "vanilla"), ref_log_prob=mb["ref"], entropy=mb["entropy"],
                                       rollout_log_prob=mb["rollout"]).share)
    assert abs(sum(local) / len(local) - ref_loss) > 1e-3


def _distributed_rank(rank, world_size, batch):
    import torch.distributed as dist

    masks = [batch["mask"][rows] for rows in RANK_MICRO_BATCHES[rank]]
    info = info_of(masks, data_parallel=world_size, loss_scale_factor=LOSS_SCALE_FACTOR,
                   num_micro_batches=NUM_MICRO_BATCHES, process_group=dist.group.WORLD)
    results = {}
    for mode, policy_loss in CASES:
        share, grad, _ = rank_pass(batch, RANK_MICRO_BATCHES[rank], info, mode, policy_loss)
        dist.all_reduce(share)
        dist.all_reduce(grad)
        results[(mode, policy_loss)] = (share, grad / world_size)
    return (info.num_valid_tokens, info.num_sequences), results


@pytest.mark.slow
def test_gloo_two_dp_ranks_equal_one_pass():
    batch = make_batch()
    outputs = run_distributed(_distributed_rank, world_size=2, args=(batch,), timeout=120)
    expected_counts = (int(batch["mask"].sum()), NUM_SEQ - 2)
    for counts, results in outputs:
        assert counts == expected_counts  # all-reduced over the DP group
        for mode, policy_loss in CASES:
            ref_loss, ref_grad, _ = dense_reference(batch, mode, policy_loss)
            share, grad = results[(mode, policy_loss)]
            torch.testing.assert_close(share, ref_loss, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_advantage_config_default_is_grpo():
    assert AdvantageConfig().norm_adv_by_std and AdvantageConfig().epsilon == 1e-6
