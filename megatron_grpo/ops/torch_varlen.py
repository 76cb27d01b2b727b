"""Packed (THD) causal attention through torch's own FlashAttention kernel over cu_seqlens,
`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, CUDA only): model.attention_backend=torch_varlen,
the fast attention path without Transformer Engine. Padded micro-batches keep megatron's local
attention; only packed ones (the trainer's default) come here.

The one place that knows varlen_attn's signature (checked with inspect.signature, so a torch
version is never named; VarlenCall):
  * causal: `is_causal=True` (the first release, torch 2.10) or `window_size=(-1, 0)` (later ones:
    2.13 and 2.14 take window_size, scale and enable_gqa);
  * scale: the `scale` keyword where there is one; otherwise the query is multiplied by
    scale * sqrt(head_dim) and the kernel's default 1 / sqrt(head_dim) applies;
  * GQA: `enable_gqa=True` where there is one; otherwise K / V heads are repeated
    (repeat_interleave: query head i reads K / V head i // (heads / groups), as megatron groups them).
varlen_attn has no dropout (attention_dropout > 0 is refused when the layer spec is built) and
runs bfloat16 / float16 only (resolve_backend refuses a float32 model).

Layouts, both ending with the padding rows set to zero as Transformer Engine and
ops.varlen_attention leave them:
  * CP = 1 (`packed_varlen_attention`): the varlen sequences are megatron's padded segments
    [cu_padded[i], cu_padded[i+1]). A segment's real tokens come first and attend causally among
    themselves (a causal mask never lets them see the padding after them), so one kernel call
    over the padded bounds computes every real token exactly; no host sync (max_seqlen comes
    from PackedSeqParams).
  * CP > 1 (`context_parallel_varlen_attention`): as ops.varlen_attention's CP path, K / V are
    all-gathered over the CP group and every segment's two local chunks (chunks r and 2 CP - 1 - r
    of 2 CP) are two varlen "sequences": chunk c's queries against the segment's keys
    0 .. end of chunk c. FlashAttention aligns a causal mask to the bottom right when there are
    more keys than queries (query i sees key j <= i + keys - queries), which is exactly each
    query's global position; the keys of a segment's first chunk are repeated for its second
    (K / V of (2 CP + 1) / (2 CP) of the row instead of 1). `varlen_over_gathered` is that
    computation without the collective (the GPU check runs it on one device for every rank).

`substitute_kernel(fn)` runs this path with another function of varlen_attn's signature: the
CPU tests and the GPU check's dry run use megatron_grpo.testing.varlen_reference (float64, from
varlen_attn's documented semantics), since the real kernel needs CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_grpo.errors import ConfigError
from megatron_grpo.ops.context_parallel import ContextParallelDotProductAttention
from megatron_grpo.ops.sequence_gather import all_gather_sequence
from megatron_grpo.ops.varlen_attention import PackedDotProductAttention, _bounds, _gathered_key_index

VarlenFn = Callable[..., torch.Tensor]
_substitute: list[VarlenFn] = []  # the innermost substitute_kernel's function, if any


def torch_varlen_attn() -> Optional[VarlenFn]:
    """torch's varlen_attn, or None when this torch has none (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def kernel() -> VarlenFn:
    """The function packed attention calls: a substitute when one is installed, else torch's."""
    if _substitute:
        return _substitute[-1]
    fn = torch_varlen_attn()
    if fn is None:
        raise ConfigError(f"model.attention_backend=torch_varlen: torch {torch.__version__} has no "
                          "torch.nn.attention.varlen.varlen_attn (torch >= 2.10)")
    return fn


@contextlib.contextmanager
def substitute_kernel(fn: VarlenFn) -> Iterator[None]:
    """Inside the block the torch_varlen path calls `fn` (varlen_attn's signature) instead of torch's
    kernel, on any device: for tests and the GPU check's CPU dry run."""
    _substitute.append(fn)
    try:
        yield
    finally:
        _substitute.remove(fn)


