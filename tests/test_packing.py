"""Sequence packing: the packed layout against the padded one, the token-budget planner, the
per-sequence context-parallel split against megatron's THD RoPE, and the variable-length
attention against dense float64 attention (trainer/batches/batching.py, trainer/batches/micro_batches.py,
ops/varlen_attention.py, ops/context_parallel.py)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed
from megatron_grpo.trainer.batches.batching import PER_TOKEN_NAMES, TrainSample, collate, collate_packed
from megatron_grpo.trainer.batches.micro_batches import (MicroBatching, ParallelShape, pack_into_micro_batches, plan,
                                                         split_for_context_parallel_rank)

FP32_EPS = float(torch.finfo(torch.float32).eps)


def _samples(count: int, seed: int = 0, max_prompt: int = 12, max_response: int = 20) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        p, r = rng.randint(1, max_prompt), rng.randint(1, max_response)
        out.append(TrainSample(prompt_ids=[rng.randrange(1, 50) for _ in range(p)],
                               response_ids=[rng.randrange(1, 50) for _ in range(r)], advantage=rng.uniform(-1, 1),
                               rollout_logprobs=[-rng.random() for _ in range(r)],
                               old_logprobs=[-rng.random() for _ in range(r)],
                               ref_logprobs=[-rng.random() for _ in range(r)]))
        out[-1].behaviour_logprobs = [-rng.random() for _ in range(r)]  # drawn after: the others stay as they were
    return out


# ----- layout ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sequence_multiple,total_multiple,total_length", [(1, 1, None), (4, 8, None), (4, 8, 200)])
def test_packed_rows_equal_the_padded_rows(sequence_multiple, total_multiple, total_length):
    samples = _samples(7)
    indices = [0, 2, 3, 5, 6]
    padded = collate(samples, indices)
    packed = collate_packed(samples, indices, sequence_multiple, total_multiple, total_length)
    assert packed.tokens.shape[0] == 1 and packed.packed.total_length == packed.tokens.shape[1]
    assert packed.tokens.shape[1] % total_multiple == 0
    if total_length is not None:
        assert packed.tokens.shape[1] == total_length
    lengths = [samples[i].length for i in indices]
    assert packed.packed.cu_seqlens.tolist() == [sum(lengths[:k]) for k in range(len(lengths) + 1)]
    segments = torch.diff(packed.packed.cu_seqlens_padded).tolist()
    assert all(s % sequence_multiple == 0 and s >= n for s, n in zip(segments, lengths))
    width = padded.tokens.shape[1]
    for name in ("tokens", "targets", "loss_mask", "advantages"):
        rows = packed.rows(getattr(packed, name))
        assert torch.equal(rows[:, :width], getattr(padded, name)), name
        assert not rows[:, width:].bool().any(), name
    for name in PER_TOKEN_NAMES:
        assert torch.equal(packed.rows(packed.per_token[name])[:, :width], padded.per_token[name]), name
    # positions restart at every sequence (RoPE per sequence)
    rows = packed.rows(packed.position_ids)
    for r, length in enumerate(lengths):
        assert rows[r, :length].tolist() == list(range(length))
    assert torch.equal(packed.row_token_counts, padded.row_token_counts)
    assert packed.useful_tokens == sum(lengths) == padded.useful_tokens
    if total_length is None:
        assert packed.processed_tokens - packed.useful_tokens < padded.processed_tokens - padded.useful_tokens


def test_empty_packed_micro_batch_is_one_masked_segment():
    mb = collate_packed(_samples(1), [], sequence_multiple=4, total_multiple=8, total_length=16)
    assert mb.tokens.shape == (1, 16) and not mb.loss_mask.any()
    assert mb.packed.cu_seqlens.tolist() == [0, 0] and mb.packed.cu_seqlens_padded.tolist() == [0, 16]
    assert mb.row_token_counts.tolist() == [0] and mb.sample_indices == []


# ----- planning ----------------------------------------------------------------------------------
def test_pack_into_micro_batches_keeps_the_budget_and_balances_costs():
    rng = random.Random(1)
    for _ in range(200):
        tokens = [rng.randint(1, 60) for _ in range(rng.randint(1, 40))]
        costs = [t + 0.01 * t * t for t in tokens]
        budget = rng.randint(60, 400)
        bins = pack_into_micro_batches(tokens, costs, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(tokens)))
        assert all(sum(tokens[i] for i in b) <= budget for b in bins)
        assert len(bins) >= math.ceil(sum(tokens) / budget)
        # With room to spare (twice the bins the tokens need), the greedy assignment is balanced
        # to within the most expensive item (LPT's guarantee).
        count = 2 * math.ceil(sum(tokens) / budget)
        roomy = pack_into_micro_batches(tokens, costs, budget, min_micro_batches=count)
        loads = [sum(costs[i] for i in b) for b in roomy]
        assert len(roomy) >= count and max(loads) - min(loads) <= max(costs) + 1e-9


def test_pack_into_micro_batches_makes_empty_bins_when_asked_for_more_than_items():
    assert pack_into_micro_batches([5, 3], [5, 3], 100, min_micro_batches=4) == [[0], [1], [], []]


def _plan_all_ranks(samples, batching, **shape):
    dp = shape.get("dp_size", 1)
    return [plan(samples, batching, ParallelShape(dp_rank=r, **shape)) for r in range(dp)]


def _of_lengths(lengths):
    return [TrainSample(prompt_ids=[1] * (n // 2), response_ids=[2] * (n - n // 2), advantage=1.0) for n in lengths]


def test_plan_gives_every_pipeline_the_same_micro_batch_count_and_one_shape():
    # Lengths for which the two DP ranks' shares need 4 and 5 micro-batches of <= 100 tokens.
    samples = _of_lengths([60, 60, 10, 55, 95, 60, 60, 55, 60, 55])
    batching = MicroBatching(max_tokens=100, mini_batch_size=len(samples))
    unpiped = _plan_all_ranks(samples, batching, dp_size=2)
    assert sorted(len(p[0]) for p in unpiped) == [4, 5]  # the case the pipeline rule is for
    plans = _plan_all_ranks(samples, batching, dp_size=2, pp_size=2)
    assert [len(p[0]) for p in plans] == [5, 5]
    for rank_plan in plans:
        assert len({mb.tokens.shape for mb in rank_plan[0]}) == 1
    covered = sorted(i for p in plans for mb in p[0] for i in mb.sample_indices)
    assert covered == list(range(len(samples)))


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_plan_gives_every_expert_parallel_rank_the_same_micro_batch_count(packing):
    """EP > 1 at PP = 1: every rank of an EP group joins each forward's all-to-all, so the DP ranks
    run as many micro-batches as the one that needs most (each of its own shape)."""
    samples = _of_lengths([60, 60, 10, 55, 95, 60, 60, 55, 60, 55])
    batching = MicroBatching(packing=packing, max_tokens=100 if packing else 180, mini_batch_size=len(samples))
    unequal = _plan_all_ranks(samples, batching, dp_size=2)
    assert len({len(p[0]) for p in unequal}) == 2  # the case the rule is for
    plans = _plan_all_ranks(samples, batching, dp_size=2, ep_size=2)
    assert [len(p[0]) for p in plans] == [max(len(p[0]) for p in unequal)] * 2
    assert sorted(i for p in plans for mb in p[0] for i in mb.sample_indices) == list(range(len(samples)))
    assert all(mb.processed_tokens <= batching.max_tokens for p in plans for mb in p[0])


def test_plan_pads_only_to_kernel_multiples():
    samples = _samples(40, seed=3)
    batching = MicroBatching(max_tokens=128, mini_batch_size=20)
    for plan_ in _plan_all_ranks(samples, batching, dp_size=2):
        assert all(mb.processed_tokens == mb.useful_tokens for mbs in plan_ for mb in mbs)
    # CP=2 x TP=2 with sequence parallel: segments of 2*CP = 4, rows of lcm(4, CP*TP) = 4 per rank pair
    shape = dict(tp_size=2, sequence_parallel=True, cp_size=2)
    for mbs in plan(samples, batching, ParallelShape(**shape)):
        for mb in mbs:
            lengths = [samples[i].length for i in mb.sample_indices]
            need = sum(-(-n // 4) * 4 for n in lengths)
            assert mb.processed_tokens == -(-need // 4) * 4 <= 128
            assert mb.tokens.shape[1] * 2 == mb.processed_tokens and mb.tokens.shape[1] % 2 == 0


def test_passes_with_other_budgets_see_the_same_share_per_rank():
    samples = _samples(32, seed=4)
    shares = {}
    for budget in (64, 100, 1000):
        for rank, rank_plan in enumerate(_plan_all_ranks(samples, MicroBatching(max_tokens=budget, mini_batch_size=16,
                                                                                attention_weight=0.01), dp_size=2)):
            got = [sorted(i for mb in mbs for i in mb.sample_indices) for mbs in rank_plan]
            assert shares.setdefault(rank, got) == got


def test_attention_weight_balances_quadratic_cost_over_ranks():
    # Lengths 8, 8, 16, 8 over two ranks: by tokens {16, 8} | {8, 8} (24 | 16 tokens); with
    # the attention term (w = 0.1: 16 costs 41.6, 8 costs 14.4) {16} | {8, 8, 8} (41.6 | 43.2).
    samples = _of_lengths([8, 8, 16, 8])

    def shares(weight):
        batching = MicroBatching(max_tokens=512, mini_batch_size=4, attention_weight=weight)
        return sorted(sorted(samples[i].length for mb in p[0] for i in mb.sample_indices)
                      for p in _plan_all_ranks(samples, batching, dp_size=2))
    assert shares(0.0) == [[8, 8], [8, 16]]
    assert shares(0.1) == [[8, 8, 8], [16]]


# ----- context-parallel split vs megatron's THD RoPE ----------------------------------------------
class _Group:
    """What megatron's _apply_rotary_pos_emb_thd reads from its cp_group."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_per_sequence_cp_split_is_the_layout_megatron_thd_rope_assumes():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd, _apply_rotary_pos_emb_thd

    cp = 2
    samples = _samples(5, seed=5)
    mb = collate_packed(samples, list(range(5)), sequence_multiple=2 * cp, total_multiple=2 * cp)
    bounds = mb.packed.cu_seqlens_padded
    dim = 8
    freqs = torch.randn(int(torch.diff(bounds).max()) * cp, 1, 1, dim)
    x = torch.randn(mb.packed.total_length, 3, dim)
    # Reference: RoPE over each sequence's own positions 0..len-1, in the full packed row.
    expected = torch.cat([_apply_rotary_pos_emb_bshd(x[a:b].unsqueeze(1), freqs[: b - a]).squeeze(1)
                          for a, b in zip(bounds.tolist(), bounds.tolist()[1:])])
    for rank in range(cp):
        local = split_for_context_parallel_rank(mb, rank, cp)
        assert local.packed.cp_size == cp
        from megatron_grpo.ops.context_parallel import split_packed_for_context_parallel

        x_local = split_packed_for_context_parallel(x, bounds, rank, cp, seq_dim=0)
        got = _apply_rotary_pos_emb_thd(x_local, bounds, freqs, cp_group=_Group(rank, cp))
        assert torch.equal(got, split_packed_for_context_parallel(expected, bounds, rank, cp, seq_dim=0))
        # and the position ids the rank holds are the sequence positions RoPE used
        rows = local.rows(local.position_ids)
        full = mb.rows(mb.position_ids)
        for r in range(5):
            seg = int(bounds[r + 1] - bounds[r])
            chunk = seg // (2 * cp)
            want = list(range(rank * chunk, (rank + 1) * chunk)) + list(range((2 * cp - 1 - rank) * chunk,
                                                                              (2 * cp - rank) * chunk))
            assert rows[r, : seg // cp].tolist() == full[r, want].tolist() == want


# ----- attention vs dense float64 -----------------------------------------------------------------
def _dense_reference(q, k, v, cu, cu_padded, scale):
    """float64 attention over the full packed row with a block-diagonal causal mask; zeros on padding."""
    q, k, v = q.double(), k.double(), v.double()
    heads, groups = q.size(1), k.size(1)
    k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
    total = q.size(0)
    seq = torch.full((total,), -1)
    pos = torch.zeros(total, dtype=torch.long)
    for i, (a, n) in enumerate(zip(cu_padded[:-1], torch.diff(cu))):
        seq[a:a + n] = i
        pos[a:a + n] = torch.arange(int(n))
    allowed = (seq[:, None] == seq[None, :]) & (seq[:, None] >= 0) & (pos[None, :] <= pos[:, None])
    padding = seq < 0
    allowed |= torch.diag(padding)  # a padding query sees itself only (its output is dropped below)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return torch.where(padding[:, None, None], 0.0, out)


def _packed_inputs(seed=0, cp=1):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 7, 30, 2, 13, 28, 27, 12]  # 30, 28, 27 and 13, 12 share batched attention groups
    segments = [-(-n // (2 * cp)) * 2 * cp if cp > 1 else n + (i % 2) for i, n in enumerate(lengths)]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    cu_padded = torch.tensor([0] + list(torch.tensor(segments).cumsum(0)), dtype=torch.int32)
    total = int(cu_padded[-1])
    q = torch.randn(total, 4, 8, generator=g)
    k = torch.randn(total, 2, 8, generator=g)
    v = torch.randn(total, 2, 8, generator=g)
    upstream = torch.zeros(total, 4, 8)
    real = _real_positions(cu, cu_padded)
    upstream[real] = torch.randn(len(real), 4, 8, generator=g)  # the loss never reads padding
    return q, k, v, upstream, cu, cu_padded


def _params(cu, cu_padded):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=64, max_seqlen_kv=64)


def _real_positions(cu, cu_padded):
    return torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(cu_padded[:-1], torch.diff(cu))])


