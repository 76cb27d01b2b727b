"""Sampling-support replay and mismatch health, without spawning a trainer: the local engine's
supports against SGLang's own sampler function, its behaviour log-probs against a float64
reference, the support tensors of the micro-batches (packed, padded, CP-split), and the mismatch
statistics against exact quantiles."""
import json
import math

import pytest
import torch

from megatron_grpo.rollout.sampling import make_state, sample_tokens, truncation_drop
from megatron_grpo.trainer.batches.batching import TrainSample, collate, collate_packed
from megatron_grpo.trainer.batches.micro_batches import split_for_context_parallel_rank
from megatron_grpo.trainer.step.mismatch import DeltaStats, MismatchHealth, mismatch_metrics
from tests.sglang_harness.fixtures import sglang_sampler_function


# (top_p, top_k, min_p) per row; the first rows have ties at the cut-offs
SETTINGS = [(0.9, 20, 0.0), (1.0, 5, 0.0), (0.5, -1, 0.0), (1.0, -1, 0.1), (0.8, 50, 0.05), (0.95, 3, 0.0)]


def _probabilities(seed: int, rows: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 2.5
    logits[0, 10:16] = logits[0, 3]  # ties
    logits[1, 20:24] = logits[1].max()
    return torch.softmax(logits, dim=-1)


def test_local_supports_equal_sglangs_sampler_on_the_same_probabilities():
    """SGLang 0.5.23's own torch sampler (the function its pytorch backend and our harness call,
    compiled from its source) keeps exactly the ids our local engine's truncation keeps, ties at
    the cut-offs included."""
    sglang_sampler = sglang_sampler_function("top_k_top_p_min_p_sampling_from_probs_torch")
    probs = _probabilities(0, len(SETTINGS), 300)
    sglang = []
    for row, (top_p, top_k, min_p) in enumerate(SETTINGS):
        _, filtered, ids, _ = sglang_sampler(
            probs[row:row + 1].clone(), torch.tensor([top_k if top_k > 0 else 300]), torch.tensor([top_p]),
            torch.tensor([min_p]), min_p > 0, None, torch.tensor([0]), return_filtered_probs=True)
        sglang.append(sorted(ids[0][filtered[0] > 0].tolist()))
    top_p = torch.tensor([s[0] for s in SETTINGS])
    top_k = torch.tensor([s[1] if s[1] > 0 else 2**62 for s in SETTINGS])
    min_p = torch.tensor([s[2] for s in SETTINGS])
    sorted_probs, sorted_ids = probs.sort(-1, descending=True)
    keep = ~truncation_drop(sorted_probs, top_p, top_k, min_p)
    ours = [sorted(sorted_ids[row][keep[row]].tolist()) for row in range(len(SETTINGS))]
    assert ours == sglang
    assert [len(s) for s in ours] != [len(ours[0])] * len(ours)  # the settings cut differently


def test_behaviour_logprobs_and_supports_match_a_float64_reference():
    logits = torch.randn(len(SETTINGS), 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    temperature = 0.7
    state = make_state([temperature] * len(SETTINGS), [s[0] for s in SETTINGS], [s[1] for s in SETTINGS],
                       list(range(len(SETTINGS))), torch.device("cpu"), min_ps=[s[2] for s in SETTINGS])
    sampled = sample_tokens(logits.float(), state, [True] * len(SETTINGS))
    for row, support in enumerate(sampled.supports):
        token = int(sampled.tokens[row])
        assert token in support and len(set(support)) == len(support)
        z = logits[row] / temperature
        ids = torch.tensor(support)
        reference = z[token] - torch.logsumexp(z[ids], 0)
        full = z[token] - torch.logsumexp(z, 0)
        eps = torch.finfo(torch.float32).eps
        assert abs(float(sampled.behaviour[row]) - float(reference)) <= 64 * eps * max(1.0, abs(float(reference)))
        assert abs(float(sampled.logprobs[row]) - float(full)) <= 64 * eps * max(1.0, abs(float(full)))
        assert float(sampled.behaviour[row]) >= float(sampled.logprobs[row])  # renormalised over less mass
    # rows that do not ask for their support get none; the behaviour log-prob is still there
    quiet = sample_tokens(logits.float(), state, [False] * len(SETTINGS))
    assert quiet.supports == [None] * len(SETTINGS)


def test_untruncated_rows_report_the_full_log_prob_as_behaviour():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    state = make_state([1.0] * 3, [1.0, 0.9, 1.0], [-1, -1, -1], [0, 1, 2], torch.device("cpu"))
    sampled = sample_tokens(logits, state, [True] * 3)
    assert sampled.supports[0] is None and sampled.supports[2] is None and sampled.supports[1] is not None
    assert sampled.behaviour[0] == sampled.logprobs[0] and sampled.behaviour[2] == sampled.logprobs[2]


def _samples() -> list[TrainSample]:
    def sample(prompt, response, seed):
        generator = torch.Generator().manual_seed(seed)
        support = [sorted({token, *torch.randint(0, 40, (int(torch.randint(1, 6, (1,), generator=generator)),),
                                                   generator=generator).tolist()}) for token in response]
        return TrainSample(prompt_ids=prompt, response_ids=response, advantage=1.0,
                           rollout_logprobs=[-0.5] * len(response), sampling_support=support)

    return [sample([1, 2, 3], [4, 5, 6, 7], 0), sample([8, 9], [10, 11, 12, 13, 14, 15], 1), sample([3], [7, 8], 2)]


def _support_by_target(mb):
    """{(row, position): support ids} at the loss positions, and every support holds its target."""
    support = torch.stack([mb.rows(mb.support[..., k]) for k in range(mb.support.shape[-1])], -1)
    mask, targets = mb.rows(mb.loss_mask), mb.rows(mb.targets)
    out = {}
    for r, t in mask.nonzero().tolist():
        ids = [i for i in support[r, t].tolist() if i >= 0]
        assert int(targets[r, t]) in ids
        out[(r, t)] = ids
    assert (mb.support[~mb.loss_mask] == -1).all()
    return out


def test_micro_batches_carry_each_tokens_support_packed_padded_and_cp_split():
    samples = _samples()
    padded = collate(samples, [0, 1, 2])
    packed = collate_packed(samples, [0, 1, 2], sequence_multiple=4, total_multiple=4)
    assert _support_by_target(padded) == _support_by_target(packed)
    expected = {(i, len(s.prompt_ids) - 1 + j): sorted(ids) for i, s in enumerate(samples)
                for j, ids in enumerate(s.sampling_support)}
    assert {k: sorted(v) for k, v in _support_by_target(padded).items()} == expected
    # under context parallelism each rank's support follows its positions
    for mb in (padded, packed):
        for rank in range(2):
            part = split_for_context_parallel_rank(mb, rank, 2)
            assert part.support.shape[:2] == part.targets.shape
            keep = part.loss_mask
            flat_support, flat_targets = part.support[keep], part.targets[keep]
            assert bool((flat_support == flat_targets.unsqueeze(-1).to(flat_support.dtype)).any(-1).all())


def test_delta_quantiles_are_within_a_bin_of_the_exact_ones():
    generator = torch.Generator().manual_seed(3)
    delta = torch.randn(20000, generator=generator, dtype=torch.float64) * 0.05
    delta[:50] = 2.0  # a tail
    stats = DeltaStats()
    stats.add(delta[:7000])
    other = DeltaStats()
    other.add(delta[7000:])
    stats.merge(other)
    exact = delta.abs().quantile(torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    for q, value in zip((0.5, 0.9, 0.99), exact):
        assert value <= stats.abs_quantile(q) <= value * 10 ** (1 / 20) * 1.0001, q
    assert stats.max_abs == float(delta.abs().max())
    for q in (0.01, 0.5, 0.99):
        value = float(delta.quantile(q))
        got = stats.delta_quantile(q)
        assert abs(got - value) <= abs(value) * (10 ** (1 / 20) - 1) * 1.0001 + 1e-9, (q, got, value)
    outside = float(((delta.exp() < 0.9) | (delta.exp() > 1.1)).double().mean())
    assert stats.outside / stats.count == pytest.approx(outside, abs=1e-12)


def test_mismatch_health_splits_by_position_engine_and_staleness():
    health = MismatchHealth(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], [0, 1])
    delta = torch.tensor([[0.0, 0.3, 0.3, 0.3, 0.3, 0.3], [0.01, 0.01, 0.01, 0.2, 0.2, 0.2]])
    mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    fraction = torch.tensor([[0.0, 0.0, 0.2, 0.4, 0.6, 0.8], [j / 6 for j in range(6)]])
    health.add_rows([0, 1], delta, mask, fraction)
    metrics = mismatch_metrics(health.stats)
    assert metrics["mismatch/tokens"] == 11
    assert metrics["mismatch/ratio_outside_frac"] == pytest.approx(8 / 11)  # |0.3| and |0.2| are outside
    assert metrics["mismatch/engine_10.0.0.1:30000/ratio_outside_frac"] == 1.0
    assert metrics["mismatch/engine_10.0.0.2:30000/ratio_outside_frac"] == 0.5
    assert metrics["mismatch/staleness_1/tokens"] == 6
    assert metrics["mismatch/position_early/tokens"] == 4  # fractions 0, 0.2 | 0, 1/6
    assert metrics["mismatch/position_late/ratio_outside_frac"] == 1.0
    assert metrics["mismatch/ratio_max"] == pytest.approx(math.exp(0.3))
    one_engine = MismatchHealth(["local"])
    one_engine.add_rows([0], delta[:1], mask[:1], fraction[:1])
    assert not any(key.startswith("mismatch/engine_") for key in mismatch_metrics(one_engine.stats))


def test_mismatch_plot_panel(tmp_path):
    from megatron_grpo.trainer.metrics import plot_reward_curve

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.1 * s, "mismatch/abs_logp_diff_p99": 1e-3 * s,
                                        "mismatch/ratio_outside_frac": 0.01 * s}) + "\n" for s in range(1, 6)))
    png = plot_reward_curve(path, tmp_path / "curve.png")
    assert png.stat().st_size > 0
