"""CPU versions of the SGLang GPU kernels the CPU scheduler reaches.

`murmur_hash32` (sglang.kernels.ops.sampling.murmur_hash) seeds deterministic sampling; on CPU
SGLang calls its sgl_kernel C++ op, which does not install here. This is the same hash as SGLang's
Triton kernel (seed low/high word, position, column; MurmurHash3 mixing and finaliser), on int64
tensors masked to 32 bits."""
from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * 0xCC9E2D51) & _MASK  # int64 products wrap, the low 32 bits stay exact
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _MASK
    h = h ^ k
    h = _rotl32(h, 13)
    return (h * 5 + 0xE6546B64) & _MASK


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """(n,) seeds, (n,) positions, (m,) columns -> (n, m) uint32 hashes."""
    seed = seed.to(torch.int64).view(-1, 1)
    pos = (positions.to(torch.int64) & _MASK).view(-1, 1)
    col = (col_indices.to(torch.int64) & _MASK).view(1, -1)
    h = torch.zeros_like(seed)
    h = _mix(h, seed & _MASK)
    h = _mix(h, (seed >> 32) & _MASK)
    h = _mix(h, pos)
    h = _mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1))
    h = _fmix32(h ^ 16)
    return h.to(torch.uint32)


def install() -> None:
    """Points SGLang's sampler at the CPU hash (it imported the name at module load)."""
    import sglang.kernels.ops.sampling.murmur_hash as murmur_module
    import sglang.srt.layers.sampler as sampler_module

    murmur_module.murmur_hash32 = murmur_hash32
    sampler_module.murmur_hash32 = murmur_hash32
