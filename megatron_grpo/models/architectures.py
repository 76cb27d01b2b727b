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
    # Shared experts beside the routed ones: None; "gated": one of shared_expert_intermediate_size,
    # its output scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE); "counted": n_shared_experts x
    # moe_intermediate_size wide, ungated (GLM-4.5, DeepSeek-V3).
    shared_expert: str | None = None
    # Config field that sets the q/k/v biases (default: qkv_bias above); None: hard-wired.
    qkv_bias_key: str | None = None
    # Config field that turns the q/k RMSNorm on (default: qk_norm above); None: hard-wired.
    qk_norm_key: str | None = None
    # Which layers are sparse: "sparse_step" (decoder_sparse_step / mlp_only_layers, Qwen) or
    # "first_k_dense" (the first first_k_dense_replace layers dense, GLM-4.5 / DeepSeek-V3).
    moe_layout: str = "sparse_step"
    experts_key: str = "num_experts"  # the config field with the number of routed experts
    # Router: "softmax" (Qwen: softmax, top-k, norm_topk_prob) or "sigmoid" (GLM-4.5 / DeepSeek-V3:
    # sigmoid scores, top-k of scores + e_score_correction_bias within the n_group / topk_group
    # groups, weights normalised and times routed_scaling_factor).
    router: str = "softmax"
    # partial_rotary_factor when the config has none (transformers' default for GLM-4.5 is 0.5);
    # None: rotary over the whole head, a partial_rotary_factor != 1 refused.
    partial_rotary_default: float | None = None
    # SGLang 0.5.23's model class builds every layer sparse (it reads neither mlp_only_layers nor
    # decoder_sparse_step) and skips a dense layer's MLP weights in silence.
    sglang_every_layer_sparse: bool = False
    # Multi-head latent attention (DeepSeek-V3): q (optionally through a q_lora_rank bottleneck) and a
    # compressed kv latent (kv_lora_rank) plus a decoupled rope head; YaRN rope scaling allowed.
    mla: bool = False


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
                                  attention_bias_key=None, moe=True, shared_expert="gated",
                                  qkv_bias_key="qkv_bias", sglang_every_layer_sparse=True),
    # GLM-4.5 / 4.6 / Air: attention_bias = q/k/v biases only (o_proj has none), use_qk_norm, partial
    # rotary (0.5); first_k_dense_replace dense layers, then sigmoid-routed experts with the
    # expert-bias (aux-loss-free) router and n_shared_experts ungated shared experts.
    "glm4_moe": ArchitectureSpec("glm4_moe", "Glm4MoeForCausalLM", qkv_bias=False, qk_norm=False,
                                 attention_bias_key=None, moe=True, shared_expert="counted",
                                 qkv_bias_key="attention_bias", qk_norm_key="use_qk_norm",
                                 moe_layout="first_k_dense", experts_key="n_routed_experts", router="sigmoid",
                                 partial_rotary_default=0.5),
    # DeepSeek-V3 (and its V2-Lite-style shape with q_lora_rank null): MLA (megatron-core's MLASelfAttention),
    # YaRN; first_k_dense_replace dense layers, then GLM-4.5's router (sigmoid, frozen expert bias, groups,
    # routed_scaling_factor) and n_shared_experts ungated shared experts. attention_bias adds biases we do not build.
    "deepseek_v3": ArchitectureSpec("deepseek_v3", "DeepseekV3ForCausalLM", qkv_bias=False, qk_norm=False,
                                    attention_bias_key="attention_bias", moe=True, shared_expert="counted",
                                    moe_layout="first_k_dense", experts_key="n_routed_experts", router="sigmoid",
                                    mla=True),
}
