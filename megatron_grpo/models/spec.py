"""Which transformer-layer implementation to build: Transformer Engine's when it imports, else
megatron-core's local modules with our core attention: ops.varlen_attention's (megatron's own for
padded batches, plus packed THD sequences) at CP = 1, ops.context_parallel's when CP > 1."""
from __future__ import annotations

import copy
import functools
import logging
from typing import Literal

from megatron_grpo.errors import ConfigError
from megatron_grpo.models.hf_config import ModelConfig
from megatron_grpo.optional import available

log = logging.getLogger(__name__)

Backend = Literal["auto", "te", "local"]


@functools.lru_cache(maxsize=None)
def resolve_backend(requested: Backend = "auto") -> str:
    """'te' or 'local'; the automatic choice is logged once per process."""
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


def layer_spec(model_config: ModelConfig, context_parallel: int = 1, backend: Backend = "auto"):
    """The ModuleSpec of one decoder layer."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    if resolve_backend(backend) == "te":
        # TE's attention implements context parallelism itself.
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model_config.qk_norm)
    spec = copy.deepcopy(get_gpt_layer_local_spec(qk_layernorm=model_config.qk_norm, normalization="RMSNorm"))
    if context_parallel > 1:
        # megatron's local DotProductAttention asserts CP == 1 and refuses packed sequences.
        from megatron_grpo.ops.context_parallel import ContextParallelDotProductAttention as core_attention
    else:
        # megatron's DotProductAttention for padded batches, ours for packed ones.
        from megatron_grpo.ops.varlen_attention import PackedDotProductAttention as core_attention
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec
