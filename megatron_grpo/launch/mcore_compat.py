"""The one place for megatron-core calls whose signature, location or console output differs
between versions.

CI runs two lanes: megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12, the clusters'
0.17-0.19). Differences checked against the 0.16.1 and 0.19.2 sources:

  * get_gpt_layer_local_spec / get_gpt_layer_with_transformer_engine_spec: 0.19 forwards
    *args/**kwargs to get_gpt_layer_*_submodules and dropped `moe_use_legacy_grouped_gemm`; the
    TE spec takes no `normalization` (TE reads config.normalization). local_layer_spec /
    transformer_engine_layer_spec pass keywords only, and only those both versions accept.
  * DistributedOptimizer.sharded_state_dict: megatron-core's default sharding
    ('fully_sharded_model_space') fails to save on both versions: it marks each rank's slice of a
    parameter's state with ShardedTensor.flattened_range, which ShardedTensor refuses since 0.14
    ("flattened_range is not supported"). We build that format ourselves from boxes of the
    model-space tensors (model_space_param_state below) and save it: nothing is gathered, every rank
    writes and reads only its own slices, and a checkpoint loads at any TP / PP / DP (measured
    against megatron's 'fully_reshardable', which all-gathers the state over DP into DP-full copies
    on every rank: benchmarks/bench_checkpoint.py, docs/checkpoints.md). Checkpoints saved as
    'fully_reshardable' (the format before) or 'dp_reshardable' (before that; it reshards across DP
    only) load through megatron's own path for that sharding_type (save and load must agree).
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

import contextlib
import logging
import math
import re
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

FULLY_SHARDED_MODEL_SPACE = "fully_sharded_model_space"
DIST_OPTIMIZER_CKPT_METADATA = {"distrib_optim_sharding_type": FULLY_SHARDED_MODEL_SPACE}


def megatron_core_version() -> tuple[int, int, int]:
    from megatron.core import package_info

    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def local_layer_spec(*, qk_layernorm: bool, normalization: str, num_experts: int | None = None,
                     multi_latent_attention: bool = False) -> Any:
    """Transformer-layer spec built from megatron-core's own modules (no TE): works on CPU. With
    num_experts a MoE layer whose experts are SequentialMLP (one local MLP per expert); with
    multi_latent_attention megatron's MLASelfAttention (qk_layernorm then builds its q_a / kv_a norms)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization,
                                    num_experts=num_experts, moe_grouped_gemm=False,
                                    multi_latent_attention=multi_latent_attention)


def transformer_engine_layer_spec(*, qk_layernorm: bool, num_experts: int | None = None,
                                  moe_grouped_gemm: bool = False, multi_latent_attention: bool = False) -> Any:
    """Transformer-layer spec with TE modules (fused norms/attention); needs transformer_engine.
    With num_experts a MoE layer (TE's grouped GEMM experts with moe_grouped_gemm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, num_experts=num_experts,
                                                      moe_grouped_gemm=moe_grouped_gemm,
                                                      multi_latent_attention=multi_latent_attention)


@contextlib.contextmanager
def mla_without_transformer_engine():
    """Around building megatron-core's MLASelfAttention when transformer_engine does not import.

    0.16.1: multi_latent_attention.py sets HAVE_TE from importing megatron.core.extensions.transformer_engine,
    which imports without TE (it puts a MagicMock in TE's place), so HAVE_TE is True and TELinear a MagicMock;
    MultiLatentAttention.__init__ then calls isinstance(self.linear_proj, TELinear), a TypeError ("arg 2 must
    be a type"). HAVE_TE is set to what it means (False) inside this block only, restored after; nothing else
    of the module reads it (its forward does not).
    0.19: HAVE_TE is False without TE, and the module then binds the model-opt `Linear` to None, so its check
    of the down projections' class refuses replicated_linear() ("Unsupported linear_q_down_proj"); inside
    this block the name is the class it stands for. 0.19 also resolves the q / kv norms and up projections
    from config.qk_layernorm (mla_qk_norm_config.py), which cannot say "no q norm, a kv norm" for a model
    without q_lora_rank (DeepSeek-V2-Lite's layout: it asks for a fused norm + q_proj, a norm HF's model does
    not have); inside this block the layer spec's own classes are built, as 0.16.1 builds them. With TE
    installed (TELinear a class) this does nothing."""
    from megatron.core.transformer import multi_latent_attention

    if isinstance(multi_latent_attention.TELinear, type):
        yield
        return
    attention = multi_latent_attention.MLASelfAttention
    have_te = multi_latent_attention.HAVE_TE
    linear_unbound = "Linear" in vars(multi_latent_attention) and multi_latent_attention.Linear is None  # 0.19
    resolver = vars(attention).get("_resolve_qk_norm_config")  # 0.19
    multi_latent_attention.HAVE_TE = False
    if linear_unbound:
        multi_latent_attention.Linear = replicated_linear()
    if resolver is not None:
        attention._resolve_qk_norm_config = _mla_spec_as_given
    try:
        yield
    finally:
        multi_latent_attention.HAVE_TE = have_te
        if linear_unbound:
            multi_latent_attention.Linear = None
        if resolver is not None:
            attention._resolve_qk_norm_config = resolver


def _mla_spec_as_given(self, submodules) -> dict:
    return {name: getattr(submodules, name)
            for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "q_layernorm", "kv_layernorm")}


def replicated_linear() -> type:
    """megatron-core's one un-split linear layer that MLASelfAttention accepts for its down projections
    (it checks the class against [Linear, TEColumnParallelLinear, ColumnParallelLinear]): the model-opt
    Linear (a torch Linear; its weight marked sequence_parallel, so its gradient is all-reduced over TP).
    The local spec's ColumnParallelLinear there is wrong in backward at TP > 1 in 0.16.1: the gathered
    kv_a output's rope part (k_pos_emb) feeds every rank's own heads, and the gather's backward keeps each
    rank's slice without summing the other ranks' heads' gradients (the first GRPO step at TP2 differed from
    one process by ~5% in every update; tests/test_deepseek_v3.py). With this Linear under sequence
    parallelism megatron gathers k_pos_emb over the sequence (backward: reduce-scatter, which sums)."""
    from megatron.core.post_training.modelopt.layers import Linear

    return Linear


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

    'fully_sharded_model_space' is built here (model_space_param_state), not by megatron-core.
    Also valid for a non-distributed (or chained) megatron optimizer, which ignores `metadata`."""
    sharding_type = sharding_type or DIST_OPTIMIZER_CKPT_METADATA["distrib_optim_sharding_type"]
    if sharding_type == FULLY_SHARDED_MODEL_SPACE:
        built = _model_space_state_dict(optimizer, model_sharded_state_dict, is_loading=is_loading)
        if built is not None:
            return built
    metadata = dict(DIST_OPTIMIZER_CKPT_METADATA, distrib_optim_sharding_type=sharding_type)
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)