def _check_close(got, want, what, size):
    # fp32 softmax attention: rounding of a dot product of `size` terms and a softmax over it
    tol = 16 * FP32_EPS * math.sqrt(size)
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.2e}"


def test_packed_attention_equals_dense_float64_attention():
    from megatron_grpo.ops.varlen_attention import length_buckets, packed_causal_attention

    q, k, v, upstream, cu, cu_padded = _packed_inputs()
    assert length_buckets(torch.diff(cu).tolist()) == [[2, 5, 6], [4, 7], [1], [3], [0]]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = packed_causal_attention(*leaves, _params(cu, cu_padded), scale=8 ** -0.5)
    (out * upstream).sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _dense_reference(*ref_leaves, cu, cu_padded, 8 ** -0.5)
    (ref * upstream.double()).sum().backward()
    real = _real_positions(cu, cu_padded)
    assert not out.detach()[torch.isin(torch.arange(q.size(0)), real, invert=True)].any()  # padding -> 0
    _check_close(out.detach()[real], ref.detach()[real], "output", 30)
    for name, a, b in zip("qkv", leaves, ref_leaves):
        _check_close(a.grad, b.grad, f"d{name}", 30)


def _cp_attention(rank, world_size, q, k, v, upstream, cu, cu_padded):
    import torch.distributed as dist

    from megatron_grpo.ops.context_parallel import split_packed_for_context_parallel
    from megatron_grpo.ops.varlen_attention import context_parallel_packed_attention

    group = dist.new_group(list(range(world_size)))
    local = [split_packed_for_context_parallel(t, cu_padded, rank, world_size, seq_dim=0).clone().requires_grad_()
             for t in (q, k, v)]
    out = context_parallel_packed_attention(*local, _params(cu, cu_padded), 8 ** -0.5, group)
    (out * split_packed_for_context_parallel(upstream, cu_padded, rank, world_size, seq_dim=0)).sum().backward()
    return out.detach(), [t.grad for t in local]


