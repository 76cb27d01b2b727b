"""KL estimators, policy losses (vanilla, gspo, TIS) and their metrics vs golden values and loop references."""
import math

import pytest
import torch

from megatron_grpo.algo import (POLICY_LOSSES, GlobalBatchInfo, GRPOLossConfig, PolicyClipConfig, PolicyLossTerms,
                                aggregate, compute_grpo_loss, compute_policy_loss, get_policy_loss, kl_penalty,
                                register_policy_loss)
from megatron_grpo.errors import ConfigError

# ---- KL: golden values computed with verl's core_algos.py (docs/architecture.md, "Reference values") ----
KL_LOGP = [-1.0, -2.0, -0.5, -30.0]
KL_REF = [-1.5, -1.0, -0.5, -1.0]
KL_GOLDEN = {
    "k1": [0.5, -1, 0, -29], "abs": [0.5, 1, 0, 29], "k2": [0.125, 0.5, 0, 420.5],
    "k3": [0.1065307, 0.7182817, 0, 10.0],  # the last entry hits the +10 output clamp
}
KL_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


@pytest.mark.parametrize("name", sorted(KL_ALIASES))
def test_kl_golden(name):
    got = kl_penalty(torch.tensor(KL_LOGP), torch.tensor(KL_REF), name)
    torch.testing.assert_close(got, torch.tensor(KL_GOLDEN[KL_ALIASES[name]]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(KL_ALIASES))
def test_kl_straight_through_value_of_base_gradient_of_k2(name):
    logp = torch.tensor(KL_LOGP, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(KL_REF, dtype=torch.float64)
    value = kl_penalty(logp, ref, name + "+")
    torch.testing.assert_close(value.detach(), kl_penalty(logp, ref, name).detach())
    weights = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)
    (value * weights).sum().backward()
    # d/dlogp of 0.5 (logp - ref)^2 is (logp - ref)
    torch.testing.assert_close(logp.grad, (logp.detach() - ref) * weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["k1", "abs", "k2", "k3"])
def test_kl_straight_through_forward_is_exact_in_low_precision(name, dtype):
    """The "+" value equals the base estimator's own value in the same dtype, bit for bit, and
    both are within the dtype's rounding of the float64 value; the gradient is k2's, (logp - ref).
    logp - ref = 73.3 is where `k2 + (value - k2).detach()` rounded away from the value (fp32
    k1+: 73.30005 for 73.3; bf16 k3+: 16 for 10)."""
    from megatron_grpo.testing.floats import assert_close_to_float64

    logp64 = torch.tensor([72.3, -1.25, -0.5, -30.0, 4.0], dtype=torch.float64)
    ref64 = torch.tensor([-1.0, -1.0, -0.5, -1.0, -3.5], dtype=torch.float64)
    logp = logp64.to(dtype).requires_grad_()
    ref = ref64.to(dtype)
    value = kl_penalty(logp, ref, name + "+")
    base = kl_penalty(logp.detach(), ref, name)
    assert value.dtype == dtype and torch.equal(value.detach(), base)
    # float64 from the same rounded inputs: the difference is the estimator's own rounding
    reference = kl_penalty(logp.detach().double(), ref.double(), name)
    assert_close_to_float64(value, reference, dtype=dtype, terms=4, name=f"{name}+ in {dtype}")
    value.sum().backward()
    assert_close_to_float64(logp.grad, logp.detach().double() - ref.double(), dtype=dtype, terms=2,
                            name=f"d {name}+ / d logp in {dtype}")


def test_kl_gradients_of_base_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.25], dtype=torch.float64)
    kl_penalty(logp, ref, "k3").sum().backward()
    # k3 = exp(ref - logp) - (ref - logp) - 1 -> d/dlogp = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, 1 - torch.exp(ref - logp.detach()))


def test_kl_unknown_and_full_raise():
    for bad in ["full", "k4", "k3++", ""]:
        with pytest.raises(ConfigError, match="low_var_kl"):
            kl_penalty(torch.zeros(2), torch.zeros(2), bad)


# ---- vanilla PG: golden value ----

def test_vanilla_golden_loss_and_metrics():
    ratio = torch.tensor([[0.5, 1.5, 5.0, 1.1]])
    log_prob = ratio.log().requires_grad_()
    mask = torch.ones(1, 4)
    clip = PolicyClipConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    config = GRPOLossConfig(policy_clip=clip)
    out = compute_grpo_loss(log_prob, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, -1.0, -1.0]]), mask,
                            GlobalBatchInfo.from_row_token_counts([mask.sum(-1)]), config)
    assert out.loss.item() == pytest.approx(0.58, abs=1e-6)
    assert out.metrics["actor/pg_clipfrac"].item() == pytest.approx(0.25)
    assert out.metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert out.metrics["actor/ppo_kl"].item() == pytest.approx(-0.3542665, abs=1e-6)
    out.loss.backward()
    # token 0: unclipped, d(-A r)/dlogp = -r; token 1: clipped (no grad); token 2: dual clip (no grad);
    # token 3: unclipped with A = -1 -> +r. Each / 4 (token-mean).
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.5, 0.0, 0.0, 1.1]]) / 4)


