"""ops.vocab_parallel: log-probs, entropy and their gradients equal dense torch on the gathered logits.

The dense reference is log_softmax(logits[..., :vocab] / T) in float64 (from the same logits),
gathered at the targets, entropy -sum p log p, both zeroed at ignored positions, differentiated by
autograd; ours must be within the rounding of their dtype (megatron_grpo.testing.floats). TP=2 and
4 run in gloo processes with megatron initialised; every rank holds one vocab shard of the same
logits.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_grpo.ops.vocab_parallel import (default_chunk_size, vocab_parallel_logprobs,
                                              vocab_parallel_logprobs_and_entropy)
from megatron_grpo.testing.distributed import run_distributed
from megatron_grpo.testing.floats import assert_close_to_float64

VOCAB = 300
# Roundings that accumulate into each value: log-probs, entropy and fp32 gradients come from fp32
# sums over the vocabulary; a bf16 gradient is that fp32 value rounded once to bf16.
VALUE_TERMS, BF16_GRAD_TERMS = VOCAB, 1


def make_case(seed: int, shape=(3, 7), vocab=300, padded=512, dtype=torch.float32):
    """Logits [*shape, padded] (garbage in the padded columns), targets with -100 and a mask."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, padded, generator=gen) * 2).to(dtype)
    logits[..., vocab:] = 50.0  # padded columns: large on purpose, they must carry no probability
    targets = torch.randint(0, vocab, shape, generator=gen)
    targets.view(-1)[:2] = -100  # "prompt" positions
    targets.view(-1)[-1] = vocab - 1  # the last real column, near the padding
    mask = torch.zeros(shape, dtype=torch.bool)
    mask.view(-1)[3] = True  # padding position given by mask, with a valid-looking target
    upstream = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    return logits, targets, mask, upstream


def dense_reference(logits, targets, mask, upstream, vocab, temperature):
    """Values and the gradient wrt the full (padded) logits of sum(g_lp*logp + g_H*entropy), in
    float64 from the same logits."""
    x = logits.detach().double().requires_grad_()
    upstream = tuple(u.double() for u in upstream)
    logsm = torch.log_softmax(x[..., :vocab] / temperature, dim=-1)
    ignored = mask | (targets == -100)
    logp = logsm.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
    entropy = -(logsm.exp() * logsm).sum(-1).masked_fill(ignored, 0.0)
    g_lp, g_h = upstream
    grad_both, = torch.autograd.grad((logp * g_lp + entropy * g_h).sum(), x, retain_graph=True)
    grad_lp, = torch.autograd.grad((logp * g_lp).sum(), x)
    return logp.detach(), entropy.detach(), grad_both, grad_lp


def ours(logits_shard, targets, mask, upstream, vocab, temperature, chunk_size, tp_group=None):
    """Our values and gradients wrt the shard, for both entry points."""
    x = logits_shard.detach().clone().requires_grad_()
    logp, entropy = vocab_parallel_logprobs_and_entropy(x, targets, temperature=temperature, vocab_size=vocab,
                                                        ignore_mask=mask, chunk_size=chunk_size, tp_group=tp_group)
    g_lp, g_h = upstream
    grad_both, = torch.autograd.grad((logp * g_lp + entropy * g_h).sum(), x)
    x2 = logits_shard.detach().clone().requires_grad_()
    logp_only = vocab_parallel_logprobs(x2, targets, temperature=temperature, vocab_size=vocab, ignore_mask=mask,
                                        chunk_size=chunk_size, tp_group=tp_group)
    grad_lp, = torch.autograd.grad((logp_only * g_lp).sum(), x2)
    return logp.detach(), entropy.detach(), grad_both, logp_only.detach(), grad_lp


# (seed, dtype, temperature, chunk_size) cases shared by the single- and multi-process tests;
# 21 tokens, so chunk sizes 4 and 5 do not divide T, chunk 1 is one token at a time.
CASES = [(0, torch.float32, 1.0, 4), (1, torch.float32, 0.7, 5), (2, torch.float32, 1.3, 1),
         (3, torch.float32, 0.6, None), (4, torch.bfloat16, 0.7, 4), (5, torch.bfloat16, 1.0, 64)]


def compare_case(seed, dtype, temperature, chunk_size, tp_rank=0, tp=1, tp_group=None):
    """Returns the max errors of one case on this rank's shard (asserting happens in the caller)."""
    vocab, padded = 300, 512
    logits, targets, mask, upstream = make_case(seed, dtype=dtype, vocab=vocab, padded=padded)
    ref_lp, ref_h, ref_g_both, ref_g_lp = dense_reference(logits, targets, mask, upstream, vocab, temperature)
    width = padded // tp
    cols = slice(tp_rank * width, (tp_rank + 1) * width)
    lp, h, g_both, lp_only, g_lp = ours(logits[..., cols], targets, mask, upstream, vocab, temperature, chunk_size,
                                        tp_group)
    assert lp.dtype == h.dtype == lp_only.dtype == torch.float32  # fp32 whatever the logits dtype
    assert g_both.dtype == g_lp.dtype == dtype  # gradients in the logits' dtype
    return dict(lp=(lp, ref_lp), h=(h, ref_h), lp_only=(lp_only, ref_lp),
                g_both=(g_both, ref_g_both[..., cols]), g_lp=(g_lp, ref_g_lp[..., cols]))


