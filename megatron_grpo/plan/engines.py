"""SGLang engine memory and the weight-sync volume, from the model's shapes (arithmetic: SGLang's
GPU runtime does not run here).

SGLang's --mem-fraction-static is the share of a GPU's memory for the weights and the KV cache
pool together (model_runner: rest = available - total x (1 - mem_fraction)); the rest is left to
activations and CUDA graphs. Its KV pool holds, per token and GPU, K and V of every layer for
the KV heads of that TP rank (replicated when tp_size exceeds the KV heads), in the KV dtype
(bf16 for a bf16 model unless --kv-cache-dtype says otherwise).

Multi-head latent attention (DeepSeek-V3) caches no per-head K and V: SGLang 0.5.23's MLATokenToKVPool
(sglang/srt/mem_cache/memory_pool.py:4793-4797 kv_cache_dim = kv_lora_rank + qk_rope_head_dim, and
:4864-4870 one [size + page_size, 1, kv_cache_dim] buffer of the KV dtype per layer) holds the compressed
latent and the shared rope key, one "head" per token and layer. It is built without the TP size
(kv_cache_configurator.py:2485-2497), so every TP rank holds the whole of it, and the model runner sizes
the pool with the same per-token cell (model_executor/pool_configurator.py:378-385, not divided by TP).
Its down projections (fused_qkv_a_proj_with_mqa or kv_a_proj_with_mqa, models/deepseek_v2.py:2070, 2095)
are ReplicatedLinear: whole on every TP rank, as they are in our trainer."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.config.schema import Config
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.plan.cluster import Cluster, Placement


@dataclass(frozen=True)
class EnginePlan:
    engines: int
    tp_size: int
    weights_per_gpu: int  # bytes
    kv_bytes_per_token_per_gpu: int
    kv_pool_per_gpu: int  # bytes; <= 0: the weights do not fit in mem_fraction
    capacity_tokens: int  # per engine
    step_tokens_per_engine: int  # the step's sequences at full length, spread over the engines
    sequences_per_engine: int

    @property
    def fits(self) -> bool:
        return self.kv_pool_per_gpu > 0

    @property
    def step_in_flight(self) -> bool:
        return self.capacity_tokens >= self.step_tokens_per_engine


@dataclass(frozen=True)
class SyncPlan:
    model_bytes: int  # bf16 HF tensors, the whole model
    largest_stage_bytes: int  # the most one pipeline stage's sender pushes (stages push in parallel)
    link_gbps: float
    route: str

    @property
    def seconds(self) -> float:
        return self.largest_stage_bytes / (self.link_gbps * 1e9 / 8)


def mla_down_projection_count(arch: ModelArchitecture) -> int:
    """One layer's MLA down projections (q_a_proj when q_lora_rank is set, kv_a_proj_with_mqa): SGLang
    keeps them whole on every TP rank."""
    return arch.hidden_size * (arch.q_lora_rank + arch.kv_lora_rank + arch.qk_rope_head_dim) if arch.is_mla else 0


def _attention_count(arch: ModelArchitecture) -> int:
    """One layer's attention parameters, its input norm and the MLP's (post-attention) norm included."""
    h, heads, groups, d = arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    if arch.is_mla:  # transformers' DeepseekV3Attention (no biases: attention_bias is refused)
        # q_a_layernorm + q_b_proj, or q_proj; kv_a_layernorm + kv_b_proj
        q = arch.q_lora_rank + arch.q_lora_rank * heads * d if arch.q_lora_rank else h * heads * d
        kv = arch.kv_lora_rank + arch.kv_lora_rank * heads * (arch.qk_nope_head_dim + arch.v_head_dim)
        return mla_down_projection_count(arch) + q + kv + heads * arch.v_head_dim * h + 2 * h  # ..., o, two norms
    attention = h * heads * d + 2 * h * groups * d + heads * d * h + 2 * h  # q, k, v, o, two norms
    if arch.qkv_bias:
        attention += heads * d + 2 * groups * d
    if arch.qk_norm:
        attention += 2 * d
    return attention


def kv_bytes_per_token(arch: ModelArchitecture, tp_size: int, dtype_bytes: int = 2) -> int:
    """Bytes one token's KV cache takes on each GPU of an engine (module docstring): K and V of the rank's
    KV heads, or MLA's latent + rope key, whole on every rank."""
    if arch.is_mla:
        return arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * dtype_bytes
    return 2 * arch.num_layers * max(1, arch.num_query_groups // tp_size) * arch.head_dim * dtype_bytes


def parameter_count(arch: ModelArchitecture) -> int:
    """Parameters of the HF model (embedding + layers + final norm + untied head); MTP layers (not
    trained, not loaded by SGLang's main model) are not counted."""
    h = arch.hidden_size
    attention = _attention_count(arch)
    dense_mlp = 3 * h * arch.ffn_hidden_size
    moe_mlp = arch.num_experts * 3 * h * arch.moe_ffn_hidden_size + arch.num_experts * h  # experts + router
    moe_mlp += 3 * h * arch.shared_expert_ffn_hidden_size + (h if arch.shared_expert_gate else 0)  # shared experts
    layers = sum(attention + (moe_mlp if i in arch.moe_layers else dense_mlp) for i in range(arch.num_layers))
    embedding = arch.vocab_size * h
    return layers + embedding * (1 if arch.tie_word_embeddings else 2) + h


def engine_plan(cfg: Config, arch: ModelArchitecture, cluster: Cluster) -> EnginePlan | None:
    if cfg.rollout.engine != "sglang":
        return None
    s = cfg.rollout.sglang
    replicated = arch.num_layers * mla_down_projection_count(arch)  # whole on every TP rank
    weights_per_gpu = 2 * ((parameter_count(arch) - replicated) // s.tp_size + replicated)  # bf16
    kv_per_token = kv_bytes_per_token(arch, s.tp_size)
    pool = int(s.mem_fraction * cluster.gpu_memory_bytes) - weights_per_gpu
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    per_engine = -(-sequences // s.num_engines)
    length = cfg.data.max_prompt_length + cfg.data.max_response_length
    return EnginePlan(engines=s.num_engines, tp_size=s.tp_size, weights_per_gpu=weights_per_gpu,
                      kv_bytes_per_token_per_gpu=kv_per_token, kv_pool_per_gpu=pool,
                      capacity_tokens=max(0, pool) // kv_per_token, step_tokens_per_engine=per_engine * length,
                      sequences_per_engine=per_engine)


def sync_plan(cfg: Config, arch: ModelArchitecture, placement: Placement, cluster: Cluster) -> SyncPlan | None:
    if cfg.rollout.engine != "sglang":
        return None
    model_bytes = 2 * parameter_count(arch)
    stages = cfg.parallel.pipeline
    route = {"distributed": "NCCL broadcast, each stage's sender to every engine",
             "tensor": "CUDA IPC on each GPU (no network)",
             "disk": "safetensors files on the shared folder"}[cfg.rollout.sglang.weight_sync]
    # NCCL's broadcast pipelines a stage's bytes through a ring: each link carries them once.
    largest = model_bytes // stages if cfg.rollout.sglang.weight_sync == "distributed" else model_bytes
    return SyncPlan(model_bytes=model_bytes, largest_stage_bytes=largest, link_gbps=cluster.link_gbps, route=route)