def test_context_parallel_packed_attention_equals_dense_float64_attention():
    from megatron_grpo.ops.context_parallel import split_packed_for_context_parallel

    cp = 2
    q, k, v, upstream, cu, cu_padded = _packed_inputs(seed=1, cp=cp)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _dense_reference(*ref_leaves, cu, cu_padded, 8 ** -0.5)
    (ref * upstream.double()).sum().backward()
    real = set(_real_positions(cu, cu_padded).tolist())
    results = run_distributed(_cp_attention, cp, args=(q, k, v, upstream, cu, cu_padded), timeout=120)
    for rank, (out, grads) in enumerate(results):
        held = split_packed_for_context_parallel(torch.arange(q.size(0)), cu_padded, rank, cp, seq_dim=0)
        keep = torch.tensor([int(p) in real for p in held])  # padding queries' outputs are unused
        _check_close(out[keep], ref.detach()[held][keep], f"rank {rank} output", 30)
        for name, grad, full in zip("qkv", grads, ref_leaves):
            _check_close(grad, full.grad[held], f"rank {rank} d{name}", 30)


# ----- config -------------------------------------------------------------------------------------
def test_packing_is_the_default_and_pass_budgets_are_their_own():
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.errors import ConfigError

    cfg = load_config("tiny_cpu", ["actor.logprob_max_tokens_per_micro_batch=5000",
                                   "ref.max_tokens_per_micro_batch=7000"])
    assert cfg.actor.packing is True
    assert MicroBatching.from_config(cfg).max_tokens == cfg.actor.max_tokens_per_micro_batch
    assert MicroBatching.from_config(cfg, "old_logprobs").max_tokens == 5000
    assert MicroBatching.from_config(cfg, "ref_logprobs").max_tokens == 7000
    assert (MicroBatching.from_config(load_config("tiny_cpu"), "ref_logprobs").max_tokens
            == cfg.actor.max_tokens_per_micro_batch)
    with pytest.raises(ConfigError, match=r"actor\.logprob_max_tokens_per_micro_batch=10 is below the longest"):
        validate(load_config("tiny_cpu", ["actor.logprob_max_tokens_per_micro_batch=10"]), world_size=1)


