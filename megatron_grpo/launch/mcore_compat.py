"""The one place for megatron-core calls whose signature, location or console output differs
between versions.

CI runs two lanes: megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12, the clusters'
0.17-0.19). Differences checked against the 0.16.1 and 0.19.2 sources:

  * get_gpt_layer_local_spec / get_gpt_layer_with_transformer_engine_spec: 0.19 forwards
    *args/**kwargs to get_gpt_layer_*_submodules and dropped `moe_use_legacy_grouped_gemm`; the
    TE spec takes no `normalization` (TE reads config.normalization). local_layer_spec /
    transformer_engine_layer_spec pass keywords only, and only those both versions accept.
  * DistributedOptimizer.sharded_state_dict: the default sharding ('fully_sharded_model_space')
    fails to save on both versions (flattened_range), so we ask for 'fully_reshardable': one
    model-space tensor per parameter and state (gathered over DP at save), so a checkpoint loads
    at any TP / PP / DP (CI runs the resume-layout tests on 0.16.1; 0.19.2 runs the fast suite's
    save/resume tests). Checkpoints saved as 'dp_reshardable' (before) load by passing that
    sharding_type (save and load must agree; it reshards across DP sizes only).
  * dist_checkpointing.save/load: 0.19 removed `common_strategy` and added `async_strategy`
    (default "nvrx", needs nvidia-resiliency-ext); we only use the synchronous defaults.
  * The results-queue Manager of the checkpoint writers: 0.16 creates it in
    filesystem_async._get_write_results_queue(), 0.19 in get_write_results_queue(mp_mode)
    (checkpoint_results_queue_factory; launch/lifetime.py ties the Manager to the trainer).
  * DDP grad sync calls torch.cuda.current_stream() in 0.19 (handled by launch/cpu.py on CPU).
  * GPTModel: 0.19 deprecates it in favour of HybridModel (a layer pattern such as "*-*-", one
    attention and one MLP layer per transformer layer). GPTModel still builds and trains the same
    network on 0.19, so models/builder.py keeps it; the move to HybridModel is described in
    docs/architecture.md ("Version-specific code").
Everything else the project calls (initialize_model_parallel, GPTModel, get_forward_backward_func,
finalize_model_grads, get_megatron_optimizer, model_parallel_cuda_manual_seed) has the same
keywords in both versions.

Console notices (KNOWN_NOTICES): messages megatron-core (and torch underneath it) prints on every
run that ask nothing of a user of this project. The command-line entry points silence exactly
those (quiet_known_notices), so a one-line error is the only line a failed command prints.
"""
from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

DIST_OPTIMIZER_CKPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def megatron_core_version() -> tuple[int, int, int]:
    from megatron.core import package_info

    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def local_layer_spec(*, qk_layernorm: bool, normalization: str, num_experts: int | None = None) -> Any:
    """Transformer-layer spec built from megatron-core's own modules (no TE): works on CPU. With
    num_experts a MoE layer whose experts are SequentialMLP (one local MLP per expert)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization,
                                    num_experts=num_experts, moe_grouped_gemm=False)


def transformer_engine_layer_spec(*, qk_layernorm: bool, num_experts: int | None = None,
                                  moe_grouped_gemm: bool = False) -> Any:
    """Transformer-layer spec with TE modules (fused norms/attention); needs transformer_engine.
    With num_experts a MoE layer (TE's grouped GEMM experts with moe_grouped_gemm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, num_experts=num_experts,
                                                      moe_grouped_gemm=moe_grouped_gemm)


