"""A float64 stand-in for torch.nn.attention.varlen.varlen_attn, written from its documented
semantics, with its signature (torch 2.13 / 2.14; tests/test_torch_varlen.py checks the two
signatures are the same). torch's kernel is FlashAttention and runs on CUDA only: the CPU tests
and the GPU check's dry run put this in its place (ops.torch_varlen.substitute_kernel) to run the
torch_varlen path's input conversion end to end.

Semantics: sequence b's queries are query[cu_seq_q[b]:cu_seq_q[b+1]], its keys / values
key[cu_seq_k[b]:cu_seq_k[b+1]]; with Lq queries and Lk keys, query i sees key j when
i + Lk - Lq - left <= j <= i + Lk - Lq + right for window_size (left, right), -1 meaning
unbounded: (-1, 0) is causal, aligned to the bottom right (FlashAttention's convention); a query
that sees no key gets zeros. scale defaults to 1 / sqrt(head_dim); with enable_gqa query head h
reads K / V head h // (H_q / H_kv). max_q / max_k must cover every sequence (the kernel sizes its
grid by them; too small is refused here). Computed in float64, returned in the query's dtype.
Not modelled (refused when set): return_aux, seqused_k, block_table (inference paths).
"""
from __future__ import annotations

import torch


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux=None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,  # a kernel-scheduling choice: no effect on the values
) -> torch.Tensor:
    if return_aux is not None or seqused_k is not None or block_table is not None:
        raise NotImplementedError("varlen_reference models the training path only (no return_aux, seqused_k, "
                                  "block_table)")
    heads, groups = query.size(1), key.size(1)
    if not enable_gqa and heads != groups:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={heads} and "
                         f"Hkv={groups}. Try setting enable_gqa=True for GQA.")
    if heads % groups:
        raise ValueError(f"Hq={heads} is not a multiple of Hkv={groups}")
    cu_seq_k = cu_seq_q if cu_seq_k is None else cu_seq_k
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seq_q has {len(bounds_q)} entries, cu_seq_k {len(bounds_k)}")
    if bounds_q[-1] > query.size(0) or bounds_k[-1] > key.size(0):
        raise ValueError(f"cu_seqlens end at {bounds_q[-1]} / {bounds_k[-1]} past {query.size(0)} / {key.size(0)} rows")
    left, right = window_size
    scale = query.size(-1) ** -0.5 if scale is None else scale
    q64, k64, v64 = query.double(), key.double(), value.double()
    k64, v64 = k64.repeat_interleave(heads // groups, 1), v64.repeat_interleave(heads // groups, 1)
    pieces = []
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        lq, lk = q1 - q0, k1 - k0
        if lq > max_q or lk > max_k:
            raise ValueError(f"a sequence of {lq} queries / {lk} keys exceeds max_q={max_q} / max_k={max_k}")
        i = torch.arange(lq).view(-1, 1) + (lk - lq)
        j = torch.arange(lk).view(1, -1)
        seen = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        scores = torch.einsum("qhd,khd->hqk", q64[q0:q1], k64[k0:k1]) * scale
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).nan_to_num(0.0)
        pieces.append(torch.einsum("hqk,khd->qhd", probs, v64[k0:k1]))
    out = torch.cat(pieces) if pieces else q64.new_zeros(0, *q64.shape[1:])
    if out.size(0) < query.size(0):  # rows past cu_seq_q[-1] belong to no sequence
        out = torch.cat([out, q64.new_zeros(query.size(0) - out.size(0), *q64.shape[1:])])
    return out.to(query.dtype)
