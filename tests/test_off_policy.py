"""Off-policy corrections (algo/off_policy.py) against dense float64 references written from the
definitions (per element, Python math): truncated IS at token / sequence level, rejection (masked
IS) at token / sequence / geometric level, both together (IcePop, AReaL's decoupled objective), the
behaviour-anchored objective, the weighted GRPO loss and its gradient, the per-staleness gap."""
import math

import pytest
import torch

from megatron_grpo.algo import (GlobalBatchInfo, GRPOLossConfig, OffPolicyConfig, compute_grpo_loss,
                                off_policy_weights, staleness_gap_sums)
from megatron_grpo.errors import ConfigError
from megatron_grpo.testing.floats import assert_close_to_float64

B, T = 5, 7


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # the proximal policy differs by up to +-1.2 nats per token: ratios from 0.3 to 3.3
    proximal = behaviour + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 2.4
    mask = torch.ones(B, T, dtype=torch.bool)
    for row, length in enumerate([7, 5, 1, 3, 0]):  # ragged rows, one empty
        mask[row, length:] = False
    return proximal.to(dtype), behaviour.to(dtype), mask


def _reference_weights(proximal, behaviour, mask, cfg: OffPolicyConfig) -> list[list[float]]:
    """w per token from the definitions, in float64 Python math (module docstring of off_policy.py)."""
    p, b, m = proximal.double().tolist(), behaviour.double().tolist(), mask.tolist()
    low, high = (1.0 / cfg.rs_high if cfg.rs_low is None else cfg.rs_low), cfg.rs_high
    out = []
    for i in range(len(p)):
        d = [p[i][t] - b[i][t] for t in range(len(p[i]))]
        valid = [t for t in range(len(d)) if m[i][t]]
        seq_sum = sum(d[t] for t in valid)
        geo = seq_sum / max(len(valid), 1)
        row = []
        for t in range(len(d)):
            if not m[i][t]:
                row.append(0.0)
                continue
            w = 1.0
            if cfg.is_level == "token":
                w = min(math.exp(d[t]), cfg.is_cap)
            elif cfg.is_level == "sequence":
                w = min(math.exp(seq_sum), cfg.is_cap)
            if cfg.rs_level is not None:
                rho = {"token": math.exp(d[t]), "sequence": math.exp(seq_sum), "geometric": math.exp(geo)}[cfg.rs_level]
                if not low <= rho <= high:
                    w = 0.0
            row.append(w)
        out.append(row)
    return out


