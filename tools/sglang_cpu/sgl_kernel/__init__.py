"""A stand-in for SGLang's CPU kernel package (`sgl_kernel`, built from sgl-kernel's csrc/cpu), which
is not on the package index: only the two helpers SGLang 0.5.23's CPU code can call, in torch.

With SGLANG_USE_CPU_ENGINE=1, SGLang imports these at module load; it calls them only on its
speculative-decoding paths (a plain engine calls neither: docs/testing.md, "SGLang's runtime on a CPU"):
  * copy_all_layer_kv_cache_cpu (sglang/kernels/ops/kvcache/cache_move.py): copies whole KV rows
    from source slots to target slots in every layer's buffer; its GPU twin is the Triton kernel
    `copy_all_layer_kv_cache_tiled` beside it;
  * assign_req_to_token_pool_cpu (sglang/srt/mem_cache/allocation.py): writes the KV slots of each
    request's new tokens into the request-to-token table; its GPU twin is the Triton kernel
    `assign_req_to_token_pool` beside it.
tests/test_sglang_cpu_kernels.py holds each, called by SGLang's own dispatcher, to its Triton twin
(run by Triton's CPU interpreter) on random inputs. Every other name SGLang imports from here
(speculative decoding, mamba layers, the AMX paths) is a function that raises, naming itself, when
called: a feature that needs a real kernel fails loudly instead of computing something else.
SGLang's `torch.ops.sgl_kernel.*` operators are not registered, so its AMX path stays off ("will
fallback to torch_native backend" in its log).
"""
from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+megatron-grpo-cpu-stand-in"


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For each buffer b (base address data_ptrs[b], a row of strides[b] bytes), row tgt_loc[i] :=
    row src_loc[i], reading every source before writing (safe in place, as the Triton kernel)."""
    if tgt_loc.numel() == 0:
        return
    rows = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    src, tgt = src_loc.long(), tgt_loc.long()
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        buffer = (ctypes.c_uint8 * (rows * row_bytes)).from_address(address)
        table = torch.frombuffer(buffer, dtype=torch.uint8).view(rows, row_bytes)
        table[tgt] = table[src]  # advanced indexing on the right copies first


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] := the next end - start slots
    of out_cache_loc, requests in order."""
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"assign_req_to_token_pool_cpu: pool_len {pool_len} != req_to_token's row length "
                         f"{req_to_token.shape[1]}")
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[taken:taken + end - start]
        taken += end - start


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: SGLang called a CPU kernel that megatron-grpo's stand-in "
                                  f"(tools/sglang_cpu/sgl_kernel) does not provide; this feature needs SGLang's "
                                  f"real CPU kernel package (sgl-kernel built with pyproject_cpu.toml)")

    missing.__name__ = name
    return missing
