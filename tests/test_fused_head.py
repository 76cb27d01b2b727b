"""ops.fused_head equals the unfused computation: logits = hidden @ weight.T, then dense log_softmax.

Values and the gradients of hidden and weight, in fp32 and bf16, against the dense computation in
float64 on the same (rounded) inputs, within the dtype's rounding of sums over the vocabulary
(megatron_grpo.testing.floats); at TP=1 and at TP=2/4 in gloo processes, where each rank holds a
vocab shard of the weight and the reference is computed on the full weight.
"""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.ops.fused_head import fused_head_logprobs, fused_head_logprobs_and_entropy
from megatron_grpo.ops.vocab_parallel import vocab_parallel_logprobs_and_entropy
from megatron_grpo.testing.distributed import run_distributed
from megatron_grpo.testing.floats import assert_close_to_float64

VOCAB, PADDED, HIDDEN = 300, 512, 24
# Roundings that accumulate into each output (megatron_grpo.testing.floats): in fp32 the longest sum,
# the softmax over the vocabulary; in bf16 the three bf16 results on the way to a gradient (logits,
# their gradient, the gradient of hidden / weight), each a matmul accumulated in fp32.
TERMS = {torch.float32: VOCAB, torch.bfloat16: 3}


def make_case(seed: int, dtype, shape=(3, 7)):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(PADDED, HIDDEN, generator=gen) / HIDDEN ** 0.5 * 2).to(dtype)
    targets = torch.randint(0, VOCAB, shape, generator=gen)
    targets.view(-1)[:2] = -100
    mask = torch.zeros(shape, dtype=torch.bool)
    mask.view(-1)[4] = True
    upstream = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    return hidden, weight, targets, mask, upstream


def unfused(hidden, weight, targets, mask, upstream, temperature):
    """Dense torch on the full weight, in float64 from the same inputs: the reference."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    upstream = tuple(u.double() for u in upstream)
    logsm = torch.log_softmax((h @ w.t())[..., :VOCAB] / temperature, dim=-1)
    ignored = mask | (targets == -100)
    logp = logsm.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
    entropy = -(logsm.exp() * logsm).sum(-1).masked_fill(ignored, 0.0)
    g_lp, g_h = upstream
    grad_h, grad_w = torch.autograd.grad((logp * g_lp + entropy * g_h).sum(), (h, w))
    return logp.detach(), entropy.detach(), grad_h, grad_w


def fused(hidden, weight_shard, targets, mask, upstream, temperature, chunk_size):
    h = hidden.detach().clone().requires_grad_()
    w = weight_shard.detach().clone().requires_grad_()
    logp, entropy = fused_head_logprobs_and_entropy(h, w, targets, temperature=temperature, vocab_size=VOCAB,
                                                    ignore_mask=mask, chunk_size=chunk_size)
    g_lp, g_h = upstream
    grad_h, grad_w = torch.autograd.grad((logp * g_lp + entropy * g_h).sum(), (h, w))
    return logp.detach(), entropy.detach(), grad_h, grad_w


def errors(ours, ref, cols, dtype):
    """Assertable pairs (as numpy, so they can cross process boundaries); ours keep their dtypes:
    log-probs and entropy fp32, gradients in the inputs' dtype."""
    names = ("logp", "entropy", "grad_hidden", "grad_weight")
    expected_dtypes = (torch.float32, torch.float32, dtype, dtype)
    ref = (ref[0], ref[1], ref[2], ref[3][cols])
    out = {}
    for name, a, b, want in zip(names, ours, ref, expected_dtypes):
        assert a.dtype == want, f"{name}: {a.dtype} != {want}"
        out[name] = (a.float().numpy(), b.numpy())
    return out


def assert_errors(pairs, dtype, where):
    for name, (a, b) in pairs.items():
        assert_close_to_float64(torch.from_numpy(a), torch.from_numpy(b), dtype=dtype, terms=TERMS[dtype],
                                name=f"{where} {name}")


