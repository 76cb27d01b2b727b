"""model.attention_backend and the torch_varlen path (models/spec.py, ops/torch_varlen.py) on CPU.

torch's varlen_attn is FlashAttention and runs on CUDA only, so the torch_varlen path runs here with
megatron_grpo.testing.varlen_reference in its place: a float64 function written from varlen_attn's
documented semantics, with varlen_attn's signature (checked against the installed torch). What
these tests hold: the dispatch (auto -> local on CPU, with the line saying so; torch_varlen / te
refused where they cannot run), the conversion of megatron's THD layout (padded cu_seqlens, GQA,
softmax scale, context-parallel chunks) into varlen_attn's inputs for every signature torch has
shipped, against a dense float64 attention and against the local path, and a GPTModel built by
models.build_model with the backend, whose packed forward and backward equal the local one's.
The real kernel's numerics are the GPU check's (scripts/gpu_check.py, the attention part).
"""
from __future__ import annotations

import inspect
import logging
import math

import pytest
import torch

from megatron_grpo.errors import ConfigError
from megatron_grpo.optional import available
from megatron_grpo.testing.floats import assert_close_to_float64
from megatron_grpo.testing.varlen_reference import varlen_attn as reference_varlen_attn
from tests.test_packing import _dense_reference, _packed_inputs, _params, _real_positions

SCALE = 0.3  # not 1/sqrt(head_dim): a signature without `scale` must rescale the query


def _parameters(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_reference_double_has_torch_varlen_attn_signature():
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    assert _parameters(reference_varlen_attn) == _parameters(varlen.varlen_attn)


@pytest.mark.parametrize("lq, lk, window", [(5, 5, (-1, 0)), (3, 8, (-1, 0)), (4, 4, (-1, -1)), (6, 6, (2, 0))])
def test_reference_double_is_torchs_own_lower_right_causal_attention(lq, lk, window):
    """The double's mask convention (bottom-right aligned, as FlashAttention's) equals torch's
    scaled_dot_product_attention with torch.nn.attention.bias.causal_lower_right, per sequence."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention

    g = torch.Generator().manual_seed(lq * 10 + lk)
    q, k, v = (torch.randn(n, 4, 8, generator=g, dtype=torch.float64) for n in (lq, lk, lk))
    cu_q, cu_k = torch.tensor([0, lq], dtype=torch.int32), torch.tensor([0, lk], dtype=torch.int32)
    got = reference_varlen_attn(q, k, v, cu_q, cu_k, lq, lk, window_size=window, scale=SCALE)
    mask = None
    if window == (-1, 0):
        mask = causal_lower_right(lq, lk)
    elif window != (-1, -1):  # a causal sliding window, written out
        i, j = torch.arange(lq).view(-1, 1) + lk - lq, torch.arange(lk).view(1, -1)
        mask = (j <= i) & (j >= i - window[0])
    want = scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                        scale=SCALE).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ----- varlen_attn's signatures, past and present -------------------------------------------------
def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's varlen_attn: causal as a flag, no scale, no GQA."""
    return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                 window_size=(-1, 0) if is_causal else (-1, -1))


def varlen_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1), k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None,
                  page_table=None, seqused_k=None):
    """The window_size generation before enable_gqa (scale, KV-cache keywords)."""
    return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                 window_size=window_size)


SIGNATURES = {"2.13+ (enable_gqa)": reference_varlen_attn, "window_size, no GQA": varlen_window,
              "2.10 (is_causal)": varlen_2_10}


