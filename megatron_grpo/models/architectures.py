"""The table of supported HF architectures (dispatch on config.json's `model_type`).

Each entry says which math the HF model does, so the Megatron builder and the converter agree.
Adding an architecture = one row here + one mapping table in convert/mappings.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureSpec:
    model_type: str                 # config.json "model_type"
    hf_class: str                   # config.json "architectures"[0]
    qkv_bias: bool                  # q/k/v projections carry a bias (o_proj never does)
    qk_norm: bool                   # RMSNorm over head_dim on queries and keys before RoPE
    attention_bias_key: str | None  # config field that, when true, adds biases we do not support
    moe: bool = False               # sparse MLP layers (routed experts; config.json's num_experts)
    # A shared expert beside the routed ones (config.json's shared_expert_intermediate_size), its output
    # scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE).
    gated_shared_expert: bool = False
    # Config field that switches the q/k/v biases off (qkv_bias defaults to true; None: hard-wired).
    qkv_bias_key: str | None = None
    # SGLang 0.5.23's model class builds every layer sparse (it reads neither mlp_only_layers nor
    # decoder_sparse_step) and skips a dense layer's MLP weights in silence.
    sglang_every_layer_sparse: bool = False


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    # Qwen2 / Qwen2.5: q/k/v biases are hard-wired in the HF model; no config switch.
    "qwen2": ArchitectureSpec("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False,
                              attention_bias_key=None),
    # Qwen3: q/k RMSNorm; `attention_bias` would add biases to q/k/v AND o_proj.
    "qwen3": ArchitectureSpec("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True,
                              attention_bias_key="attention_bias"),
    # Llama 2/3/3.1/3.2/3.3: `attention_bias` likewise adds an o_proj bias.
    "llama": ArchitectureSpec("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False,
                              attention_bias_key="attention_bias"),
    # Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention; top-k routed experts, no shared
    # expert; dense MLP layers where decoder_sparse_step / mlp_only_layers say so.
    "qwen3_moe": ArchitectureSpec("qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True,
                                  attention_bias_key="attention_bias", moe=True),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias, config qkv_bias);
    # routed experts as Qwen3-MoE plus one shared expert gated by sigmoid(shared_expert_gate(x)).
    "qwen2_moe": ArchitectureSpec("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True, qk_norm=False,
                                  attention_bias_key=None, moe=True, gated_shared_expert=True,
                                  qkv_bias_key="qkv_bias", sglang_every_layer_sparse=True),
}
