"""Advantages, group index and the DAPO zero-variance filter vs golden values and plain-loop references."""
import math
import random

import pytest
import torch

from megatron_grpo.algo import (ADVANTAGE_ESTIMATORS, AdvantageConfig, broadcast_to_tokens, compute_advantages,
                                filter_zero_variance_groups, get_advantage_estimator, make_group_index,
                                register_advantage_estimator)
from megatron_grpo.errors import ConfigError

# Golden values computed with verl 0.8.0.dev and 0.9.1 (docs/architecture.md, "Reference values").
GOLDEN_SCORES = [1, 0, 0, 1, 1, 1, 1, 1, 0.5, 2, 0]
GOLDEN_UIDS = ["g0"] * 4 + ["g1"] * 4 + ["g2"] + ["g3"] * 2
GOLDEN = {
    "grpo": [0.8660239, -0.8660239, -0.8660239, 0.8660239, 0, 0, 0, 0, 0.4999995, 0.7071063, -0.7071063],
    "dr.grpo": [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0.5, 1.0, -1.0],
    "rloo": [0.6666667, -0.6666667, -0.6666667, 0.6666667, 0, 0, 0, 0, 0.5, 2.0, -2.0],
}


def _golden_call(kind, group_ids):
    scores = torch.tensor(GOLDEN_SCORES, dtype=torch.float32)
    if kind == "dr.grpo":
        return compute_advantages("grpo", scores, group_ids, config=AdvantageConfig(norm_adv_by_std=False))
    return compute_advantages(kind, scores, group_ids)


@pytest.mark.parametrize("kind", sorted(GOLDEN))
@pytest.mark.parametrize("id_form", ["strings", "long_tensor"])
def test_golden_advantages(kind, id_form):
    ids = GOLDEN_UIDS if id_form == "strings" else torch.tensor([int(u[1]) * 7 for u in GOLDEN_UIDS])
    got = _golden_call(kind, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(GOLDEN[kind]), rtol=0, atol=1e-6)


def test_order_of_samples_does_not_matter():
    perm = torch.randperm(len(GOLDEN_SCORES), generator=torch.Generator().manual_seed(0))
    scores = torch.tensor(GOLDEN_SCORES)[perm]
    ids = [GOLDEN_UIDS[i] for i in perm]
    got = compute_advantages("grpo", scores, ids)
    torch.testing.assert_close(got, torch.tensor(GOLDEN["grpo"])[perm], rtol=0, atol=1e-6)


# ---- plain-loop references (dicts of lists, python floats, torch.std for the unbiased std) ----

def _groups(ids):
    members = {}
    for i, uid in enumerate(ids):
        members.setdefault(uid, []).append(i)
    return members


def loop_grpo(scores, ids, norm=True, eps=1e-6):
    out = [0.0] * len(scores)
    for idx in _groups(ids).values():
        vals = torch.tensor([scores[i] for i in idx], dtype=torch.float64)
        mean, std = (0.0, 1.0) if len(idx) == 1 else (vals.mean().item(), torch.std(vals).item())
        for i in idx:
            out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return out


def loop_rloo(scores, ids):
    out = [0.0] * len(scores)
    for idx in _groups(ids).values():
        for i in idx:
            others = [scores[j] for j in idx if j != i]
            out[i] = scores[i] - sum(others) / len(others) if others else scores[i]
    return out


def loop_rfpp_baseline(scores, ids, mask):
    centred = [0.0] * len(scores)
    for idx in _groups(ids).values():
        mean = 0.0 if len(idx) == 1 else sum(scores[i] for i in idx) / len(idx)
        for i in idx:
            centred[i] = scores[i] - mean
    tokens = [centred[i] for i in range(len(scores)) for t in range(mask.shape[1]) if mask[i, t]]
    mu = sum(tokens) / len(tokens)
    var = sum((x - mu) ** 2 for x in tokens) / (len(tokens) - 1)
    return [(centred[i] - mu) / math.sqrt(var + 1e-8) if mask[i].any() else 0.0 for i in range(len(scores))]


def _random_batch(seed):
    rng = random.Random(seed)
    ids, scores = [], []
    for g in range(rng.randint(1, 8)):
        size = rng.randint(1, 16)
        discrete = rng.random() < 0.5  # 0/1 rewards make zero-variance groups likely
        for _ in range(size):
            ids.append(f"uid-{seed}-{g}")
            scores.append(float(rng.randint(0, 1)) if discrete else rng.uniform(-3, 3))
    order = list(range(len(ids)))
    rng.shuffle(order)
    ids = [ids[i] for i in order]
    scores = [scores[i] for i in order]
    lengths = [rng.choice([0, 1, rng.randint(1, 9)]) for _ in ids]
    mask = torch.zeros(len(ids), 9, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    if mask.sum() < 2:
        mask[:, :2] = True
    return ids, scores, mask


def _f64(values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(25))
def test_random_batches_match_loop_references(seed):
    ids, scores, mask = _random_batch(seed)
    x = torch.tensor(scores, dtype=torch.float64)
    tol = dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(compute_advantages("grpo", x, ids), _f64(loop_grpo(scores, ids)), **tol)
    torch.testing.assert_close(compute_advantages("grpo", x, ids, config=AdvantageConfig(norm_adv_by_std=False)),
                               _f64(loop_grpo(scores, ids, norm=False)), **tol)
    torch.testing.assert_close(compute_advantages("rloo", x, ids), _f64(loop_rloo(scores, ids)), **tol)
    torch.testing.assert_close(compute_advantages("reinforce_plus_plus_baseline", x, ids, mask),
                               _f64(loop_rfpp_baseline(scores, ids, mask)), **tol)
    # float32 input: same values to float32 precision, float32 output
    got32 = compute_advantages("grpo", x.float(), ids)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, torch.tensor(loop_grpo(scores, ids), dtype=torch.float32),
                               rtol=1e-5, atol=2e-5)