def unavailable_reason(dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why the torch_varlen path cannot run here (None: it can): no varlen_attn in this torch, no
    CUDA device, or a dtype FlashAttention has no kernel for. A substitute kernel runs anywhere."""
    if _substitute:
        return None
    if torch_varlen_attn() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
    if not torch.cuda.is_available():
        return "no CUDA device (varlen_attn is FlashAttention, CUDA only)"
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return (f"the model runs {str(dtype).replace('torch.', '')} and FlashAttention only bfloat16 / float16 "
                "(model.dtype=bfloat16)")
    return None


@dataclass(frozen=True)
class VarlenCall:
    """How to ask one varlen_attn for causal attention with a given scale and GQA."""

    causal: tuple[tuple[str, object], ...]  # the keyword(s) that make it causal
    takes_scale: bool
    takes_gqa: bool


@functools.lru_cache(maxsize=None)
def call_style(fn: VarlenFn) -> VarlenCall:
    """The keywords this varlen_attn takes (see the module docstring)."""
    params = inspect.signature(fn).parameters
    if "is_causal" in params:
        causal: tuple[tuple[str, object], ...] = (("is_causal", True),)
    elif "window_size" in params:
        causal = (("window_size", (-1, 0)),)
    else:
        raise ConfigError(f"model.attention_backend=torch_varlen: torch {torch.__version__}'s varlen_attn takes "
                          f"neither is_causal nor window_size ({', '.join(params)}); use model.attention_backend=local")
    return VarlenCall(causal=causal, takes_scale="scale" in params, takes_gqa="enable_gqa" in params)


def varlen_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                  cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal varlen attention (bottom-right aligned where a sequence has more keys than queries):
    query [Tq, h, d], key / value [Tk, g, d] (h a multiple of g), cu_* int32 on the device."""
    fn = kernel()
    style = call_style(fn)
    kwargs = dict(style.causal)
    if style.takes_scale:
        kwargs["scale"] = scale
    else:
        default = 1.0 / math.sqrt(query.size(-1))
        if not math.isclose(scale, default, rel_tol=1e-12):
            query = query * (scale / default)
    heads, groups = query.size(1), key.size(1)
    if heads != groups:
        if style.takes_gqa:
            kwargs["enable_gqa"] = True
        else:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
    # FlashAttention reads rows by stride but wants each head's vector contiguous; megatron's Q / K / V
    # are views of its fused QKV projection: copy only what is not contiguous already.
    return fn(query.contiguous(), key.contiguous(), value.contiguous(), cu_q, cu_k, max_q, max_k, **kwargs)


def real_token_mask(cu: torch.Tensor, cu_padded: torch.Tensor, total: int, device) -> torch.Tensor:
    """[total] bool: True where a row position holds a real token (position - its segment's start <
    the segment's real length), computed on the device."""
    cu, cu_padded = cu.to(device=device, dtype=torch.long), cu_padded.to(device=device, dtype=torch.long)
    positions = torch.arange(total, device=device)
    segment = torch.searchsorted(cu_padded[1:], positions, right=True).clamp_(max=cu.numel() - 2)
    return positions - cu_padded[segment] < (cu[1:] - cu[:-1])[segment]


def packed_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed_seq_params,
                            scale: float) -> torch.Tensor:
    """CP = 1. query [T, h, d], key / value [T, g, d] -> [T, h, d] (zeros on padding)."""
    cu = packed_seq_params.cu_seqlens_q
    padded = packed_seq_params.cu_seqlens_q_padded
    bounds = (cu if padded is None else padded).to(device=query.device, dtype=torch.int32)
    longest = packed_seq_params.max_seqlen_q
    if longest is None:
        longest = int((bounds[1:] - bounds[:-1]).max())
    out = varlen_causal(query, key, value, bounds, bounds, int(longest), int(longest), scale)
    if padded is None or padded is cu:
        return out
    real = real_token_mask(cu, padded, query.size(0), query.device)
    return out.masked_fill(~real.view(-1, 1, 1), 0.0)