# ----------------------------------------------------------------------------- model space, no gather
#
# megatron-core's 'fully_sharded_model_space' (DistributedOptimizer.sharded_param_state_fs_model_space)
# describes each rank's slice of a parameter's optimizer state as the parameter's ShardedTensor plus
# `flattened_range` (a range of the flattened TP-local tensor). Since 0.14 ShardedTensor refuses
# flattened_range (mapping.py, validate_metadata_integrity: "ShardedTensor.flattened_range is not
# supported"; 0.16.1 and 0.19.2 alike), so the format fails before anything is written. The same
# slice is a union of at most 2 x ndim - 1 boxes of the model-space tensor (a partial row, whole
# rows, a partial row; recursively for more dimensions), and megatron saves and loads unevenly
# sharded tensors made of boxes (CheckpointableShardedTensor over torch DCP, torch >= 2.6). So the
# format is rebuilt here from boxes: every data-parallel rank writes its own slices (views of its
# optimizer state, nothing gathered), reads exactly the boxes it holds at any TP / PP / DP (DCP
# reads the overlap with whatever chunks were saved), and the files hold the tensors
# 'fully_reshardable' writes (same keys 'optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>',
# same shapes, fp32; tests/test_checkpoint_formats.py compares them bitwise). Each format still
# loads through its own sharded state dict: the sharding type in the checkpoint's common state
# picks megatron's load path (load_state_dict), and the two paths expect different tensors.


def _flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple, tuple, int]]:
    """(offset, size, first flat index) of the boxes that cover the flat elements [start, stop) of
    a row-major tensor of `shape`, in flat order."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])

    def within_row(row: int, lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
        return [((row, *offset), (1, *size), row * inner + first)
                for offset, size, first in _flat_range_boxes(shape[1:], lo, hi)]

    first_row, last_row = start // inner, (stop - 1) // inner
    if first_row == last_row:
        return within_row(first_row, start - first_row * inner, stop - first_row * inner)
    boxes, row = [], first_row
    if start % inner:
        boxes += within_row(first_row, start % inner, inner)
        row += 1
    full_end = stop // inner
    if full_end > row:
        boxes.append(((row,) + (0,) * (len(shape) - 1), (full_end - row, *shape[1:]), row * inner))
    if stop % inner:
        boxes += within_row(full_end, 0, stop % inner)
    return boxes


def _model_pieces(metadata: Any, replica_id: Any) -> list[tuple[int, Any]]:
    """(first flat index in the TP-local parameter, ShardedTensor) for each contiguous piece the
    parameter is saved as: itself, or what its ShardedTensorFactory builds (the SwiGLU fc1 weight:
    its two halves, each a different region of the model-space tensor). The factory is run on the
    parameter itself: it makes views, whose offsets in the parameter's storage say where they lie."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if not isinstance(metadata, ShardedTensorFactory):
        return [(0, metadata)]
    param = metadata.data
    pieces = []
    for sub in nested_values(metadata.build_fn(metadata.key, param, replica_id, None)):
        if (not isinstance(sub, ShardedTensor) or not sub.data.is_contiguous()
                or sub.data.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()):
            raise ValueError(f"{metadata.key}: its sharded-tensor factory builds a piece that is not a contiguous "
                             f"range of the parameter ({type(sub).__name__}); 'fully_sharded_model_space' cannot "
                             f"describe it")
        pieces.append((sub.data.storage_offset() - param.storage_offset(), sub))
    return pieces


