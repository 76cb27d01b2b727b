"""Useful model FLOPs of the policy update and MFU (model FLOPs utilisation): the one definition
behind the trainer's perf/* metrics and benchmarks/bench_gpu.py.

Forward FLOPs of one sequence of s tokens: 2 x (matmul parameters a token passes through) x s for the
linear layers, plus causal attention per (query, key) pair at or before the query (s(s+1)/2 pairs):
2 x heads x (q/k head dim) for the score and 2 x heads x (value head dim) for the weighted sum, per
layer (4 x heads x head_dim with one head dim). The matmul parameters are, per layer, the attention
projections (q/k/v/o; for multi-head latent attention, DeepSeek-V3: q_proj or q_a_proj + q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj) and the MLP: the SwiGLU MLP (gate, up, down) on a dense layer;
on a mixture-of-experts layer the router, top-k experts and the shared experts (and Qwen2-MoE's shared
expert gate), the ones a token goes through; and the output layer over the padded vocabulary. The
input embedding is a lookup, not a matmul, and norms are negligible, so neither counts. Forward +
backward = 3 x forward (recompute not counted). Attention FLOPs an implementation wastes (the local
spec computes the full s x s score matrix) are not useful, so not counted either.
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


def attention_parameter_count(model_config) -> int:
    """One layer's attention projection weights (multi-head latent attention: the down and up
    projections; norms are not matmuls)."""
    c = model_config
    h, heads = c.hidden_size, c.num_attention_heads
    if getattr(c, "kv_lora_rank", 0):
        q = (h * c.q_lora_rank + c.q_lora_rank * heads * c.head_dim if c.q_lora_rank
             else h * heads * c.head_dim)  # q_a_proj + q_b_proj, or q_proj (head_dim: nope + rope)
        kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        return q + kv + heads * c.v_head_dim * h  # ..., kv_a_proj_with_mqa, kv_b_proj, o_proj
    q, kv = heads * c.head_dim, c.num_query_groups * c.head_dim
    return h * (q + 2 * kv) + q * h


def dense_parameter_count(model_config) -> int:
    """Matmul parameters a token goes through: every layer's attention projections and MLP (on a
    mixture-of-experts layer: router, its top-k experts, the shared experts), and the output layer
    over the padded vocabulary (tied or not: the input embedding is a lookup)."""
    c = model_config
    h = c.hidden_size
    dense_mlp = 3 * h * c.ffn_hidden_size  # SwiGLU: gate, up, down
    moe_layers = set(getattr(c, "moe_layers", ()))
    if moe_layers:
        moe_mlp = (h * c.num_experts + c.moe_top_k * 3 * h * c.moe_ffn_hidden_size
                   + 3 * h * c.shared_expert_ffn_hidden_size + (h if c.shared_expert_gate else 0))
    mlp = sum(moe_mlp if i in moe_layers else dense_mlp for i in range(c.num_layers))
    return c.num_layers * attention_parameter_count(c) + mlp + h * c.padded_vocab_size


def attention_pair_flops(model_config) -> int:
    """Forward FLOPs of one (query, key) pair over all layers and heads: the score's dot product over
    the q/k head and the value's weighted sum over the value head."""
    c = model_config
    v_head = c.v_head_dim if getattr(c, "kv_lora_rank", 0) else c.head_dim
    return 2 * c.num_layers * c.num_attention_heads * (c.head_dim + v_head)


def forward_flops(model_config, sequence_lengths: Iterable[int]) -> float:
    """Useful forward FLOPs of these sequences (the module docstring)."""
    linear, pair = 2 * dense_parameter_count(model_config), attention_pair_flops(model_config)
    return float(sum(linear * s + pair * s * (s + 1) / 2 for s in sequence_lengths))


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