CONFIGS = {
    "tis-token": OffPolicyConfig(is_level="token", is_cap=1.5),
    "tis-sequence": OffPolicyConfig(is_level="sequence", is_cap=4.0),
    "rs-token": OffPolicyConfig(rs_level="token", rs_high=2.0),  # band [0.5, 2]
    "rs-sequence": OffPolicyConfig(rs_level="sequence", rs_low=0.2, rs_high=3.0),
    "rs-geometric": OffPolicyConfig(rs_level="geometric", rs_high=1.3),
    "icepop": OffPolicyConfig(is_level="token", is_cap=2.0, rs_level="token", rs_low=0.5, rs_high=2.0),
    "areal-decoupled": OffPolicyConfig(is_level="token", is_cap=1.8, rs_level="token", rs_low=0.0, rs_high=1.8),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weights_match_the_float64_definitions(name):
    cfg = CONFIGS[name]
    proximal, behaviour, mask = _inputs()
    got = off_policy_weights(proximal, behaviour, mask, cfg)
    reference = torch.tensor(_reference_weights(proximal, behaviour, mask, cfg), dtype=torch.float64)
    # A weight is exp of a sum of up to T fp32 log-ratio terms: its rounding grows with the row.
    assert_close_to_float64(got.weights, reference, dtype=torch.float32, terms=2 * T, name=f"{name} weights")
    assert not got.weights.requires_grad
    assert (got.weights[~mask] == 0).all()
    rejected = (reference == 0) & mask
    if cfg.rs_level is not None:
        assert torch.equal(got.rejected, rejected), name
        assert 0 < int(rejected.sum()) < int(mask.sum()), f"{name}: the inputs must exercise the band"
    else:
        assert not got.rejected.any()


def test_default_config_is_unweighted_and_leaves_the_loss_bitwise_unchanged():
    proximal, behaviour, mask = _inputs(seed=1)
    logp = (proximal + 0.1).requires_grad_()
    advantages = torch.randn(B, T, generator=torch.Generator().manual_seed(2))
    info = GlobalBatchInfo(num_valid_tokens=int(mask.sum()), num_sequences=int(mask.any(-1).sum()))
    assert not OffPolicyConfig().weighted
    plain = compute_grpo_loss(logp, proximal, advantages, mask, info, GRPOLossConfig())
    with_rollout = compute_grpo_loss(logp, proximal, advantages, mask, info, GRPOLossConfig(),
                                     rollout_log_prob=behaviour)
    assert torch.equal(plain.loss, with_rollout.loss)
    assert not any(k.startswith("off_policy/") for k in with_rollout.metrics)


def _reference_weighted_vanilla(logp, proximal, advantages, mask, weights, eps=0.2, c=3.0):
    """token-mean of w * max(-A r, -A clip(r)) with the dual clip, float64, per element."""
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(float(logp[i, t]) - float(proximal[i, t]))
            a = float(advantages[i, t])
            loss = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
            if a < 0:
                loss = min(loss, -a * c)
            total += weights[i][t] * loss
            count += 1
    return total / count


@pytest.mark.parametrize("name", ["tis-token", "rs-geometric", "areal-decoupled"])
def test_weighted_grpo_loss_and_gradient_match_float64(name):
    cfg = CONFIGS[name]
    proximal, behaviour, mask = _inputs(seed=3)
    g = torch.Generator().manual_seed(4)
    logp = (proximal + (torch.rand(B, T, generator=g) - 0.5) * 0.6).requires_grad_()
    advantages = torch.randn(B, T, generator=g)
    info = GlobalBatchInfo(num_valid_tokens=int(mask.sum()), num_sequences=int(mask.any(-1).sum()))
    out = compute_grpo_loss(logp, proximal, advantages, mask, info, GRPOLossConfig(off_policy=cfg),
                            rollout_log_prob=behaviour)
    weights = _reference_weights(proximal, behaviour, mask, cfg)
    expected = _reference_weighted_vanilla(logp.detach(), proximal, advantages, mask, weights)
    assert_close_to_float64(out.loss.detach().reshape(1), torch.tensor([expected], dtype=torch.float64),
                            dtype=torch.float32, terms=int(mask.sum()) * T, name=f"{name} loss")
    out.loss.backward()
    # Gradient reference: float64 autograd of the same definition (weights are constants).
    logp64 = logp.detach().double().requires_grad_()
    w64 = torch.tensor(weights, dtype=torch.float64)
    r = (logp64 - proximal.double()).exp()
    a = advantages.double()
    loss = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    loss = torch.where(a < 0, torch.minimum(loss, -a * 3.0), loss)
    (torch.where(mask, w64 * loss, 0.0).sum() / mask.sum()).backward()
    assert_close_to_float64(logp.grad, logp64.grad, dtype=torch.float32, terms=2 * T, name=f"{name} gradient")
    metrics = out.metrics
    valid = mask.sum()
    ref_w = torch.where(mask, w64, 0.0).sum() / valid
    assert abs(float(metrics["off_policy/weight_mean"]) - float(ref_w)) < 1e-5
    if cfg.rs_level is not None:
        ref_masked = float(((w64 == 0) & mask).sum() / valid)
        assert abs(float(metrics["off_policy/masked_frac"]) - ref_masked) < 1e-6


def test_behaviour_objective_clips_against_the_rollout_log_probs():
    """objective=behaviour equals the plain loss with old := rollout log-probs (one policy)."""
    proximal, behaviour, mask = _inputs(seed=5)
    logp = (behaviour + 0.3).requires_grad_()
    advantages = torch.randn(B, T, generator=torch.Generator().manual_seed(6))
    info = GlobalBatchInfo(num_valid_tokens=int(mask.sum()), num_sequences=int(mask.any(-1).sum()))
    out = compute_grpo_loss(logp, proximal, advantages, mask, info,
                            GRPOLossConfig(off_policy=OffPolicyConfig(objective="behaviour")),
                            rollout_log_prob=behaviour)
    ones = [[1.0] * T for _ in range(B)]
    expected = _reference_weighted_vanilla(logp.detach(), behaviour, advantages, mask, ones)
    assert_close_to_float64(out.loss.detach().reshape(1), torch.tensor([expected], dtype=torch.float64),
                            dtype=torch.float32, terms=int(mask.sum()) * T, name="behaviour-anchored loss")
    with pytest.raises(ValueError, match="rollout"):
        compute_grpo_loss(logp, proximal, advantages, mask, info,
                          GRPOLossConfig(off_policy=OffPolicyConfig(objective="behaviour")))


def test_staleness_gap_sums():
    proximal, behaviour, mask = _inputs(seed=7)
    staleness = [0, 1, 0, 2, 1]
    sums = staleness_gap_sums(proximal, behaviour, mask, staleness)
    assert sorted(sums) == [0, 1, 2]
    for s, (total, count) in sums.items():
        rows = [i for i in range(B) if staleness[i] == s]
        ref = sum(abs(float(proximal[i, t]) - float(behaviour[i, t])) for i in rows for t in range(T) if mask[i, t])
        ref_count = sum(int(mask[i].sum()) for i in rows)
        assert int(count) == ref_count
        assert abs(float(total) - ref) <= 1e-6 * max(ref, 1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(objective="offpolicy"), "objective"),
    (dict(is_level="row"), "is_level"),
    (dict(rs_level="tokens"), "rs_level"),
    (dict(objective="behaviour", is_level="token"), "behaviour"),
    (dict(is_cap=0.0), "is_cap"),
    (dict(rs_low=3.0, rs_high=2.0), "rs_low"),
])
def test_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=message):  # what GRPOLossConfig runs for direct users
        OffPolicyConfig(**kwargs).check()
    with pytest.raises(ConfigError, match=message):
        GRPOLossConfig(off_policy=OffPolicyConfig(**kwargs))