def test_rfpp_baseline_is_whitened_over_valid_tokens():
    ids, scores, mask = _random_batch(3)
    adv = compute_advantages("reinforce_plus_plus_baseline", torch.tensor(scores, dtype=torch.float64), ids, mask)
    tokens = broadcast_to_tokens(adv, mask)[mask]
    assert abs(tokens.mean().item()) < 1e-9
    assert abs(tokens.var().item() - 1.0) < 1e-6  # unbiased variance 1 (up to the 1e-8 in the whitening)


def test_rfpp_baseline_needs_mask():
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages("reinforce_plus_plus_baseline", torch.ones(4), [0, 0, 1, 1])


def test_broadcast_to_tokens_masks_including_empty_rows():
    adv = torch.tensor([1.5, -2.0, 3.0])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    expected = torch.tensor([[1.5, 1.5, 0], [0, 0, 0], [3.0, 0, 3.0]])
    torch.testing.assert_close(broadcast_to_tokens(adv, mask), expected)


def test_group_index_dense_and_counts():
    index = make_group_index(["b", "a", "b", ("t", 1), "a", "b"])
    assert index.index.tolist() == [0, 1, 0, 2, 1, 0]
    assert index.counts.tolist() == [3, 2, 1]
    tensor_index = make_group_index(torch.tensor([40, 7, 40, 9]))
    assert tensor_index.num_groups == 3 and tensor_index.counts.tolist() == [1, 1, 2]
    with pytest.raises(ValueError):
        make_group_index(torch.tensor([0.5, 1.0]))


@pytest.fixture
def registered_max_baseline():
    """A user estimator, unregistered afterwards: the registry is process-wide, and a leftover name
    would change what later tests (config validation's name lists) see."""
    name = "test_max_baseline"

    @register_advantage_estimator(name)
    def max_baseline(scores, groups, response_mask, config):
        return scores - groups.expand(groups.group_amax(scores))

    yield name
    del ADVANTAGE_ESTIMATORS._entries[name]


def test_registry_user_estimator_and_errors(registered_max_baseline):
    name = registered_max_baseline
    got = compute_advantages(name, torch.tensor([1.0, 3.0, 2.0, 5.0]), ["a", "a", "b", "b"])
    torch.testing.assert_close(got, torch.tensor([-2.0, 0.0, -3.0, 0.0]))
    assert get_advantage_estimator("grpo") is get_advantage_estimator("grpo")
    with pytest.raises(ConfigError, match="grpo.*rloo"):
        get_advantage_estimator("gae_typo")
    with pytest.raises(ConfigError, match="already registered"):
        register_advantage_estimator("grpo")(lambda *a: None)


def test_shape_errors():
    with pytest.raises(ValueError, match="group ids"):
        compute_advantages("grpo", torch.ones(3), ["a", "b"])
    with pytest.raises(ValueError, match=r"\[B\]"):
        compute_advantages("grpo", torch.ones(3, 2), ["a", "b", "c"])


# ---- DAPO dynamic-sampling filter ----

def loop_zero_variance_keep(scores, ids, keep_singletons=True):
    keep = [False] * len(scores)
    for idx in _groups(ids).values():
        vals = [scores[i] for i in idx]
        kept = len(set(vals)) > 1 or (keep_singletons and len(idx) == 1)
        for i in idx:
            keep[i] = kept
    return keep


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("keep_singletons", [True, False])
def test_zero_variance_filter_matches_loop(seed, keep_singletons):
    ids, scores, _ = _random_batch(seed)
    result = filter_zero_variance_groups(torch.tensor(scores), ids, keep_singletons=keep_singletons)
    expected = loop_zero_variance_keep(scores, ids, keep_singletons)
    assert result.keep.tolist() == expected
    kept_groups = {u for u, k in zip(ids, expected) if k}
    assert result.num_kept_groups == len(kept_groups)
    assert result.num_dropped_groups == len(set(ids)) - len(kept_groups)
    assert result.num_kept_samples == sum(expected)


def test_zero_variance_filter_golden_groups():
    result = filter_zero_variance_groups(torch.tensor(GOLDEN_SCORES), GOLDEN_UIDS)
    # g1 = [1, 1, 1, 1] is dropped; the singleton g2 is kept (verl DAPO: std > 0 or len == 1)
    assert result.keep.tolist() == [True] * 4 + [False] * 4 + [True] * 3
    assert (result.num_kept_groups, result.num_dropped_groups, result.num_kept_samples) == (3, 1, 7)


def test_algo_imports_no_megatron():
    """Design boundary: algo/ is pure tensor code (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys, megatron_grpo.algo; "
            "bad = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
