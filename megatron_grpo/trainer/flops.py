"""Model FLOPs of the policy update and, on known GPUs, MFU (model FLOPs utilisation)."""
from __future__ import annotations

import torch

# Dense bf16 tensor-core peak per GPU (vendor specs, no sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def dense_parameter_count(model_config) -> int:
    """Parameters of the transformer matmuls and embeddings (norms are negligible)."""
    c = model_config
    q, kv = c.num_attention_heads * c.head_dim, c.num_query_groups * c.head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    mlp = 3 * c.hidden_size * c.ffn_hidden_size  # SwiGLU: gate, up, down
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_layers * (attention + mlp) + embeddings


def training_flops(model_config, tokens: int) -> float:
    """6 N per trained token (forward 2N + backward 4N), the usual MFU convention; attention-score
    FLOPs and recompute are not counted."""
    return 6.0 * dense_parameter_count(model_config) * tokens


def peak_flops_per_device(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)
