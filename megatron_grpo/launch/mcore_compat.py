"""The one place for megatron-core calls whose signature or default differs between versions.

CI runs megatron-core 0.16.1 (Python 3.11); clusters run 0.17-0.19 (Python 3.12). Differences
checked against the 0.16.1 and 0.19.2 sources:

  * get_gpt_layer_local_spec / get_gpt_layer_with_transformer_engine_spec: 0.19 forwards
    *args/**kwargs to get_gpt_layer_*_submodules and dropped `moe_use_legacy_grouped_gemm`; the
    TE spec takes no `normalization` (TE reads config.normalization). We pass keywords only, and
    only those both versions accept.
  * DistributedOptimizer.sharded_state_dict: the default sharding ('fully_sharded_model_space')
    fails to save on both versions (flattened_range), so we ask for 'fully_reshardable': one
    model-space tensor per parameter and state (gathered over DP at save), so a checkpoint loads
    at any TP / PP / DP (run on 0.16.1; 0.19.2 not yet run, Megatron-LM main still lists it in
    checkpoint_fully_reshardable_formats). Checkpoints saved as 'dp_reshardable' (before) load by
    passing that sharding_type (save and load must agree; it reshards across DP sizes only).
  * dist_checkpointing.save/load: 0.19 removed `common_strategy` and added `async_strategy`
    (default "nvrx", needs nvidia-resiliency-ext); we only use the synchronous defaults.
  * DDP grad sync calls torch.cuda.current_stream() in 0.19 (handled by launch/cpu.py on CPU).
Everything else the project calls (initialize_model_parallel, GPTModel, get_forward_backward_func,
finalize_model_grads, get_megatron_optimizer, model_parallel_cuda_manual_seed) has the same
keywords in both versions.
"""
from __future__ import annotations

from typing import Any

from megatron_grpo.errors import LaunchError

MIN_VERSION = (0, 16, 1)
DIST_OPTIMIZER_CKPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def megatron_core_version() -> tuple[int, int, int]:
    from megatron.core import package_info

    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def check_megatron_core_version() -> tuple[int, int, int]:
    """Raises LaunchError below MIN_VERSION; returns the installed version."""
    version = megatron_core_version()
    if version < MIN_VERSION:
        wanted = ".".join(map(str, MIN_VERSION))
        raise LaunchError(f"megatron-core {'.'.join(map(str, version))} is too old; install megatron-core>={wanted}")
    return version


def local_layer_spec(*, qk_layernorm: bool, normalization: str) -> Any:
    """Transformer-layer spec built from megatron-core's own modules (no TE): works on CPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization)


def transformer_engine_layer_spec(*, qk_layernorm: bool) -> Any:
    """Transformer-layer spec with TE modules (fused norms/attention); needs transformer_engine."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)


def optimizer_sharded_state_dict(optimizer: Any, model_sharded_state_dict: dict, *, is_loading: bool,
                                 sharding_type: str | None = None) -> dict:
    """The optimizer's sharded state dict in the format that saves and resumes on every version
    (or, to load an older checkpoint, in the distributed optimizer's `sharding_type` it used).

    Also valid for a non-distributed (or chained) megatron optimizer, which ignores `metadata`."""
    metadata = dict(DIST_OPTIMIZER_CKPT_METADATA)
    if sharding_type is not None:
        metadata["distrib_optim_sharding_type"] = sharding_type
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)
