"""RoPE inverse frequencies, including Llama 3.x frequency scaling.

megatron-core 0.16.1's RotaryEmbedding(rope_scaling=True) hard-codes low_freq_factor=1,
high_freq_factor=4 and original_max_position_embeddings=8192 (Llama 3.1's values). Configs may
carry other values (Llama 3.2 uses the same, but nothing guarantees it), so we compute the scaled
frequencies from the config ourselves and install them on the model."""
from __future__ import annotations

import math

import torch

from megatron_grpo.models.hf_config import Llama3RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d), then Llama 3 scaling when given (fp32, shape [d/2])."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    # Wavelengths longer than original_max/low_freq_factor are slowed down by `factor`; shorter
    # than original_max/high_freq_factor are kept; in between, interpolate linearly in
    # (original_max / wavelength).
    wavelength = 2 * math.pi / inv_freq
    long_wavelength = s.original_max_position_embeddings / s.low_freq_factor
    short_wavelength = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelength - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelength > long_wavelength, inv_freq / s.factor, inv_freq)
    in_between = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(in_between, interpolated, scaled)