def stage_layer_range(config: Any, vp_stage: int | None) -> tuple[int, int]:
    """(global index of the first layer, number of layers) megatron builds on this rank's pipeline
    stage (and virtual stage): the same functions its TransformerBlock uses (both versions)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage=vp_stage), get_num_layers_to_build(config, vp_stage=vp_stage)


def optimizer_sharded_state_dict(optimizer: Any, model_sharded_state_dict: dict, *, is_loading: bool,
                                 sharding_type: str | None = None) -> dict:
    """The optimizer's sharded state dict in the format that saves and resumes on every version
    (or, to load an older checkpoint, in the distributed optimizer's `sharding_type` it used).

    Also valid for a non-distributed (or chained) megatron optimizer, which ignores `metadata`."""
    metadata = dict(DIST_OPTIMIZER_CKPT_METADATA)
    if sharding_type is not None:
        metadata["distrib_optim_sharding_type"] = sharding_type
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)


# Where each version keeps the function that creates the checkpoint writers' results-queue Manager.
_RESULTS_QUEUE_FACTORIES = ("get_write_results_queue",   # 0.19: get_write_results_queue(mp_mode="spawn")
                            "_get_write_results_queue")  # 0.16: _get_write_results_queue()


def checkpoint_results_queue_factory() -> tuple[ModuleType, str] | None:
    """(megatron's filesystem_async module, the name of its results-queue function), or None when
    this megatron-core has neither known function (or no module-level `_results_queue` cache)."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return None
    if not hasattr(filesystem_async, "_results_queue"):
        return None
    for name in _RESULTS_QUEUE_FACTORIES:
        if callable(getattr(filesystem_async, name, None)):
            return filesystem_async, name
    return None


# ----------------------------------------------------------------------------- console notices


@dataclass(frozen=True)
class Notice:
    """One known console message: `pattern` matches the start of its text; `logger` is None for a
    Python warning (warnings.warn), else the logger that emits it."""

    pattern: str
    logger: str | None
    why: str


KNOWN_NOTICES = (
    Notice(r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed", None,
           "TE / apex fallbacks (every version, CPU and TE-less GPUs); models/spec.py logs its choice once"),
    Notice(r"full scope is deprecated", None, "a torch deprecation inside megatron-core's own calls"),
    Notice(r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated", None,
           "a torch deprecation inside megatron-core's own calls"),
    Notice(r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", None,
           "megatron-core's grad-buffer bookkeeping"),
    Notice(r"`load_state_dict` is deprecated", None, "torch DCP, inside megatron's checkpoint loading"),
    Notice(r"Please use DTensor instead", None, "torch DCP, inside megatron's checkpoint loading"),
    Notice(r"absl\.logging is not installed", None,
           "0.19 (hyper_comm_grid, at import): falls back to the logging module, which is what we use"),
    Notice(r"MimoModelConfig is experimental", None, "0.19 defines the class at import; nothing here uses it"),
    Notice(r"GPTModel IS DEPRECATED", "megatron.core.models.gpt.gpt_model",
           "0.19: GPTModel still builds the same network; the HybridModel move is in docs/architecture.md"),
    Notice(r"DistributedDataParallel: full_param_layout not provided",
           "megatron.core.distributed.distributed_data_parallel",
           "0.19 then computes the layout itself with DistributedOptimizer.compute_full_param_layout over "
           "the same parameters, bucket size and DP group a caller would pass"),
    Notice(r"MCore's async save is deprecated", "megatron.core.dist_checkpointing.strategies.torch",
           "0.19's synchronous save runs through its own 'mcore' async path and warns about that path; "
           "we save synchronously"),
    Notice(r"No CUDA runtime is found", "torch.utils.cpp_extension",
           "a CUDA build of torch on a machine without a GPU (CI's 3.12 lane)"),
)


class _DropNotices(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def quiet_known_notices() -> None:
    """Silences KNOWN_NOTICES (and nothing else) in this process: warning filters, and a filter on
    each emitting logger. Call before megatron-core is imported: some notices come at import time.
    Idempotent."""
    by_logger: dict[str, list[str]] = {}
    for notice in KNOWN_NOTICES:
        if notice.logger is None:
            warnings.filterwarnings("ignore", message=notice.pattern)
        else:
            by_logger.setdefault(notice.logger, []).append(notice.pattern)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotices) for f in logger.filters):
            logger.addFilter(_DropNotices(patterns))