def _box_factory(key: str, flat: Any, pieces: list[tuple[int, Any]], start: int, replica_id: Any) -> Any:
    """A ShardedTensorFactory for one optimizer-state tensor of one parameter: `flat` holds the
    parameter's flat elements [start, start + numel) (this DP rank's slice); it builds the boxes of
    every piece that slice overlaps, as views of `flat`, and merges a load back into `flat`."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    stop = start + flat.numel()

    def build(built_key, *_):  # the factory's key: a chained optimizer prefixes it after this is made
        boxes = []
        for first, piece in pieces:
            lo, hi = max(start, first), min(stop, first + math.prod(piece.local_shape))
            prepend = (1,) * piece.prepend_axis_num
            for offset, size, at in _flat_range_boxes(tuple(piece.local_shape), lo - first, hi - first):
                begin = first + at - start
                data = flat[begin:begin + math.prod(size)].view(prepend + size)
                boxes.append(replace(
                    piece, key=built_key, data=data, dtype=data.dtype, local_shape=prepend + size,
                    global_offset=tuple(piece.global_offset[:piece.prepend_axis_num])
                    + tuple(o + x for o, x in zip(piece.global_offset[piece.prepend_axis_num:], offset)),
                    axis_fragmentations=None, prepend_axis_num=0, replica_id=replica_id, flattened_range=None))
        built[:] = boxes
        return boxes

    def merge(loaded):
        for box, tensor in zip(built, loaded):
            if tensor.data_ptr() != box.data.data_ptr():  # DCP read into a buffer of its own
                box.data.copy_(tensor.view_as(box.data))
        return flat

    built: list = []
    return ShardedTensorFactory(key, flat, build, merge, replica_id)


def model_space_param_state(optimizer: Any, model_sharded_state_dict: dict) -> dict:
    """A DistributedOptimizer's param_state in megatron's 'fully_sharded_model_space' layout
    ({index: {"param" | "exp_avg" | ...: tensor}} over its local parameters in gbuf_ranges order,
    which load_parameter_state_from_fs_model_space reads), each tensor a _box_factory."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {metadata.data: metadata for metadata in nested_values(tensors)}
    state, index = {}, 0
    for gbuf_range_maps in optimizer.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for gbuf_range_map in per_bucket:
                for model_param, ranges in gbuf_range_map["param_map"].items():
                    metadata = by_param.get(model_param)
                    if metadata is None:
                        raise ValueError(f"a parameter of shape {tuple(model_param.shape)} is not in the model's "
                                         "sharded state dict")
                    # every DP rank saves its own slice: the DP coordinate of the replica id is 0
                    replica_id = (*metadata.replica_id[:2], optimizer.distributed_optimizer_instance_id)
                    pieces = _model_pieces(metadata, replica_id)
                    state[index] = {
                        name: _box_factory(f"optimizer.state.{name}.{metadata.key}", value, pieces,
                                           ranges["param"].start, replica_id)
                        for name, value in optimizer._get_main_param_and_optimizer_states(model_param).items()
                        if name != "step"}  # Adam's step is in the param groups
                    index += 1
    return state


def _model_space_state_dict(optimizer: Any, model_sharded_state_dict: dict, *, is_loading: bool) -> dict | None:
    """What DistributedOptimizer.sharded_state_dict (and ChainedOptimizer's) returns for
    'fully_sharded_model_space', with model_space_param_state as the param state; None for an
    optimizer that is not (made of) megatron's DistributedOptimizer."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inners = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if not all(isinstance(inner, DistributedOptimizer) for inner in inners):
        return None
    if len(inners) > 1:
        optimizer._synchronize_steps()  # as ChainedOptimizer.sharded_state_dict does
    states = []
    for inner in inners:
        state = inner.state_dict()
        if is_loading:  # allocates the optimizer state the load is read into (megatron does the same)
            inner.load_state_dict(inner.state_dict())
        state["param_state"] = model_space_param_state(inner, model_sharded_state_dict)
        if not is_loading:  # a load takes it from the checkpoint's common state (megatron refuses both)
            state["param_state_sharding_type"] = FULLY_SHARDED_MODEL_SPACE
        states.append(state)
    if len(states) == 1:
        return states[0]
    for index, state in enumerate(states):
        add_prefix_for_sharding(state, f"chained_{index}.")
    return dict(enumerate(states))


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