def portable(pairs):
    """Tensors -> numpy (ours as fp32, the reference float64) so results cross process boundaries by
    value (torch's queue would pass shared-memory handles that die with the child)."""
    return {name: (ours.detach().float().numpy(), ref.numpy()) for name, (ours, ref) in pairs.items()}


def assert_pairs(pairs, dtype, where=""):
    for name, (actual, expected) in pairs.items():
        actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
        if name.startswith("g_") and dtype == torch.bfloat16:
            assert_close_to_float64(actual, expected, dtype=dtype, terms=BF16_GRAD_TERMS, name=f"{where} {name}")
        else:  # an fp32 computation (of bf16 inputs, for the bf16 cases' values)
            assert_close_to_float64(actual, expected, dtype=torch.float32, terms=VALUE_TERMS, name=f"{where} {name}")


@pytest.mark.parametrize("seed,dtype,temperature,chunk_size", CASES)
def test_tp1_matches_dense(seed, dtype, temperature, chunk_size):
    pairs = compare_case(seed, dtype, temperature, chunk_size)
    assert pairs["lp"][0].dtype == torch.float32  # outputs are fp32 whatever the logits dtype
    assert_pairs(pairs, dtype, f"case {seed}")


def test_ignored_positions_and_padding_get_zero():
    logits, targets, mask, upstream = make_case(7)
    x = logits.clone().requires_grad_()
    logp, entropy = vocab_parallel_logprobs_and_entropy(x, targets, vocab_size=300, ignore_mask=mask, chunk_size=3)
    ignored = mask | (targets == -100)
    assert (logp[ignored] == 0).all() and (entropy[ignored] == 0).all()
    assert (logp[~ignored] < 0).all() and (entropy[~ignored] > 0).all()
    (logp.sum() + entropy.sum()).backward()
    assert (x.grad[ignored] == 0).all(), "ignored positions must receive no gradient"
    assert (x.grad[..., 300:] == 0).all(), "padded vocab columns must receive no gradient"
    assert (x.grad[~ignored][:, :300] != 0).any()


def test_leading_dims_and_defaults():
    """Any leading shape; vocab_size defaults to all columns; no megatron initialisation needed."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 4, 33, generator=gen)
    targets = torch.randint(0, 33, (2, 3, 4), generator=gen)
    got = vocab_parallel_logprobs(logits, targets)
    expected = torch.log_softmax(logits.double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert_close_to_float64(got, expected, dtype=torch.float32, terms=33, name="logp")


def test_bad_targets_and_arguments_raise():
    logits = torch.randn(4, 16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 1, 12, 3]), vocab_size=10)
    with pytest.raises(ValueError, match="does not fit the logit shards"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 1, 2, 3]), vocab_size=20)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 1, 2, 3]), temperature=0.0)
    with pytest.raises(ValueError, match="must be targets"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 1, 2]))
    # an out-of-range target is fine when the position is ignored
    vocab_parallel_logprobs(logits, torch.tensor([0, 1, 12, 3]), vocab_size=10,
                            ignore_mask=torch.tensor([False, False, True, False]))


class _LargestFloatTensor(TorchDispatchMode):
    """Records the numel of the largest fp32 tensor any op produces (dispatch sees every output)."""

    def __init__(self):
        super().__init__()
        self.largest_fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest_fp32 = max(self.largest_fp32, t.numel())
        return out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_no_fp32_tensor_larger_than_one_chunk(with_entropy):
    """Memory claim: forward + backward never create an fp32 tensor bigger than [chunk, V/tp]
    (the per-token statistics are [T]); the logit gradient is in the logits' dtype."""
    tokens, vocab, chunk = 64, 1000, 8
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    fn = vocab_parallel_logprobs_and_entropy if with_entropy else vocab_parallel_logprobs
    with _LargestFloatTensor() as probe:
        out = fn(logits, targets, chunk_size=chunk)
        loss = sum(o.sum() for o in out) if with_entropy else out.sum()
        loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    assert 0 < probe.largest_fp32 <= chunk * vocab, probe.largest_fp32


def test_default_chunk_size_bounds_the_buffer():
    assert default_chunk_size(151936, torch.device("cpu")) == max(1, (1 << 20) // 151936)
    assert default_chunk_size(151936 // 8, torch.device("cuda")) * (151936 // 8) <= 1 << 25
    assert default_chunk_size(10**9, torch.device("cpu")) == 1


def _tp_worker(rank, world_size, tp):
    """Runs every case on this rank's shard with megatron's TP group (the default) and once with an
    explicit group; returns the max abs errors per case and quantity."""
    from megatron.core import parallel_state

    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(tensor=tp))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    results = []
    for seed, dtype, temperature, chunk_size in CASES:
        pairs = compare_case(seed, dtype, temperature, chunk_size, tp_rank=tp_rank, tp=tp)
        results.append(((seed, dtype), portable(pairs)))
    explicit = compare_case(11, torch.float32, 0.9, 3, tp_rank=tp_rank, tp=tp,
                            tp_group=parallel_state.get_tensor_model_parallel_group())
    results.append(((11, torch.float32), portable(explicit)))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_dense(tp):
    """vocab 300 padded to 512: at TP=4 rank 2 holds 44 real columns and rank 3 only padding."""
    per_rank = run_distributed(_tp_worker, world_size=tp, args=(tp,), timeout=180)
    for rank, results in enumerate(per_rank):
        for (seed, dtype), pairs in results:
            assert_pairs(pairs, dtype, f"TP={tp} rank {rank} case {seed}")