def test_rope_table_never_takes_megatrons_whole_pack_position_mode():
    # Two sequences of 8 under CP=2: megatron's RoPE table (max_seqlen x CP = 16 rows) would equal
    # the pack's 16 tokens, which its unfused THD RoPE reads as "positions run across the pack".
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd, _apply_rotary_pos_emb_thd

    from megatron_grpo.ops.context_parallel import split_packed_for_context_parallel

    cp = 2
    samples = _of_lengths([8, 8])
    mb = collate_packed(samples, [0, 1], sequence_multiple=2 * cp, total_multiple=2 * cp)
    params = mb.packed.packed_seq_params(context_parallel_size=cp)
    rows = max(params.max_seqlen_q, params.max_seqlen_kv) * cp  # RotaryEmbedding.get_rotary_seq_len
    assert rows != mb.packed.total_length
    freqs = torch.randn(rows, 1, 1, 4)
    x = torch.randn(16, 2, 4)
    expected = torch.cat([_apply_rotary_pos_emb_bshd(x[a:a + 8].unsqueeze(1), freqs[:8]).squeeze(1) for a in (0, 8)])
    bounds = params.cu_seqlens_q_padded
    for rank in range(cp):
        got = _apply_rotary_pos_emb_thd(split_packed_for_context_parallel(x, bounds, rank, cp, seq_dim=0), bounds,
                                        freqs, cp_group=_Group(rank, cp))
        assert torch.equal(got, split_packed_for_context_parallel(expected, bounds, rank, cp, seq_dim=0))
