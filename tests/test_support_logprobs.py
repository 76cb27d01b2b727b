"""ops.support_logprobs and the fused head's support variant equal dense torch on the truncated
distribution.

The reference is, in float64 from the same logits, log_softmax over each token's support (the
other columns set to -inf) at the target, its entropy, both zeroed at ignored positions, and the
autograd gradient of a random upstream combination; ours must be within the rounding of their
dtype (megatron_grpo.testing.floats), and logits outside the support must get exactly 0. The
vocabulary (300) is padded to 512 columns, so at TP=4 rank 2 holds 44 real columns and rank 3
only padding; supports have 1..K ids in random slots, -1 elsewhere. TP=2 and TP=4 run in ONE
spawn of 4 gloo processes (two TP=2 subgroups, one TP=4 group).
"""
from __future__ import annotations

import weakref
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_grpo.ops.fused_head import fused_head_support_logprobs, fused_head_support_logprobs_and_entropy
from megatron_grpo.ops.support_logprobs import (vocab_parallel_support_logprobs,
                                                vocab_parallel_support_logprobs_and_entropy)
from megatron_grpo.ops.vocab_parallel import vocab_parallel_logprobs_and_entropy
from megatron_grpo.testing.distributed import run_distributed
from megatron_grpo.testing.floats import assert_close_to_float64, tolerance

# The log-prob kernels' results can change with torch (tests/conftest.py's `versions`).

VOCAB, PADDED, HIDDEN, SHAPE = 300, 512, 24, (3, 7)
TOKENS = SHAPE[0] * SHAPE[1]

# (seed, dtype, temperature, chunk_size, K, support dtype); 21 tokens, so chunk sizes 4 and 5 do
# not divide T and chunk 1 is one token at a time; int32 ids are what the trainer's batches hold.
CASES = [(0, torch.float32, 1.0, 4, 24, torch.int64), (1, torch.float32, 0.7, 1, 9, torch.int32),
         (2, torch.float32, 1.3, None, 40, torch.int64), (3, torch.bfloat16, 0.7, 5, 24, torch.int32),
         (4, torch.bfloat16, 1.0, 64, 16, torch.int64)]


