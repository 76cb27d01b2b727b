"""Which attention backend a model is built with (model.attention_backend), and its layer spec.

  te            Transformer Engine's layer spec (its fused attention, THD packing and context
                parallel); refused when transformer_engine does not import.
  torch_varlen  megatron-core's local modules with our core attention, packed micro-batches through
                torch's FlashAttention varlen kernel (ops.torch_varlen; CUDA, torch >= 2.10, bf16),
                under context parallelism too; padded micro-batches as `local`.
  local         megatron-core's local modules with our core attention: ops.varlen_attention's
                (megatron's own for padded batches, plus packed THD sequences) at CP = 1,
                ops.context_parallel's when CP > 1. Runs anywhere (the CPU path).
  auto          te when transformer_engine imports, else torch_varlen when it can run here (CUDA,
                a bf16 model), else local.
The choice and its reason are logged once per process ("attention backend: ...").

MoE models get one spec per layer (block_spec): megatron's MoELayer (router, token dispatcher,
experts) on sparse layers, the dense MLP elsewhere. Experts are megatron's SequentialMLP (one
MLP per local expert, works on CPU) on the local modules and TE's grouped GEMM (TEGroupedMLP)
with Transformer Engine; both hold the same weights per expert."""
from __future__ import annotations

import copy
import logging
from typing import Literal

from megatron_grpo.errors import ConfigError
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.optional import available

log = logging.getLogger(__name__)

# model.attention_backend's values; "memory-model": the local modules with a fused attention's
# memory instead of the CPU kernel (ops/flash_attention_memory.py), for the memory planner's
# fake-tensor models; it computes nothing.
Backend = Literal["auto", "te", "torch_varlen", "local", "memory-model"]
BACKENDS = ("auto", "te", "torch_varlen", "local")
_logged: set[str] = set()  # backends whose choice this process has logged


def resolve_backend(requested: Backend = "auto", dtype=None) -> str:
    """'te', 'torch_varlen' or 'local' ('memory-model' stays itself). `dtype`: the model's, where
    known (torch_varlen needs bf16 / fp16). ConfigError when the requested backend cannot run here.
    The first resolution to each backend in a process logs it with its reason."""
    if requested == "memory-model":
        return requested
    if requested not in BACKENDS:
        raise ConfigError(f"model.attention_backend={requested!r}: expected one of {', '.join(BACKENDS)}")
    from megatron_grpo.ops.torch_varlen import unavailable_reason

    te_ok = available("transformer_engine")
    if requested == "te" and not te_ok:
        raise ConfigError("model.attention_backend=te but transformer_engine does not import: pip install "
                          "'megatron-grpo[gpu]', or set model.attention_backend=torch_varlen (CUDA) or local")
    varlen_problem = unavailable_reason(dtype) if requested in ("auto", "torch_varlen") else None
    if requested == "torch_varlen" and varlen_problem:
        raise ConfigError(f"model.attention_backend=torch_varlen: {varlen_problem}; set model.attention_backend="
                          "local (or auto)")
    if requested != "auto":
        backend, why = requested, f"model.attention_backend={requested}"
    elif te_ok:
        backend, why = "te", "auto: transformer_engine imports"
    elif varlen_problem is None:
        import torch

        backend = "torch_varlen"
        why = f"auto: transformer_engine not installed; CUDA, torch {torch.__version__}'s varlen_attn"
    else:
        backend, why = "local", f"auto: transformer_engine not installed; torch_varlen not usable: {varlen_problem}"
    if backend not in _logged:
        _logged.add(backend)
        log.info("attention backend: %s (%s)", backend, why)
    return backend


def layer_spec(model_config: ModelArchitecture, context_parallel: int = 1, backend: Backend = "auto",
               sparse: bool = False):
    """The ModuleSpec of one decoder layer (a MoE layer with `sparse`)."""
    from megatron_grpo.launch.mcore_compat import local_layer_spec, transformer_engine_layer_spec

    experts = model_config.num_experts if sparse else None
    backend = resolve_backend(backend)
    mla = model_config.is_mla  # megatron's MLASelfAttention; qk_layernorm builds its q_a / kv_a RMSNorms
    if backend == "te":
        # TE's attention implements context parallelism itself.
        return transformer_engine_layer_spec(qk_layernorm=model_config.qk_norm or mla, num_experts=experts,
                                             moe_grouped_gemm=sparse, multi_latent_attention=mla)
    if mla and backend == "torch_varlen":
        raise ConfigError("model.attention_backend=torch_varlen: multi-head latent attention's value head differs "
                          "from its q/k head, which our varlen_attn path does not take; use model.attention_backend="
                          "local or te")
    if backend == "torch_varlen" and model_config.attention_dropout > 0:
        raise ConfigError(f"model.attention_backend=torch_varlen: the model's attention_dropout="
                          f"{model_config.attention_dropout}, but torch's varlen_attn has no dropout; use "
                          "model.attention_backend=local")
    spec = copy.deepcopy(local_layer_spec(qk_layernorm=model_config.qk_norm or mla, normalization="RMSNorm",
                                          num_experts=experts, multi_latent_attention=mla))
    spec.submodules.self_attention.submodules.core_attention = core_attention(backend, context_parallel)
    if mla:  # un-split down projections (see mcore_compat.replicated_linear: megatron's split ones are wrong at TP > 1)
        from megatron_grpo.launch.mcore_compat import replicated_linear

        attention = spec.submodules.self_attention.submodules
        attention.linear_q_down_proj = attention.linear_kv_down_proj = replicated_linear()
        if not model_config.q_lora_rank:  # one q_proj, no q_a_layernorm (megatron-core 0.19 refuses an unused one)
            from megatron.core.transformer.identity_op import IdentityOp

            attention.q_layernorm = IdentityOp
    return spec


def core_attention(backend: str, context_parallel: int = 1) -> type:
    """The core-attention module of the local spec for a resolved backend (not te)."""
    if backend == "memory-model":
        from megatron_grpo.ops.flash_attention_memory import FlashAttentionMemoryModel

        return FlashAttentionMemoryModel
    if backend == "torch_varlen":
        from megatron_grpo.ops.torch_varlen import TorchVarlenContextParallelAttention, TorchVarlenDotProductAttention

        return TorchVarlenContextParallelAttention if context_parallel > 1 else TorchVarlenDotProductAttention
    if context_parallel > 1:
        # megatron's local DotProductAttention asserts CP == 1 and refuses packed sequences.
        from megatron_grpo.ops.context_parallel import ContextParallelDotProductAttention

        return ContextParallelDotProductAttention
    # megatron's DotProductAttention for padded batches, ours for packed ones.
    from megatron_grpo.ops.varlen_attention import PackedDotProductAttention

    return PackedDotProductAttention


def block_spec(model_config: ModelArchitecture, config, context_parallel: int = 1, backend: Backend = "auto",
               vp_stage: int | None = None):
    """What GPTModel's transformer_layer_spec takes for this rank's pipeline stage: one layer spec
    for dense models; for MoE models the block of this stage's layers, each sparse or dense."""
    if not model_config.is_moe:
        return layer_spec(model_config, context_parallel, backend)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_grpo.launch.mcore_compat import stage_layer_range

    dense = layer_spec(model_config, context_parallel, backend)
    sparse = layer_spec(model_config, context_parallel, backend, sparse=True)
    first, count = stage_layer_range(config, vp_stage)
    layers = [sparse if i in model_config.moe_layers else dense for i in range(first, first + count)]
    # The final norm: the module megatron picks for a single-layer spec (TE's, apex's or torch's).
    from megatron.core.transformer.transformer_block import LayerNormImpl

    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)
