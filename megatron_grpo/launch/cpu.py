"""megatron-core on a CPU-only torch build (gloo, no CUDA).

Process-wide patches of megatron-core and torch.cuda for a CPU-only run live here (the other
places that replace third-party code are listed in docs/architecture.md, "Patches"). Every patch
below answers one measured failure of megatron-core 0.16.1 (and 0.19.2) on CPU, named in the list
below; tests/test_megatron_cpu.py runs each path. `apply_cpu_compat()` is idempotent and does
nothing when CUDA is available, so GPU runs see an unmodified megatron-core.

What each patch fixes:
  rng       CudaRNGStatesTracker stores torch.cuda RNG states; every attention forward forks it.
            We keep megatron's fork/restore semantics on the CPU default generator.
  device    torch.cuda.current_device() is used to place buffers (RoPE, SP, DDP, p2p).
  sync      torch.cuda.synchronize() in dist_checkpointing saves and p2p; CPU ops are synchronous.
  stream    torch.cuda.current_stream() in DDP grad sync (megatron-core >= 0.19); torch.cuda.Stream()
            made by the MoE all-to-all token dispatcher for its device-to-host copies of the
            token counts, whose recorded event it synchronizes on (CPU tensors: nothing to wait for).
  mask      get_default_causal_mask() allocates on "cuda"; it also runs inside backward
            (activation recompute), where a TorchFunctionMode is not active, so it is patched
            directly rather than relying on the mode.
  mode      a TorchFunctionMode that rewrites hard-coded device="cuda" allocations (schedules,
            optimizer, clip_grads) to CPU, and answers megatron's Tensor.type() string checks
            ('torch.cuda.FloatTensor') for CPU tensors.
  sp-norm   the torch norms refuse sequence_parallel; we allow it and tag the params so that
            finalize_model_grads all-reduces their grads over TP, as TE/apex norms do.
  moe-gemm  megatron-core 0.16's moe_utils imports te_general_gemm (and the fused_* kernels) only
            when Transformer Engine imports, then tests `te_general_gemm is not None` in the router's
            gating linear: NameError without TE. The names are set to None, as 0.19 does itself.
  a2a-split the all-to-all token dispatcher turns its split sizes into numpy arrays only when it
            moves them off a CUDA device (maybe_move_tensor_to_cpu); CPU tensors stay tensors and
            all_to_all_single refuses them as split sizes. CPU tensors asked for as numpy become numpy.
  uneven-ag with ETP > 1 and sequence parallel, the all-to-all token dispatcher gathers each TP
            rank's tokens for its experts (dispatch_postprocess) and, in the backward of its
            reduce-scatter (combine_preprocess), their gradients: tensor_parallel.mappings.
            _gather_along_first_dim with output_split_sizes, a torch.distributed.all_gather into
            uneven chunks. NCCL does that as one broadcast per rank; gloo refuses it
            ("ProcessGroupGloo::allgather: invalid tensor size"). Uneven sizes are gathered padded
            to the longest and trimmed (every rank holds the sizes); even ones go to megatron.
            The uneven reduce-scatter of the same paths works on gloo as it is.
  adam-step megatron's model-space optimizer loads ('fully_sharded_model_space',
            'fully_reshardable') copy every key of torch AdamW's per-parameter state, 'step'
            included, from tensors that carry none (the step is in the param groups) ->
            KeyError: 'step'. The step is left to
            fix_torch_adam_step_after_load; everything else is copied as before.
  quiet     megatron's tracker.fork() warns "CPU RNG state changed within GPU RNG context" when
            the CPU generator moved inside the fork. With the rng patch the "GPU" state IS the
            CPU generator, so every dropout inside a fork moves it by design (and fork restores
            it on exit): a logging filter drops exactly that message, nothing else changes.
Plus two helpers for resuming megatron's DistributedOptimizer over torch.optim.AdamW
(prepare_torch_adam_for_load / fix_torch_adam_step_after_load).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys

import torch

log = logging.getLogger(__name__)

_applied = False
_redirect_mode = None  # the active _CudaAllocationsToCpu, once apply_cpu_compat() ran


@contextlib.contextmanager
def cuda_redirect_paused():
    """Suspends the device-redirecting TorchFunctionMode for code that never asks for CUDA (the
    in-process HF rollout model): every torch call otherwise detours through Python (~10% of a
    CPU GRPO step, see benchmarks/README.md). A no-op when the layer is not applied."""
    mode = _redirect_mode
    if mode is None:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()


def cpu_compat_needed() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_compat() -> bool:
    """Patches megatron-core for CPU once per process. Returns True if the patches are active."""
    global _applied
    if _applied:
        return True
    if not cpu_compat_needed():
        return False
    _patch_rng_tracker()
    _silence_cpu_rng_warning()
    _patch_torch_cuda_functions()
    _patch_causal_mask()
    _patch_sequence_parallel_norms()
    _patch_fully_reshardable_adam_step()
    _define_missing_te_moe_kernels()
    _patch_dispatcher_split_sizes()
    _patch_uneven_first_dim_gather()
    global _redirect_mode
    _redirect_mode = _CudaAllocationsToCpu()
    _redirect_mode.__enter__()  # left active for the life of the process
    _applied = True
    log.debug("megatron-core CPU compatibility layer applied")
    return True


def _patch_rng_tracker() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        # Same bookkeeping as megatron's tracker, but the state comes from the CPU generator.
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add


_CPU_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


class _DropCpuRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _CPU_RNG_WARNING


def _silence_cpu_rng_warning() -> None:
    # Same logger as megatron's `logging.getLogger(__name__)` in tensor_parallel/random.py.
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropCpuRngWarning())


class _NullEvent:
    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()


def _patch_torch_cuda_functions() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NullStream()
    torch.cuda.Stream = _NullStream  # torch.cuda.stream(s) is a no-op without CUDA


def _patch_causal_mask() -> None:
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    # Both the definition and the name fused_softmax imported from it.
    transformer_utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _patch_sequence_parallel_norms() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        if zero_centered_gamma:
            raise ValueError("zero_centered_gamma needs Transformer Engine or apex norms")
        norm_type = config.normalization
        if norm_type == "RMSNorm":
            module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif norm_type == "LayerNorm":
            module = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"unsupported normalization {norm_type!r}")
        for param in module.parameters():
            # finalize_model_grads all-reduces grads of params tagged sequence_parallel over TP.
            param.sequence_parallel = config.sequence_parallel
        return module

    WrappedTorchNorm.__new__ = staticmethod(new)


_TE_MOE_KERNELS = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                   "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                   "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm")


def _define_missing_te_moe_kernels() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in _TE_MOE_KERNELS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _patch_dispatcher_split_sizes() -> None:
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move


def _patch_uneven_first_dim_gather() -> None:
    import megatron.core.tensor_parallel.mappings as mappings

    original = mappings._gather_along_first_dim

    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        chunks = list(padded.new_empty((len(output_split_sizes) * longest, *input_.shape[1:]))
                      .split(longest))
        torch.distributed.all_gather(chunks, padded, group=group)
        return torch.cat([chunk[:size] for chunk, size in zip(chunks, output_split_sizes)])

    mappings._gather_along_first_dim = gather


def _patch_fully_reshardable_adam_step() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _called_from_megatron() -> bool:
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame is not None and "megatron/core" in frame.f_code.co_filename


_REWRITTEN_CALLS = frozenset({"cuda", "to", "type"})


class _CudaAllocationsToCpu(torch.overrides.TorchFunctionMode):
    """Redirects device="cuda" to CPU and fakes CUDA type strings for megatron's checks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not kwargs and name not in _REWRITTEN_CALLS:
            return func(*args)  # the common case: nothing to redirect
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = dict(kwargs, device=torch.device("cpu"))
        if name == "cuda":
            return args[0]
        if name == "to" and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu")) + tuple(args[2:])
        if (name == "type" and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
                and args[0].device.type == "cpu" and _called_from_megatron()):
            # megatron asserts e.g. param.type() == 'torch.cuda.FloatTensor' (optimizer, clip_grads).
            type_name = func(*args)
            return type_name if type_name.startswith("torch.cuda.") else type_name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _torch_adam_optimizers(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for wrapper in chained:
        inner = getattr(wrapper, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            yield inner


def prepare_torch_adam_for_load(optimizer) -> None:
    """Before dist_checkpointing.load of a DistributedOptimizer over torch AdamW: a fresh torch
    optimizer has no state, and megatron's sharded_state_dict asserts one 'step' per group."""
    for adam in _torch_adam_optimizers(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                if not adam.state[param]:
                    adam.state[param].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                                             exp_avg_sq=torch.zeros_like(param))


def fix_torch_adam_step_after_load(optimizer) -> None:
    """After loading: megatron restores the step per param group, torch AdamW reads it per param;
    without this, Adam's bias correction restarts and the resumed run diverges."""
    for adam in _torch_adam_optimizers(optimizer):
        for group in adam.param_groups:
            if group.get("step") is not None:
                for param in group["params"]:
                    adam.state[param]["step"] = torch.tensor(float(group["step"]))