def make_supports(targets: torch.Tensor, ignored: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """[*shape, k] supports: 1..k distinct ids holding the target in random slots, -1 elsewhere.
    Position 4 holds one id (no other rank has mass), position 5 ids of rank 0's TP=4 shard only;
    ignored positions are empty or hold garbage (never checked)."""
    flat_targets, flat_ignored = targets.reshape(-1), ignored.reshape(-1)
    support = torch.full((flat_targets.numel(), k), -1, dtype=torch.int64)
    for pos, target in enumerate(flat_targets.tolist()):
        if flat_ignored[pos]:
            if pos % 2:
                support[pos, :min(k, 3)] = torch.tensor([VOCAB + 7, 5, 5])[:k]  # out of range, repeated
            continue
        size = 1 if pos == 4 else int(torch.randint(1, k + 1, (1,), generator=gen))
        pool = torch.arange(128) if pos == 5 else torch.arange(VOCAB)
        others = pool[pool != target][torch.randperm(len(pool) - 1, generator=gen)[: size - 1]]
        slots = torch.randperm(k, generator=gen)[:size]
        support[pos, slots] = torch.cat([torch.tensor([target]), others])
    return support.view(*targets.shape, k)


def make_case(seed: int, dtype: torch.dtype, k: int):
    """Logits [*SHAPE, PADDED] (large garbage in the padded columns), targets with -100 and a mask."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*SHAPE, PADDED, generator=gen) * 2).to(dtype)
    logits[..., VOCAB:] = 50.0  # padding: large on purpose, it must carry no probability
    targets = torch.randint(0, VOCAB, SHAPE, generator=gen)
    targets.view(-1)[:2] = -100  # "prompt" positions
    targets.view(-1)[5] = int(torch.randint(0, 128, (1,), generator=gen))
    targets.view(-1)[-1] = VOCAB - 1  # the last real column, next to the padding
    mask = torch.zeros(SHAPE, dtype=torch.bool)
    mask.view(-1)[3] = True  # ignored through the mask, with a valid-looking target
    support = make_supports(targets, mask | (targets == -100), k, gen)
    upstream = (torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen))
    return logits, targets, support, mask, upstream


def support_mask(support: torch.Tensor, ignored: torch.Tensor) -> torch.Tensor:
    """Bool [..., PADDED]: True at each kept position's support columns."""
    flat = support.reshape(-1, support.shape[-1])
    mask = torch.zeros(flat.shape[0], PADDED, dtype=torch.bool)
    for pos in (~ignored.reshape(-1)).nonzero().squeeze(1).tolist():
        ids = flat[pos][flat[pos] >= 0]
        mask[pos, ids] = True
    return mask.view(*support.shape[:-1], PADDED)


def truncated_reference(z: torch.Tensor, targets, support, mask, upstream):
    """(logp, entropy) of the truncated distribution of float64 logits z / T, zeroed where ignored,
    and the upstream combination sum(g_lp * logp + g_H * entropy)."""
    ignored = mask | (targets == -100)
    in_support = support_mask(support, ignored) | ignored.unsqueeze(-1)  # ignored rows: finite, then zeroed
    logsm = torch.log_softmax(z.masked_fill(~in_support, float("-inf")), dim=-1)
    logp = logsm.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
    plogp = logsm.exp() * logsm.masked_fill(~in_support, 0.0)
    entropy = -plogp.sum(-1).masked_fill(ignored, 0.0)
    g_lp, g_h = (u.double() for u in upstream)
    return logp, entropy, logp * g_lp + entropy * g_h


def dense_reference(logits, targets, support, mask, upstream, temperature):
    """Values and the gradients wrt the full (padded) logits of both upstream combinations, in float64."""
    x = logits.detach().double().requires_grad_()
    logp, entropy, both = truncated_reference(x / temperature, targets, support, mask, upstream)
    grad_both, = torch.autograd.grad(both.sum(), x, retain_graph=True)
    grad_lp, = torch.autograd.grad((logp * upstream[0].double()).sum(), x)
    return logp.detach(), entropy.detach(), grad_both, grad_lp


def ours(logits_shard, targets, support, mask, upstream, temperature, chunk_size, tp_group=None):
    """Our values and gradients wrt the shard, for both entry points."""
    x = logits_shard.detach().clone().requires_grad_()
    kwargs = dict(temperature=temperature, vocab_size=VOCAB, ignore_mask=mask, chunk_size=chunk_size,
                  tp_group=tp_group)
    logp, entropy = vocab_parallel_support_logprobs_and_entropy(x, targets, support, **kwargs)
    g_lp, g_h = upstream
    grad_both, = torch.autograd.grad((logp * g_lp + entropy * g_h).sum(), x)
    x2 = logits_shard.detach().clone().requires_grad_()
    logp_only = vocab_parallel_support_logprobs(x2, targets, support, **kwargs)
    grad_lp, = torch.autograd.grad((logp_only * g_lp).sum(), x2)
    return logp.detach(), entropy.detach(), grad_both, logp_only.detach(), grad_lp


def compare_case(seed, dtype, temperature, chunk_size, k, id_dtype, tp_rank=0, tp=1, tp_group=None):
    """{name: (ours, float64 reference)} on this rank's shard; asserts the exact zeros here."""
    logits, targets, support, mask, upstream = make_case(seed, dtype, k)
    ref_lp, ref_h, ref_g_both, ref_g_lp = dense_reference(logits, targets, support, mask, upstream, temperature)
    cols = slice(tp_rank * PADDED // tp, (tp_rank + 1) * PADDED // tp)
    lp, h, g_both, lp_only, g_lp = ours(logits[..., cols], targets, support.to(id_dtype), mask, upstream,
                                        temperature, chunk_size, tp_group)
    assert lp.dtype == h.dtype == lp_only.dtype == torch.float32  # fp32 whatever the logits dtype
    assert g_both.dtype == g_lp.dtype == dtype  # gradients in the logits' dtype
    outside = ~support_mask(support, mask | (targets == -100))[..., cols]
    for name, grad in (("g_both", g_both), ("g_lp", g_lp)):
        assert (grad[outside] == 0).all(), f"case {seed}: {name} is not exactly 0 outside the support"
    assert (lp[mask] == 0).all() and (h[mask] == 0).all() and (lp[targets == -100] == 0).all()
    return dict(lp=(lp, ref_lp), h=(h, ref_h), lp_only=(lp_only, ref_lp),
                g_both=(g_both, ref_g_both[..., cols]), g_lp=(g_lp, ref_g_lp[..., cols]))


def portable(pairs):
    """Tensors -> numpy (ours as fp32, the reference float64), to cross process boundaries by value."""
    return {name: (ours_.detach().float().numpy(), ref.numpy()) for name, (ours_, ref) in pairs.items()}


def assert_pairs(pairs, dtype, k, where=""):
    """fp32 results: roundings of sums over the support (k terms); a bf16 gradient: that fp32 value
    rounded once to bf16."""
    for name, (actual, expected) in pairs.items():
        actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
        if name.startswith("g_") and dtype == torch.bfloat16:
            assert_close_to_float64(actual, expected, dtype=dtype, terms=1, name=f"{where} {name}")
        else:
            assert_close_to_float64(actual, expected, dtype=torch.float32, terms=k, name=f"{where} {name}")


@pytest.mark.parametrize("seed,dtype,temperature,chunk_size,k,id_dtype", CASES)
def test_tp1_matches_dense_truncated_distribution(seed, dtype, temperature, chunk_size, k, id_dtype):
    assert_pairs(compare_case(seed, dtype, temperature, chunk_size, k, id_dtype), dtype, k, f"case {seed}")


def test_full_support_equals_the_full_vocabulary_op():
    """Every id in the support (in a different order per row) is softmax over the vocabulary:
    both ops are within fp32 rounding of each other (each within its bound of float64)."""
    logits, targets, _, mask, (g_lp, g_h) = make_case(8, torch.float32, 1)
    gen = torch.Generator().manual_seed(8)
    support = torch.stack([torch.randperm(VOCAB, generator=gen) for _ in range(TOKENS)]).view(*SHAPE, VOCAB)
    results = []
    for fn, args in ((vocab_parallel_support_logprobs_and_entropy, (support,)),
                     (vocab_parallel_logprobs_and_entropy, ())):
        x = logits.clone().requires_grad_()
        logp, entropy = fn(x, targets, *args, temperature=0.8, vocab_size=VOCAB, ignore_mask=mask, chunk_size=5)
        grad, = torch.autograd.grad((logp * g_lp + entropy * g_h).sum(), x)
        results.append((logp.detach(), entropy.detach(), grad))
    for name, a, b in zip(("logp", "entropy", "grad"), *results):
        allowed = 2 * tolerance(torch.float32, VOCAB) * float(b.abs().max())
        assert float((a - b).abs().max()) <= allowed, name


def test_bad_supports_raise_one_line_errors():
    logits = torch.randn(4, 16)
    targets = torch.tensor([0, 1, 2, 3])
    good = torch.tensor([[0, 5, -1], [1, -1, -1], [2, 3, 4], [3, -1, 7]])

    def error(support, **kwargs):
        with pytest.raises(ValueError) as caught:
            vocab_parallel_support_logprobs(logits, targets, support, vocab_size=10, **kwargs)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    bad = good.clone()
    bad[2] = torch.tensor([4, 5, 6])
    assert "target 2 at flat position 2 is not in its sampling support" in error(bad)
    bad = good.clone()
    bad[1] = -1
    assert "flat position 1 (target 1) is empty" in error(bad)
    bad = good.clone()
    bad[3, 2] = 12  # in the 16 columns, outside the true vocabulary of 10
    assert "holds token 12, outside the vocabulary [0, 10)" in error(bad)
    bad = good.clone()
    bad[0, 2] = 5
    assert "flat position 0 lists token 5 twice" in error(bad)
    assert "must be targets (4,) + [K]" in error(good[:3])
    assert "int32 or int64 token ids" in error(good.float())
    # every one of those is fine at an ignored position, and a 0-wide support when all are ignored
    bad = good.clone()
    bad[2] = torch.tensor([5, 5, 99])
    vocab_parallel_support_logprobs(logits, targets, bad, vocab_size=10,
                                    ignore_mask=torch.tensor([False, False, True, False]))
    out = vocab_parallel_support_logprobs(logits, torch.full((4,), -100), torch.empty(4, 0, dtype=torch.long))
    assert (out == 0).all()


def _values_and_grad(logits, targets, support, mask, upstream, chunk_size):
    x = logits.clone().requires_grad_()
    logp, entropy = vocab_parallel_support_logprobs_and_entropy(x, targets, support, temperature=0.7,
                                                                vocab_size=VOCAB, ignore_mask=mask,
                                                                chunk_size=chunk_size)
    grad, = torch.autograd.grad((logp * upstream[0] + entropy * upstream[1]).sum(), x)
    return logp.detach(), entropy.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_size_and_batch_invariance_bitwise(dtype):
    """A token's log-prob, entropy and gradient have the same bits whatever the chunk size, the
    other rows of the batch and the batch's K (more -1 padding after its ids)."""
    logits, targets, support, mask, upstream = make_case(5, dtype, 24)
    # the trainer's layout: each row's ids first, then the -1 padding (sort puts -1 last)
    support = support.sort(dim=-1, descending=True).values
    flat = [t.reshape(TOKENS, *t.shape[2:]) for t in (logits, targets, support, mask, *upstream)]
    full = _values_and_grad(*flat[:4], flat[4:], None)
    for chunk_size in (1, 4, 7, TOKENS):
        for a, b in zip(full, _values_and_grad(*flat[:4], flat[4:], chunk_size)):
            assert torch.equal(a, b), f"chunk_size={chunk_size}"
    # rows 6..13 alone, in reverse, next to 5 unrelated rows, with the support padded to K = 70
    other_logits, other_targets, other_support, other_mask, other_up = make_case(6, dtype, 40)
    rows = torch.arange(13, 5, -1)
    padded = torch.cat([flat[2], torch.full((TOKENS, 46), -1)], dim=1)
    batch = [torch.cat([a[rows], b.reshape(TOKENS, *b.shape[2:])[:5]])
             for a, b in zip([flat[0], flat[1], padded, flat[3], *flat[4:]],
                             [other_logits, other_targets,
                              torch.cat([other_support, torch.full((*SHAPE, 30), -1)], -1), other_mask,
                              *other_up])]
    mixed = _values_and_grad(*batch[:4], batch[4:], 3)
    for name, a, b in zip(("logp", "entropy", "grad"), full, mixed):
        assert torch.equal(a[rows], b[: len(rows)]), name


class _MemoryProbe(TorchDispatchMode):
    """The largest fp32 tensor any op produces, and the peak of the bytes held by the storages the
    ops allocate (a storage counts from its first output until it is freed; `inputs` are not counted)."""

    def __init__(self, inputs: list[torch.Tensor]):
        super().__init__()
        self.largest_fp32 = 0
        self.peak = self._held = 0
        self._sizes: dict[int, int] = {}
        self._inputs = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                if t.dtype == torch.float32:
                    self.largest_fp32 = max(self.largest_fp32, t.numel())
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = storage.data_ptr()
        if not key or key in self._inputs or key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self._held += storage.nbytes()
        self.peak = max(self.peak, self._held)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self._held -= self._sizes.pop(key, 0)


def test_memory_is_chunk_by_support():
    """The module docstring's bound: with bf16 logits and int32 ids, forward and backward create no
    fp32 tensor bigger than [chunk, K] (never a [chunk, V/tp] one) and hold at most ~22 B per
    (chunk row, support slot) at once, besides the logit gradient (the logits' dtype)."""
    tokens, vocab, k, chunk = 256, 4000, 128, 64
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=gen).to(torch.bfloat16).requires_grad_()
    support = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(tokens)]).int()
    targets = support[:, 3].long()
    with _MemoryProbe([logits, support, targets]) as forward:
        logp, entropy = vocab_parallel_support_logprobs_and_entropy(logits, targets, support, chunk_size=chunk)
    with _MemoryProbe([logits, support, targets, logp, entropy]) as backward:
        (logp.sum() + entropy.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    for name, probe, besides in (("forward", forward, 0), ("backward", backward, logits.grad.nbytes)):
        assert 0 < probe.largest_fp32 <= chunk * k, (name, probe.largest_fp32)
        per_slot = (probe.peak - besides) / (chunk * k)
        assert 0 < per_slot <= 24, f"{name}: {per_slot:.1f} B per (row, support slot)"


# The fused head: logits = hidden @ weight.T, then the same statistics. fp32 roundings accumulate
# through H-term dot products, K-term sums over the support and T-term sums into grad_weight; in
# bf16 the three bf16 results on the way to a gradient (logits, their gradient, grad hidden / weight).
FUSED_CASES = [(0, torch.float32, 1.0, 4), (1, torch.float32, 0.7, None), (2, torch.bfloat16, 0.8, 5)]
FUSED_K = 24
FUSED_TERMS = {torch.float32: HIDDEN + FUSED_K + TOKENS, torch.bfloat16: 3}


def fused_case(seed, dtype, temperature, chunk_size, tp_rank=0, tp=1, tp_group=None):
    gen = torch.Generator().manual_seed(100 + seed)
    _, targets, support, mask, upstream = make_case(seed, torch.float32, FUSED_K)
    hidden = torch.randn(*SHAPE, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(PADDED, HIDDEN, generator=gen) / HIDDEN ** 0.5 * 2).to(dtype)
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_h, both = truncated_reference((h @ w.t()) / temperature, targets, support, mask, upstream)
    ref_gh, ref_gw = torch.autograd.grad(both.sum(), (h, w))
    cols = slice(tp_rank * PADDED // tp, (tp_rank + 1) * PADDED // tp)
    h, w = hidden.clone().requires_grad_(), weight[cols].clone().requires_grad_()
    logp, entropy = fused_head_support_logprobs_and_entropy(h, w, targets, support, temperature=temperature,
                                                            vocab_size=VOCAB, ignore_mask=mask,
                                                            chunk_size=chunk_size, tp_group=tp_group)
    grad_h, grad_w = torch.autograd.grad((logp * upstream[0] + entropy * upstream[1]).sum(), (h, w))
    assert logp.dtype == entropy.dtype == torch.float32 and grad_h.dtype == grad_w.dtype == dtype
    outside = ~support_mask(support, mask | (targets == -100)).reshape(TOKENS, PADDED)[:, cols].any(0)
    assert (grad_w[outside] == 0).all(), "weight rows no kept token has in its support get exactly 0"
    pairs = dict(logp=(logp, ref_lp.detach()), entropy=(entropy, ref_h.detach()), grad_hidden=(grad_h, ref_gh),
                 grad_weight=(grad_w, ref_gw[cols]))
    return portable(pairs)


def assert_fused(pairs, dtype, where):
    for name, (actual, expected) in pairs.items():
        assert_close_to_float64(torch.as_tensor(actual), torch.as_tensor(expected), dtype=dtype,
                                terms=FUSED_TERMS[dtype], name=f"{where} {name}")


@pytest.mark.parametrize("seed,dtype,temperature,chunk_size", FUSED_CASES)
def test_fused_head_support_matches_dense(seed, dtype, temperature, chunk_size):
    assert_fused(fused_case(seed, dtype, temperature, chunk_size), dtype, f"fused case {seed}")


def test_fused_head_support_logprobs_only_and_frozen_weight():
    """Against the logits op on the materialised logits; no weight gradient when it is frozen."""
    _, targets, support, mask, (g_lp, _) = make_case(3, torch.float32, FUSED_K)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(*SHAPE, HIDDEN, generator=gen, requires_grad=True)
    weight = torch.randn(PADDED, HIDDEN, generator=gen) / HIDDEN ** 0.5
    logp = fused_head_support_logprobs(hidden, weight, targets, support, vocab_size=VOCAB, ignore_mask=mask,
                                       chunk_size=4)
    (logp * g_lp).sum().backward()
    logits = (hidden.detach() @ weight.t()).requires_grad_()
    expected = vocab_parallel_support_logprobs(logits, targets, support, vocab_size=VOCAB, ignore_mask=mask)
    (expected * g_lp).sum().backward()
    assert torch.allclose(logp, expected, rtol=0, atol=1e-5)
    assert torch.allclose(hidden.grad, logits.grad @ weight, rtol=0, atol=1e-5)
    assert weight.grad is None
    with pytest.raises(ValueError, match="not in its sampling support"):
        fused_head_support_logprobs(hidden, weight, targets, support.roll(1, dims=0), vocab_size=VOCAB,
                                    ignore_mask=mask)


def _tp_worker(rank, world_size):
    """TP=2 in two subgroups ({0, 1}, {2, 3}), then TP=4; every case on this rank's shard, plus,
    at each TP size, one MAX and one SUM all_reduce per forward however many chunks (none in the
    backward) and chunk-size invariance (bitwise)."""
    import torch.distributed as dist

    pair_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    groups = {2: pair_groups[rank // 2], 4: dist.new_group(list(range(world_size)))}
    results = []
    for tp, group in groups.items():
        tp_rank = dist.get_rank(group)
        for seed, dtype, temperature, chunk_size, k, id_dtype in CASES:
            pairs = compare_case(seed, dtype, temperature, chunk_size, k, id_dtype, tp_rank, tp, group)
            results.append(("support", tp, seed, dtype, k, portable(pairs)))
        for seed, dtype, temperature, chunk_size in FUSED_CASES:
            results.append(("fused", tp, seed, dtype, FUSED_K,
                            fused_case(seed, dtype, temperature, chunk_size, tp_rank, tp, group)))
        logits, targets, support, mask, upstream = make_case(7, torch.float32, 24)
        shard = logits[..., tp_rank * PADDED // tp:(tp_rank + 1) * PADDED // tp]
        with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as spy:
            a = ours(shard, targets, support, mask, upstream, 0.9, 1, group)  # 21 chunks, both entry points
        ops = [call.kwargs["op"] for call in spy.call_args_list]
        assert ops == [dist.ReduceOp.MAX, dist.ReduceOp.SUM] * 2, f"TP={tp}: {ops}"  # forwards only
        b = ours(shard, targets, support, mask, upstream, 0.9, None, group)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"TP={tp}: results depend on the chunk size"
    return results


@pytest.mark.slow
def test_tensor_parallel_matches_dense():
    """TP=2 and TP=4 in one spawn of 4 processes (each spawn costs seconds of imports)."""
    for rank, results in enumerate(run_distributed(_tp_worker, world_size=4, timeout=180)):
        for kind, tp, seed, dtype, k, pairs in results:
            where = f"TP={tp} rank {rank} {kind} case {seed}"
            if kind == "support":
                assert_pairs(pairs, dtype, k, where)
            else:
                assert_fused(pairs, dtype, where)
