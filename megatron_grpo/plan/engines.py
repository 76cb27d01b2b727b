"""SGLang engine memory and the weight-sync volume, from the model's shapes (arithmetic: SGLang's
GPU runtime does not run here).

SGLang's --mem-fraction-static is the share of a GPU's memory for the weights and the KV cache
pool together (model_runner: rest = available - total x (1 - mem_fraction)); the rest is left to
activations and CUDA graphs. Its KV pool holds, per token and GPU, K and V of every layer for
the KV heads of that TP rank (replicated when tp_size exceeds the KV heads), in the KV dtype
(bf16 for a bf16 model unless --kv-cache-dtype says otherwise)."""
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


def parameter_count(arch: ModelArchitecture) -> int:
    """Parameters of the HF model (embedding + layers + final norm + untied head)."""
    h, heads, groups, d = arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    attention = h * heads * d + 2 * h * groups * d + heads * d * h + 2 * h  # q, k, v, o, two norms
    if arch.qkv_bias:
        attention += heads * d + 2 * groups * d
    if arch.qk_norm:
        attention += 2 * d
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
    weight_bytes = 2 * parameter_count(arch)  # bf16
    weights_per_gpu = weight_bytes // s.tp_size
    kv_heads = max(1, arch.num_query_groups // s.tp_size)
    kv_per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * 2
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