# ---- vanilla PG: random batches vs a per-element loop ----

def loop_vanilla_token(logp, old, adv, eps_low, eps_high, c):
    log_ratio = min(max(logp - old, -20.0), 20.0)
    ratio = math.exp(log_ratio)
    l1, l2 = -adv * ratio, -adv * min(max(ratio, 1 - eps_low), 1 + eps_high)
    lc = max(l1, l2)
    loss = min(lc, -adv * c) if adv < 0 else lc
    # d loss / d logp: only the unclipped branch (l1) carries gradient, and only inside the log-ratio clamp
    active = (l1 >= l2) and not (adv < 0 and lc > -adv * c) and -20.0 < logp - old < 20.0
    grad = -adv * ratio if active else 0.0
    return loss, grad, l2 > l1, (lc > -adv * c) and adv < 0, old - logp


def _random_tokens(seed, rows=6, cols=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.4
    old[0, 0] = logp[0, 0] - 25.0  # beyond the [-20, 20] clamp
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, cols).clone()
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    lengths[0] = cols
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("clips", [(0.2, 0.2, 3.0), (0.2, 0.28, 1.5)])
def test_vanilla_matches_loop(seed, clips):
    eps_low, eps_high, c = clips
    logp, old, adv, mask = _random_tokens(seed)
    logp.requires_grad_()
    terms, weights = compute_policy_loss("vanilla", logp, old, adv, mask, PolicyClipConfig(eps_low, eps_high, c))
    assert weights is None
    terms.loss.sum().backward()
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            loss, grad, clipped, lower, approx_kl = loop_vanilla_token(logp[i, t].item(), old[i, t].item(),
                                                                       adv[i, t].item(), eps_low, eps_high, c)
            assert terms.loss[i, t].item() == pytest.approx(loss, rel=1e-12, abs=1e-12)
            assert logp.grad[i, t].item() == pytest.approx(grad, rel=1e-12, abs=1e-12)
            assert bool(terms.clipped[i, t]) == clipped and bool(terms.clipped_lower[i, t]) == lower
            assert terms.approx_kl[i, t].item() == pytest.approx(min(max(approx_kl, -20), 20), abs=1e-12)


def test_dual_clip_bound_must_exceed_one():
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        PolicyClipConfig(clip_ratio_c=1.0)


# ---- GSPO: token form with seq-mean-token-mean == the paper's sequence objective ----

def paper_gspo_row_loss(logp_row, old_row, adv, eps_low, eps_high):
    """GSPO (arXiv 2507.18071) for one sequence, no stop-gradient trick: -min(s A, clip(s) A)."""
    s = torch.exp((logp_row - old_row).mean())
    return torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - eps_low, 1 + eps_high))


@pytest.mark.parametrize("seed", range(6))
def test_gspo_matches_paper_objective(seed):
    logp, old, adv, mask = _random_tokens(seed)
    old[0, 0] = logp[0, 0] - 0.3  # keep the sequence ratio inside the max-10 log clamp
    config = PolicyClipConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4)  # GSPO's sequence-level clip range
    logp_ours = logp.clone().requires_grad_()
    terms, _ = compute_policy_loss("gspo", logp_ours, old, adv, mask, config)
    info = GlobalBatchInfo(num_valid_tokens=int(mask.sum()), num_sequences=int(mask.any(-1).sum()))
    aggregate(terms.loss, mask, "seq-mean-token-mean", info).backward()

    logp_ref = logp.clone().requires_grad_()
    rows = [paper_gspo_row_loss(logp_ref[i][mask[i]], old[i][mask[i]], adv[i, 0], 3e-4, 4e-4)
            for i in range(logp.shape[0]) if mask[i].any()]
    reference = torch.stack(rows).mean()
    reference.backward()
    ours = aggregate(terms.loss.detach(), mask, "seq-mean-token-mean", info)
    torch.testing.assert_close(ours, reference.detach())
    torch.testing.assert_close(logp_ours.grad, logp_ref.grad)
    assert not terms.clipped_lower.any()
    # sequence ratio: every valid token of a row carries the same clipped flag
    for i in range(logp.shape[0]):
        assert len(set(terms.clipped[i][mask[i]].tolist())) <= 1


def test_gspo_log_ratio_clamped_at_10():
    logp = torch.zeros(1, 3)
    terms, _ = compute_policy_loss("gspo", logp, logp - 15.0, torch.full((1, 3), -1.0), torch.ones(1, 3),
                                   PolicyClipConfig())
    torch.testing.assert_close(terms.loss, torch.full((1, 3), math.exp(10.0)))


