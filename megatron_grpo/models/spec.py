"""Which transformer-layer implementation to build: Transformer Engine's when it imports, else
megatron-core's local modules with our core attention: ops.varlen_attention's (megatron's own for
padded batches, plus packed THD sequences) at CP = 1, ops.context_parallel's when CP > 1.

MoE models get one spec per layer (block_spec): megatron's MoELayer (router, token dispatcher,
experts) on sparse layers, the dense MLP elsewhere. Experts are megatron's SequentialMLP (one
MLP per local expert, works on CPU) on the local backend and TE's grouped GEMM (TEGroupedMLP)
with Transformer Engine; both hold the same weights per expert."""
from __future__ import annotations

import copy
import functools
import logging
from typing import Literal

from megatron_grpo.errors import ConfigError
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.optional import available

log = logging.getLogger(__name__)

# "memory-model": the local modules with a fused attention's memory instead of the CPU kernel
# (ops/flash_attention_memory.py), for the memory planner's fake-tensor models; it computes nothing.
Backend = Literal["auto", "te", "local", "memory-model"]


@functools.lru_cache(maxsize=None)
def resolve_backend(requested: Backend = "auto") -> str:
    """'te' or 'local'; the automatic choice is logged once per process."""
    if requested == "memory-model":
        return "local"
    if requested not in ("auto", "te", "local"):
        raise ConfigError(f"model layer backend {requested!r}: expected auto, te or local")
    te_ok = available("transformer_engine")
    if requested == "te" and not te_ok:
        raise ConfigError("layer backend 'te' requested but transformer_engine does not import: "
                          "pip install 'megatron-grpo[gpu]'")
    backend = "te" if requested == "te" or (requested == "auto" and te_ok) else "local"
    log.info("transformer layer spec: %s (%s)", backend,
             "Transformer Engine" if backend == "te" else "megatron-core local modules, transformer_engine "
             "not used" + ("" if te_ok else " (not installed)"))
    return backend


def layer_spec(model_config: ModelArchitecture, context_parallel: int = 1, backend: Backend = "auto",
               sparse: bool = False):
    """The ModuleSpec of one decoder layer (a MoE layer with `sparse`)."""
    from megatron_grpo.launch.mcore_compat import local_layer_spec, transformer_engine_layer_spec

    experts = model_config.num_experts if sparse else None
    if resolve_backend(backend) == "te":
        # TE's attention implements context parallelism itself.
        return transformer_engine_layer_spec(qk_layernorm=model_config.qk_norm, num_experts=experts,
                                             moe_grouped_gemm=sparse)
    spec = copy.deepcopy(local_layer_spec(qk_layernorm=model_config.qk_norm, normalization="RMSNorm",
                                          num_experts=experts))
    if backend == "memory-model":
        from megatron_grpo.ops.flash_attention_memory import FlashAttentionMemoryModel as core_attention
    elif context_parallel > 1:
        # megatron's local DotProductAttention asserts CP == 1 and refuses packed sequences.
        from megatron_grpo.ops.context_parallel import ContextParallelDotProductAttention as core_attention
    else:
        # megatron's DotProductAttention for padded batches, ours for packed ones.
        from megatron_grpo.ops.varlen_attention import PackedDotProductAttention as core_attention
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


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