def test_call_style_reads_each_signature():
    from megatron_grpo.ops.torch_varlen import call_style

    assert call_style(reference_varlen_attn) == call_style(reference_varlen_attn)
    styles = {name: call_style(fn) for name, fn in SIGNATURES.items()}
    assert styles["2.13+ (enable_gqa)"].causal == (("window_size", (-1, 0)),)
    assert styles["2.13+ (enable_gqa)"].takes_scale and styles["2.13+ (enable_gqa)"].takes_gqa
    assert not styles["window_size, no GQA"].takes_gqa and styles["window_size, no GQA"].takes_scale
    assert styles["2.10 (is_causal)"].causal == (("is_causal", True),)
    assert not styles["2.10 (is_causal)"].takes_scale and not styles["2.10 (is_causal)"].takes_gqa

    def neither(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        return query

    with pytest.raises(ConfigError, match="neither is_causal nor window_size"):
        call_style(neither)


def _leaves(tensors, dtype):
    return [t.to(dtype).clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("signature", list(SIGNATURES))
def test_packed_varlen_path_equals_dense_float64_attention(signature):
    """CP = 1, GQA (4 heads, 2 groups), padded segments, a non-default scale: the torch_varlen
    path's conversion into varlen_attn's inputs, in float64 end to end, equals a dense float64
    attention with a block-diagonal causal mask (output and the three gradients); padding rows
    are exactly zero and get no gradient."""
    from megatron_grpo.ops.torch_varlen import packed_varlen_attention, substitute_kernel

    q, k, v, upstream, cu, cu_padded = _packed_inputs()
    assert not torch.equal(cu, cu_padded) and q.size(1) == 2 * k.size(1)
    leaves = _leaves((q, k, v), torch.float64)
    with substitute_kernel(SIGNATURES[signature]):
        out = packed_varlen_attention(*leaves, _params(cu, cu_padded), SCALE)
    (out * upstream.double()).sum().backward()
    ref_leaves = _leaves((q, k, v), torch.float64)
    ref = _dense_reference(*ref_leaves, cu, cu_padded, SCALE)
    (ref * upstream.double()).sum().backward()
    real = _real_positions(cu, cu_padded)
    padding = torch.isin(torch.arange(q.size(0)), real, invert=True)
    assert padding.any() and not out.detach()[padding].any()
    torch.testing.assert_close(out.detach()[real], ref.detach()[real], rtol=0, atol=1e-12)
    for name, a, b in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12, msg=f"d{name}")
    assert not leaves[0].grad[padding].any()


def test_packed_varlen_path_equals_the_local_path_in_fp32():
    """The same fp32 inputs through the torch_varlen path (the double) and the local path
    (ops.varlen_attention.packed_causal_attention): both within fp32 rounding of float64."""
    from megatron_grpo.ops.torch_varlen import packed_varlen_attention, substitute_kernel
    from megatron_grpo.ops.varlen_attention import packed_causal_attention

    q, k, v, upstream, cu, cu_padded = _packed_inputs(seed=3)
    params = _params(cu, cu_padded)
    longest = int(torch.diff(cu).max())
    ref_leaves = _leaves((q, k, v), torch.float64)
    ref = _dense_reference(*ref_leaves, cu, cu_padded, SCALE)
    (ref * upstream.double()).sum().backward()
    for name, run in (("torch_varlen", packed_varlen_attention), ("local", packed_causal_attention)):
        leaves = _leaves((q, k, v), torch.float32)
        with substitute_kernel(reference_varlen_attn):
            out = run(*leaves, params, SCALE)
        (out * upstream).sum().backward()
        assert out.dtype == torch.float32
        assert_close_to_float64(out.detach(), ref.detach(), dtype=torch.float32, terms=longest, name=f"{name} output")
        for grad_name, a, b in zip("qkv", leaves, ref_leaves):
            assert_close_to_float64(a.grad, b.grad, dtype=torch.float32, terms=longest, name=f"{name} d{grad_name}")


def _context_parallel_pass(q, k, v, upstream, cu, cu_padded, cp, signature):
    """Every CP rank's varlen_over_gathered in one process: each rank's queries are its chunks, its
    keys the rank-ordered concatenation of every rank's chunks (what all_gather_sequence returns;
    its backward sums the gathered gradient over the ranks, as the sum over ranks here does)."""
    from megatron_grpo.ops.context_parallel import packed_local_positions
    from megatron_grpo.ops.torch_varlen import substitute_kernel, varlen_over_gathered

    leaves = _leaves((q, k, v), torch.float64)
    held = [packed_local_positions(cu_padded, r, cp) for r in range(cp)]
    gathered = torch.cat(held)
    outs = []
    with substitute_kernel(SIGNATURES[signature]):
        for rank in range(cp):
            out = varlen_over_gathered(leaves[0][held[rank]], leaves[1][gathered], leaves[2][gathered],
                                       _params(cu, cu_padded), SCALE, rank, cp)
            (out * upstream.double()[held[rank]]).sum().backward()
            outs.append(out.detach())
    return outs, held, leaves


@pytest.mark.parametrize("signature", list(SIGNATURES))
def test_context_parallel_varlen_equals_dense_float64_attention(signature):
    """CP = 2: each rank's two chunks per segment against the segment's keys up to each chunk's end
    (FlashAttention's bottom-right causal alignment gives each query its global position): outputs
    at every rank's positions and the gradients summed over ranks equal the dense float64 attention."""
    cp = 2
    q, k, v, upstream, cu, cu_padded = _packed_inputs(seed=1, cp=cp)
    outs, held, leaves = _context_parallel_pass(q, k, v, upstream, cu, cu_padded, cp, signature)
    ref_leaves = _leaves((q, k, v), torch.float64)
    ref = _dense_reference(*ref_leaves, cu, cu_padded, SCALE)
    (ref * upstream.double()).sum().backward()
    for rank in range(cp):
        torch.testing.assert_close(outs[rank], ref.detach()[held[rank]], rtol=0, atol=1e-12)  # padding: 0 both
    for name, a, b in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12, msg=f"d{name}")