# ---- TIS ----

def test_tis_weights_multiply_token_loss_and_are_detached():
    logp, old, adv, mask = _random_tokens(11)
    old = old.clamp(min=logp - 1, max=logp + 1)
    rollout = (old + torch.randn_like(old) * 0.5).requires_grad_()
    cap = 1.5
    config = PolicyClipConfig(tis_cap=cap)
    logp_tis = logp.clone().requires_grad_()
    terms, weights = compute_policy_loss("vanilla", logp_tis, old, adv, mask, config, rollout_log_prob=rollout)
    expected_w = torch.tensor([[min(math.exp(o - r), cap) for o, r in zip(orow, rrow)]
                               for orow, rrow in zip(old.tolist(), rollout.tolist())], dtype=torch.float64)
    torch.testing.assert_close(weights, expected_w)
    assert not weights.requires_grad and weights.max() <= cap
    plain_logp = logp.clone().requires_grad_()
    plain, _ = compute_policy_loss("vanilla", plain_logp, old, adv, mask, PolicyClipConfig())
    torch.testing.assert_close(terms.loss, plain.loss * expected_w)
    terms.loss.sum().backward()
    plain.loss.sum().backward()
    torch.testing.assert_close(logp_tis.grad, plain_logp.grad * expected_w)
    assert rollout.grad is None
    # an extreme mismatch never overflows: exp(old - rollout) is capped in log space
    huge, _ = compute_policy_loss("vanilla", logp, old, adv, mask, config, rollout_log_prob=old - 1e4)
    assert torch.isfinite(huge.loss).all()


def test_tis_without_rollout_log_prob_raises():
    logp, old, adv, mask = _random_tokens(0)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_policy_loss("vanilla", logp, old, adv, mask, PolicyClipConfig(tis_cap=2.0))


# ---- registry and config validation ----

@pytest.fixture
def registered_reinforce():
    """A user policy loss, unregistered afterwards (the registry is process-wide; a leftover name
    would change what later tests see)."""
    name = "test_reinforce"

    @register_policy_loss(name)
    def reinforce(log_prob, old_log_prob, advantages, response_mask, config):
        zeros = torch.zeros_like(response_mask, dtype=torch.bool)
        return PolicyLossTerms(loss=-advantages * log_prob, clipped=zeros, clipped_lower=zeros,
                               approx_kl=(old_log_prob - log_prob).detach())

    yield name
    del POLICY_LOSSES._entries[name]


def test_policy_loss_registry(registered_reinforce):
    name = registered_reinforce
    logp, old, adv, mask = _random_tokens(2)
    terms, _ = compute_policy_loss(name, logp, old, adv, mask, PolicyClipConfig())
    torch.testing.assert_close(terms.loss, -adv * logp)
    with pytest.raises(ConfigError, match="gspo.*vanilla"):
        get_policy_loss("ppo")
    with pytest.raises(ConfigError, match="gspo"):
        GRPOLossConfig(policy_loss="nope")
    with pytest.raises(ConfigError, match="token-mean"):
        GRPOLossConfig(loss_agg_mode="token_mean")
    with pytest.raises(ConfigError, match="low_var_kl"):
        GRPOLossConfig(kl_loss_type="full")


def test_missing_inputs_raise():
    logp, old, adv, mask = _random_tokens(1)
    info = GlobalBatchInfo.from_row_token_counts([mask.sum(-1)])
    with pytest.raises(ValueError, match="ref_log_prob"):
        compute_grpo_loss(logp, old, adv, mask, info, GRPOLossConfig(use_kl_loss=True))
    with pytest.raises(ValueError, match="entropy"):
        compute_grpo_loss(logp, old, adv, mask, info, GRPOLossConfig(entropy_coeff=0.01))


def test_step_one_invariants_ratio_one_and_kl_zero():
    """old == new gives ratio 1 (no clipping, ppo_kl 0); ref == policy gives KL 0 for every estimator."""
    logp, _, adv, mask = _random_tokens(4)
    info = GlobalBatchInfo.from_row_token_counts([mask.sum(-1)])
    for kl_type in ["k1", "abs", "k2", "k3", "k3+"]:
        out = compute_grpo_loss(logp, logp.clone(), adv, mask, info,
                                GRPOLossConfig(use_kl_loss=True, kl_loss_type=kl_type), ref_log_prob=logp.clone())
        assert out.metrics["actor/pg_clipfrac"].item() == 0 and out.metrics["actor/ppo_kl"].item() == 0
        assert out.metrics["actor/kl_loss"].item() == 0 and out.metrics["actor/kl"].item() == 0
        expected = -(adv * mask).sum() / mask.sum()  # ratio 1: loss = token-mean of -A
        torch.testing.assert_close(out.loss, expected)
