"""Useful model FLOPs of the policy update and MFU (model FLOPs utilisation): the one definition
behind the trainer's perf/* metrics and benchmarks/bench_gpu.py.

Forward FLOPs of one sequence of s tokens: 2 x (matmul parameters) x s for the linear layers, plus
causal attention, 4 x layers x heads x head_dim per (query, key) pair at or before the query: s(s+1)/2
pairs. Matmul parameters are those of the q/k/v/o projections and the SwiGLU MLP (gate, up, down)
of every layer, and the output layer over the padded vocabulary. The input embedding is a lookup,
not a matmul, and norms are negligible, so neither counts. Forward + backward = 3 x forward
(recompute not counted). Attention FLOPs an implementation wastes (the local spec computes the
full s x s score matrix) are not useful, so not counted either.
"""
from __future__ import annotations

from typing import Iterable

import torch

# Dense (no sparsity) bf16 TFLOP/s and HBM TB/s from the vendors' data sheets, by device-name
# substring. First match wins, so the more specific names come first.
DEVICE_PEAKS = [
    ("GH200", 989.0, 4.0), ("H200", 989.0, 4.8), ("H100 NVL", 835.0, 3.9), ("H100 PCIe", 756.0, 2.0),
    ("H100", 989.0, 3.35), ("H800", 989.0, 3.35), ("B200", 2250.0, 8.0), ("B100", 1750.0, 8.0),
    ("A100-SXM4-80GB", 312.0, 2.039), ("A100 80GB PCIe", 312.0, 1.935), ("A100", 312.0, 1.555),
    ("L40S", 362.0, 0.864), ("A10G", 70.0, 0.6), ("RTX 4090", 165.0, 1.008),
]


def dense_parameter_count(model_config) -> int:
    """Parameters of the matmuls: every layer's attention projections and MLP, and the output
    layer over the padded vocabulary (tied or not: the input embedding is a lookup)."""
    c = model_config
    q, kv = c.num_attention_heads * c.head_dim, c.num_query_groups * c.head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    mlp = 3 * c.hidden_size * c.ffn_hidden_size  # SwiGLU: gate, up, down
    return c.num_layers * (attention + mlp) + c.hidden_size * c.padded_vocab_size


def forward_flops(model_config, sequence_lengths: Iterable[int]) -> float:
    """Useful forward FLOPs of these sequences (the module docstring)."""
    c = model_config
    linear = 2 * dense_parameter_count(c)
    attention = 4 * c.num_layers * c.num_attention_heads * c.head_dim
    return float(sum(linear * s + attention * s * (s + 1) / 2 for s in sequence_lengths))


def training_flops(model_config, sequence_lengths: Iterable[int]) -> float:
    """Useful FLOPs of one forward + backward over these sequences (3 x forward)."""
    return 3 * forward_flops(model_config, sequence_lengths)


def device_peaks(device: torch.device) -> tuple[str, float | None, float | None]:
    """(device name, dense bf16 peak TFLOP/s, peak HBM TB/s); None where the card is not in
    DEVICE_PEAKS (and on CPU)."""
    if device.type != "cuda":
        return f"CPU ({torch.get_num_threads()} threads)", None, None
    name = torch.cuda.get_device_name(device)
    return next(((name, tflops, tbps) for key, tflops, tbps in DEVICE_PEAKS if key in name), (name, None, None))


def peak_flops_per_device(device: torch.device) -> float | None:
    tflops = device_peaks(device)[1]
    return tflops * 1e12 if tflops else None
