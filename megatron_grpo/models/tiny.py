"""Tiny random HF models (no downloads) for tests, CPU recipes and benchmarks.

    path = save_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=0)
"""
from __future__ import annotations

from pathlib import Path

import torch

# Each exercises one architecture's special features: qwen2 (q/k/v bias, untied), qwen3 (q/k norm,
# head_dim 32 != hidden/heads 16, tied), llama (llama3 rope scaling with non-default factors, untied),
# qwen3_moe (routed experts with a dense layer between sparse ones), qwen2_moe (gated shared expert),
# glm4_moe (sigmoid router with bias and groups, partial RoPE).
TINY_CONFIGS: dict[str, dict] = {
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=250,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=250,
                  max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 8.0, "original_max_position_embeddings": 64},
                  rope_theta=500000.0),
    # 8 experts, top-2, renormalised (Qwen3-30B-A3B's norm_topk_prob); layer 2 dense (mlp_only_layers),
    # so a PP2 split has a dense layer on the second stage; untied like Qwen3-30B-A3B.
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2], num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
                      max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                      tie_word_embeddings=False),
    # Qwen1.5-MoE's shape in small: q/k/v bias, head_dim = hidden / heads, top-4 of 8 not renormalised
    # (norm_topk_prob false), a gated shared expert 3x an expert's width, layer 0 dense (mlp_only_layers).
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=64,
                      intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=96,
                      num_experts=8, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[0], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=250, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=False),
    # GLM-4.5's features in small: q/k/v bias (attention_bias), q/k norm, head_dim 32 != 64 / 4, RoPE over
    # half of each head; layer 0 dense (first_k_dense_replace); 16 sigmoid-routed experts, top-4 within the
    # best 2 of 4 groups (GLM-4.5 has n_group 1; DeepSeek-V3's grouping), a random expert bias, scaling 2.5,
    # one ungated shared expert.
    "glm4_moe": dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], hidden_size=64,
                     intermediate_size=128, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                     n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
                     first_k_dense_replace=1, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                     vocab_size=250, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                     tie_word_embeddings=False),
    # DeepSeek-V3's features in small: MLA with q_lora_rank set (q_a_proj / q_a_layernorm / q_b_proj), q/k head
    # 16 + 8 rope dims, v head 16, YaRN (factor 4 over 64 original positions; mscale != mscale_all_dim so both
    # the rope's and the softmax's factors show); layer 0 dense; 16 sigmoid-routed experts with a random bias,
    # top-4 within the best 2 of 4 groups, scaling 2.5, one shared expert. moe_layer_freq / topk_method /
    # scoring_func: DeepSeek's own config.json keys, which transformers does not define but SGLang reads.
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=64,
                        intermediate_size=128, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
                        first_k_dense_replace=1, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7},
                        vocab_size=250, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                        tie_word_embeddings=False, num_nextn_predict_layers=0, moe_layer_freq=1,
                        topk_method="noaux_tc", scoring_func="sigmoid"),
    # The other MLA shape (DeepSeek-V2-Lite's): q_lora_rank null (one q_proj), other head dims (q/k 32 + 16
    # rope, v 24), no rope scaling; layers 0-1 dense (a PP2 split has a dense and a sparse stage); 8 experts,
    # top-2, no groups, no scaling, two shared experts; tied embeddings.
    "deepseek_v3_lite": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=64,
                             intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                             n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                             n_shared_experts=2, first_k_dense_replace=2, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=32,
                             qk_rope_head_dim=16, v_head_dim=24, vocab_size=250, max_position_embeddings=256,
                             rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                             num_nextn_predict_layers=0, moe_layer_freq=1, topk_method="noaux_tc",
                             scoring_func="sigmoid"),
}


def tiny_hf_config(architecture: str, **overrides):
    """A transformers config object for TINY_CONFIGS[architecture] (+ overrides)."""
    from transformers import AutoConfig

    fields = dict(TINY_CONFIGS[architecture], **overrides)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def save_tiny_hf_model(architecture: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Saves a randomly initialised tiny model (fp32 safetensors + config) to `path`.
    Every tensor, norms and routing biases included, is random so that any mix-up in conversion shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(architecture, **overrides), dtype=torch.float32)
    _randomise(model)
    model.save_pretrained(str(path))
    return Path(path)


def _randomise(model: torch.nn.Module) -> None:
    """Every weight random (norms near 1), and GLM-4.5 / DeepSeek-V3's routing bias buffer too."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.08 * torch.randn_like(buffer))


def save_tiny_hf_reward_model(architecture: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """A tiny random reward model: TINY_CONFIGS[architecture] as *ForSequenceClassification with one
    output (num_labels=1), saved as transformers saves one (its `score` head has no bias)."""
    from transformers import AutoModelForSequenceClassification

    causal = TINY_CONFIGS[architecture]["architectures"][0]
    config = tiny_hf_config(architecture, num_labels=1,
                            architectures=[causal.replace("ForCausalLM", "ForSequenceClassification")], **overrides)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomise(model)
    model.save_pretrained(str(path))
    return Path(path)