CASES = [(0, torch.float32, 1.0, 4), (1, torch.float32, 0.7, 5), (2, torch.float32, 1.2, None),
         (3, torch.bfloat16, 0.7, 4), (4, torch.bfloat16, 1.0, 100)]


def run_case(seed, dtype, temperature, chunk_size, tp_rank=0, tp=1):
    hidden, weight, targets, mask, upstream = make_case(seed, dtype)
    ref = unfused(hidden, weight, targets, mask, upstream, temperature)
    width = PADDED // tp
    cols = slice(tp_rank * width, (tp_rank + 1) * width)
    ours = fused(hidden, weight[cols], targets, mask, upstream, temperature, chunk_size)
    return errors(ours, ref, cols, dtype)


@pytest.mark.parametrize("seed,dtype,temperature,chunk_size", CASES)
def test_fused_equals_unfused_tp1(seed, dtype, temperature, chunk_size):
    assert_errors(run_case(seed, dtype, temperature, chunk_size), dtype, f"case {seed}")


def test_fused_equals_vocab_parallel_on_materialised_logits():
    """The fused op and ops.vocab_parallel on hidden @ weight.T (same statistics code path) both
    equal the float64 dense values."""
    hidden, weight, targets, mask, upstream = make_case(9, torch.float32)
    lp_f, h_f = fused_head_logprobs_and_entropy(hidden, weight, targets, vocab_size=VOCAB, ignore_mask=mask,
                                                temperature=0.8, chunk_size=6)
    lp_u, h_u = vocab_parallel_logprobs_and_entropy(hidden @ weight.t(), targets, vocab_size=VOCAB,
                                                    ignore_mask=mask, temperature=0.8, chunk_size=6)
    ref_lp, ref_h, _, _ = unfused(hidden, weight, targets, mask, upstream, 0.8)
    for name, ours, ref in (("fused logp", lp_f, ref_lp), ("fused entropy", h_f, ref_h),
                            ("vocab-parallel logp", lp_u, ref_lp), ("vocab-parallel entropy", h_u, ref_h)):
        assert_close_to_float64(ours, ref, dtype=torch.float32, terms=TERMS[torch.float32], name=name)


def test_logprobs_only_and_frozen_weight():
    hidden, weight, targets, mask, (g_lp, _) = make_case(5, torch.float32)
    h = hidden.clone().requires_grad_()
    logp = fused_head_logprobs(h, weight, targets, vocab_size=VOCAB, ignore_mask=mask, chunk_size=5)
    (logp * g_lp).sum().backward()
    ref_lp, _, ref_gh, _ = unfused(hidden, weight, targets, mask, (g_lp, torch.zeros_like(g_lp)), 1.0)
    assert_close_to_float64(logp.detach(), ref_lp, dtype=torch.float32, terms=TERMS[torch.float32], name="logp")
    assert_close_to_float64(h.grad, ref_gh, dtype=torch.float32, terms=TERMS[torch.float32], name="grad_hidden")
    assert weight.grad is None


def test_argument_errors():
    hidden, weight, targets, _, _ = make_case(0, torch.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_head_logprobs(hidden, weight.to(torch.bfloat16), targets)
    with pytest.raises(ValueError, match=r"must be \[V/tp, H"):
        fused_head_logprobs(hidden, weight[:, :5], targets)


def _tp_worker(rank, world_size, tp):
    from megatron.core import parallel_state

    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(tensor=tp))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return [((seed, dtype), run_case(seed, dtype, temperature, chunk_size, tp_rank=tp_rank, tp=tp))
            for seed, dtype, temperature, chunk_size in CASES]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_fused_tensor_parallel_equals_unfused(tp):
    """grad_hidden is all-reduced over TP (the full gradient on every rank); grad_weight is the shard's."""
    for rank, results in enumerate(run_distributed(_tp_worker, world_size=tp, args=(tp,), timeout=180)):
        for (seed, dtype), pairs in results:
            assert_errors(pairs, dtype, f"TP={tp} rank {rank} case {seed}")
