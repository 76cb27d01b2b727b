"""Micro-batch layout, token balancing and pass@k: checked against direct constructions."""
import math
import random

import pytest
import torch

from megatron_grpo.trainer.batches.batching import TrainSample, collate
from megatron_grpo.trainer.evaluation.evaluate import pass_at_k
from megatron_grpo.trainer.batches.micro_batches import (balance_into_micro_batches, pad_to_common_shape,
                                                         split_over_ranks)


def _sample(prompt_len, response_len, advantage=0.5, offset=0):
    prompt = list(range(10 + offset, 10 + offset + prompt_len))
    response = list(range(100 + offset, 100 + offset + response_len))
    return TrainSample(prompt_ids=prompt, response_ids=response, advantage=advantage,
                       rollout_logprobs=[-(i + 1) / 10 for i in range(response_len)])


def test_collate_places_response_tokens_at_their_prediction_positions():
    samples = [_sample(3, 2, 1.0), _sample(2, 4, -1.0, offset=5)]
    mb = collate(samples, [0, 1])
    assert mb.tokens.shape == (2, 6)
    for row, sample in enumerate(samples):
        sequence = sample.prompt_ids + sample.response_ids
        assert mb.tokens[row, : len(sequence)].tolist() == sequence
        # The model predicts response token j at position len(prompt) - 1 + j.
        predicted = mb.targets[row][mb.loss_mask[row]].tolist()
        assert predicted == sample.response_ids
        assert mb.advantages[row][mb.loss_mask[row]].tolist() == [sample.advantage] * len(sample.response_ids)
        rollout = mb.per_token["rollout_logprobs"][row][mb.loss_mask[row]].tolist()
        assert rollout == pytest.approx(sample.rollout_logprobs)
    assert int(mb.loss_mask.sum()) == 6
    assert mb.position_ids[1].tolist() == list(range(6))


def test_collate_pads_to_multiple():
    mb = collate([_sample(3, 2)], [0], pad_to_multiple=4)
    assert mb.tokens.shape == (1, 8)
    assert not mb.loss_mask[0, 5:].any()


def test_balance_respects_budget_and_covers_every_sample():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(40, 200)
        bins = balance_into_micro_batches(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        for members in bins:
            assert len(members) == 1 or max(lengths[m] for m in members) * len(members) <= budget


def test_balance_min_micro_batches_splits():
    bins = balance_into_micro_batches([5] * 8, max_tokens=1000, min_micro_batches=4)
    assert len(bins) == 4 and sorted(i for b in bins for i in b) == list(range(8))


def test_split_over_ranks_balances_tokens():
    lengths = [10, 9, 8, 7, 3, 2, 1, 1]
    shares = split_over_ranks(lengths, list(range(8)), 2)
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert sorted(i for s in shares for i in s) == list(range(8))
    assert abs(loads[0] - loads[1]) <= 1


def test_pad_to_common_shape_adds_only_masked_rows_and_columns():
    samples = [_sample(3, 2), _sample(2, 6), _sample(4, 1)]
    mbs = [collate(samples, [0]), collate(samples, [1, 2])]
    padded = pad_to_common_shape(mbs)
    assert {tuple(mb.tokens.shape) for mb in padded} == {(2, 8)}
    for before, after in zip(mbs, padded):
        assert int(after.loss_mask.sum()) == int(before.loss_mask.sum())
        assert torch.equal(after.tokens[: before.tokens.shape[0], : before.tokens.shape[1]], before.tokens)


def test_pass_at_k_matches_enumeration():
    from itertools import combinations

    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                outcomes = [1] * c + [0] * (n - c)
                subsets = list(combinations(outcomes, k))
                expected = sum(1 for s in subsets if any(s)) / len(subsets)
                assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