def test_padded_segment_bounds_must_match_the_row():
    from megatron_grpo.ops.torch_varlen import substitute_kernel, varlen_over_gathered

    q, k, v, _, cu, cu_padded = _packed_inputs(seed=1, cp=2)
    with substitute_kernel(reference_varlen_attn), pytest.raises(ValueError, match="cu_seqlens end at"):
        varlen_over_gathered(q[:-2], k, v, _params(cu, cu_padded), SCALE, 0, 2)
    with substitute_kernel(reference_varlen_attn), pytest.raises(ConfigError, match="not divisible by 2"):
        varlen_over_gathered(q[: q.size(0) // 3], k, v, _params(cu, cu_padded), SCALE, 0, 3)


# ----- dispatch -----------------------------------------------------------------------------------
@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """resolve_backend logs each choice once per process: start from none logged."""
    from megatron_grpo.models import spec

    monkeypatch.setattr(spec, "_logged", set())
    caplog.set_level(logging.INFO, logger="megatron_grpo.models.spec")
    return caplog


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megatron_grpo.models.spec"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's choice")
def test_auto_picks_local_on_cpu_and_says_why(fresh_log):
    from megatron_grpo.models.spec import resolve_backend

    if available("transformer_engine"):
        pytest.skip("transformer_engine imports here")
    assert resolve_backend("auto", torch.float32) == "local"
    assert resolve_backend("auto", torch.float32) == "local"
    assert _lines(fresh_log) == ["attention backend: local (auto: transformer_engine not installed; torch_varlen "
                                 "not usable: no CUDA device (varlen_attn is FlashAttention, CUDA only))"]


def test_auto_prefers_te_then_torch_varlen_on_cuda_with_a_bf16_model(fresh_log, monkeypatch):
    from megatron_grpo.models import spec

    monkeypatch.setattr(spec, "available", lambda module: module == "transformer_engine")
    assert spec.resolve_backend("auto", torch.bfloat16) == "te"
    monkeypatch.setattr(spec, "available", lambda module: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if pytest.importorskip("megatron_grpo.ops.torch_varlen").torch_varlen_attn() is None:
        pytest.skip("this torch has no varlen_attn")
    assert spec.resolve_backend("auto", torch.bfloat16) == "torch_varlen"
    assert spec.resolve_backend("auto", torch.float32) == "local"  # FlashAttention has no fp32 kernel
    lines = _lines(fresh_log)
    assert lines[0] == "attention backend: te (auto: transformer_engine imports)"
    assert lines[1].startswith(f"attention backend: torch_varlen (auto: transformer_engine not installed; CUDA, "
                               f"torch {torch.__version__}'s varlen_attn")
    assert "float32 and FlashAttention only bfloat16 / float16" in lines[2]
    with pytest.raises(ConfigError, match="torch_varlen: the model runs float32"):
        spec.resolve_backend("torch_varlen", torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusals")
def test_torch_varlen_and_te_are_refused_where_they_cannot_run(fresh_log):
    from megatron_grpo.models.spec import resolve_backend
    from megatron_grpo.ops.torch_varlen import substitute_kernel

    with pytest.raises(ConfigError, match=r"^model.attention_backend=torch_varlen: no CUDA device .*; set "
                                          r"model.attention_backend=local \(or auto\)$"):
        resolve_backend("torch_varlen", torch.bfloat16)
    if not available("transformer_engine"):
        with pytest.raises(ConfigError, match="attention_backend=te but transformer_engine does not import"):
            resolve_backend("te")
    with pytest.raises(ConfigError, match="expected one of auto, te, torch_varlen, local"):
        resolve_backend("flash")
    with substitute_kernel(reference_varlen_attn):  # a substitute kernel runs anywhere
        assert resolve_backend("torch_varlen", torch.float32) == "torch_varlen"
    assert resolve_backend("memory-model") == "memory-model" and resolve_backend("local") == "local"
    assert _lines(fresh_log) == ["attention backend: torch_varlen (model.attention_backend=torch_varlen)",
                                 "attention backend: local (model.attention_backend=local)"]


def test_layer_spec_core_attention_per_backend():
    from megatron_grpo.models.hf_config import ModelArchitecture
    from megatron_grpo.models.spec import layer_spec
    from megatron_grpo.ops.context_parallel import ContextParallelDotProductAttention
    from megatron_grpo.ops.torch_varlen import (TorchVarlenContextParallelAttention, TorchVarlenDotProductAttention,
                                                substitute_kernel)
    from megatron_grpo.ops.varlen_attention import PackedDotProductAttention

    arch = ModelArchitecture.from_hf(_tiny_config())

    def core(backend, cp=1, model=arch):
        return layer_spec(model, cp, backend).submodules.self_attention.submodules.core_attention

    assert core("local") is PackedDotProductAttention and core("local", 2) is ContextParallelDotProductAttention
    with substitute_kernel(reference_varlen_attn):
        assert core("torch_varlen") is TorchVarlenDotProductAttention
        assert core("torch_varlen", 2) is TorchVarlenContextParallelAttention
        dropout = ModelArchitecture.from_hf(_tiny_config(attention_dropout=0.1))
        with pytest.raises(ConfigError, match="attention_dropout=0.1, but torch's varlen_attn has no dropout"):
            core("torch_varlen", 1, dropout)
    assert issubclass(TorchVarlenDotProductAttention, PackedDotProductAttention)


# ----- a whole model ------------------------------------------------------------------------------
def _tiny_config(**extra) -> dict:
    return dict(dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=96, hidden_size=64,
                     intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                     tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, hidden_act="silu",
                     initializer_range=0.05), **extra)


class _Counting:
    """varlen_attn's signature, counting calls: the model reached the kernel."""

    def __init__(self):
        self.calls = 0
        self.__signature__ = inspect.signature(reference_varlen_attn)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return reference_varlen_attn(*args, **kwargs)


def _model_forward_backward(rank, world_size):
    from megatron_grpo.launch import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.ops.torch_varlen import substitute_kernel
    from megatron_grpo.trainer.batches.batching import TrainSample, collate_packed

    initialize_model_parallel(ParallelLayout(), seed=7)
    arch = ModelArchitecture.from_hf(_tiny_config())
    g = torch.Generator().manual_seed(0)
    samples = [TrainSample(prompt_ids=torch.randint(96, (p,), generator=g).tolist(),
                           response_ids=torch.randint(96, (r,), generator=g).tolist(), advantage=1.0)
               for p, r in ((3, 9), (1, 1), (7, 20), (5, 4), (2, 13))]
    batch = collate_packed(samples, list(range(len(samples))), sequence_multiple=4, total_multiple=4)
    params = batch.packed.packed_seq_params(1)
    kernel = _Counting()
    results = {}
    (local,) = build_model(arch, dtype=torch.float32, backend="local")
    with substitute_kernel(kernel):
        (varlen,) = build_model(arch, dtype=torch.float32, backend="torch_varlen")
        varlen.load_state_dict(local.state_dict())
        for name, model in (("local", local), ("torch_varlen", varlen)):
            logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=params)
            upstream = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
            (logits * upstream).sum().backward()
            results[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return results, kernel.calls, type(varlen.decoder.layers[0].self_attention.core_attention).__name__


def test_build_model_with_torch_varlen_equals_the_local_model():
    """models.build_model(backend="torch_varlen") (the double in the kernel's place) on a packed
    micro-batch from the trainer's collate_packed (padded segments, GQA): logits and every weight's
    gradient equal the local backend's from the same weights within fp32 rounding; the kernel ran
    once per layer."""
    from megatron_grpo.testing.distributed import run_distributed

    (results, calls, core), = run_distributed(_model_forward_backward, 1, timeout=180)
    assert core == "TorchVarlenDotProductAttention" and calls == 2
    (local_logits, local_grads), (varlen_logits, varlen_grads) = results["local"], results["torch_varlen"]
    eps = torch.finfo(torch.float32).eps
    scale = float(local_logits.abs().max())
    assert float((varlen_logits - local_logits).abs().max()) <= 32 * eps * scale
    for name, grad in local_grads.items():
        error = float((varlen_grads[name] - grad).abs().max())
        assert error <= 32 * eps * max(float(grad.abs().max()), 1e-12), (name, error)
    assert math.isfinite(scale)