def varlen_over_gathered(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, packed_seq_params,
                         scale: float, cp_rank: int, cp_size: int) -> torch.Tensor:
    """CP > 1 without the collective. query [T/cp, h, d]: this rank's chunks of every segment;
    keys / values [T, g, d]: every rank's local K / V in rank order (all_gather_sequence's result);
    returns [T/cp, h, d] (zeros on padding)."""
    lengths, bounds = _bounds(packed_seq_params)
    local_rows = query.size(0)
    if bounds[-1] != local_rows * cp_size:
        raise ValueError(f"packed attention: cu_seqlens end at {bounds[-1]} but the CP ranks hold "
                         f"{cp_size} x {local_rows} tokens")
    cu_q, cu_k, key_index, real = [0], [0], [], []
    for length, start, end in zip(lengths, bounds, bounds[1:]):
        segment = end - start
        if segment % (2 * cp_size):
            raise ConfigError(f"packed sequence segment of {segment} tokens is not divisible by 2 * "
                              f"context_parallel_size = {2 * cp_size}")
        chunk = segment // (2 * cp_size)
        if chunk == 0:
            continue
        for first in (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk):
            num_keys = first + chunk  # the segment's keys up to this chunk's last position
            cu_q.append(cu_q[-1] + chunk)
            cu_k.append(cu_k[-1] + num_keys)
            key_index.append(_gathered_key_index(num_keys, start // cp_size, local_rows, segment, cp_size,
                                                 torch.device("cpu")))
            real.append(torch.arange(first, first + chunk) < length)
    if not key_index:
        return query.new_zeros(query.shape)
    device = query.device
    index = torch.cat(key_index).to(device)
    sizes_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    sizes_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    out = varlen_causal(query, keys.index_select(0, index), values.index_select(0, index),
                        torch.tensor(cu_q, dtype=torch.int32, device=device),
                        torch.tensor(cu_k, dtype=torch.int32, device=device), max(sizes_q), max(sizes_k), scale)
    return out.masked_fill(~torch.cat(real).to(device).view(-1, 1, 1), 0.0)


def context_parallel_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                      packed_seq_params, scale: float, cp_group) -> torch.Tensor:
    """CP > 1. query [T/cp, h, d], key / value [T/cp, g, d] -> [T/cp, h, d] (zeros on padding)."""
    keys = all_gather_sequence(key, cp_group)  # backward: summed over the group, this rank's part kept
    values = all_gather_sequence(value, cp_group)
    return varlen_over_gathered(query, keys, values, packed_seq_params, scale, dist.get_rank(cp_group),
                                dist.get_world_size(cp_group))


def _refuse_dropout(module) -> None:
    if module.training and module.config.attention_dropout > 0:
        raise ConfigError(f"model.attention_backend=torch_varlen: the model's attention_dropout="
                          f"{module.config.attention_dropout} but varlen_attn has no dropout; use "
                          "model.attention_backend=local")


class TorchVarlenDotProductAttention(PackedDotProductAttention):
    """CP = 1: packed micro-batches through varlen_attn, padded ones through megatron's own code."""

    def packed_attention(self, query, key, value, packed_seq_params):
        _refuse_dropout(self)
        return packed_varlen_attention(query, key, value, packed_seq_params, self.softmax_scale)


class TorchVarlenContextParallelAttention(ContextParallelDotProductAttention):
    """CP > 1: packed micro-batches through varlen_attn over the all-gathered K / V, padded ones
    through ops.context_parallel's attention."""

    def packed_attention(self, query, key, value, packed_seq_params):
        _refuse_dropout(self)
        return context_parallel_varlen_attention(query, key, value, packed_seq_params, self.softmax_scale,
                                                 self.cp_group)
