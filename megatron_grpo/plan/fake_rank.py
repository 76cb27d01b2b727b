"""One rank of a large job inside this process: a fake process group, megatron's parallel state
over it, and fake tensors (shapes and dtypes, no memory), as torchtitan's memory estimator does.

    with fake_rank(world_size=32, rank=16, layout=layout) as mode:
        ...  # megatron-core code runs as rank 16 would; collectives return at once

What differs from a real run, each for a measured reason:
  * megatron's gloo side groups are made on the fake backend too (gloo refuses a fake store);
  * megatron's RNG tracker fork() compares CPU RNG states with .item(); under fake tensors that
    has no value, and the random streams change no shape: fork() only yields here;
  * all_gather_object answers every rank's object with this rank's (the fake backend moves no
    bytes; megatron gathers parameter-group keys, alike on the ranks of a stage);
  * the grad-norm fallback (megatron.core.utils.local_multi_tensor_l2_norm, used without apex/TE)
    builds torch.tensor() from a list of tensors, which fake tensors cannot; the same norm is taken
    with torch.stack (a GPU run uses apex's fused kernel: a few bytes either way);
  * megatron's grad buffers run their collectives inside torch's _coalescing_manager, whose
    coalesced ops the fake backend does not implement: they run one by one here (same buffers);
  * MoE layers route balanced (builder.moe_config balanced_routing): the all-to-all dispatcher's
    per-expert token counts are then known without reading the device, and are given to the
    experts as a real tensor (they split their input by its values);
  * the MoE router metrics (models/moe_metrics.py RouterStats.metrics) select layers by a
    boolean mask, whose size fake tensors do not know: they report nothing here (a few floats);
  * Float16Module casts a bf16 model to bf16 again; fake parameters cannot be swapped in place
    (torch's Module._apply), and the cast is a no-op: it is skipped here.
Everything is restored on exit (process group, parallel state, the two patches).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_grpo.launch.parallel import ParallelLayout


@contextlib.contextmanager
def fake_rank(world_size: int, rank: int, layout: ParallelLayout) -> Iterator[object]:
    from megatron.core import parallel_state
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_grpo.launch.cpu import apply_cpu_compat
    from megatron_grpo.launch.parallel import set_seed

    if dist.is_initialized():
        raise RuntimeError("fake_rank needs a process without torch.distributed initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        apply_cpu_compat()
        layout.data_parallel_size(world_size)
        with _gloo_groups_on_the_fake_backend():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
                virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
                context_parallel_size=layout.context, expert_model_parallel_size=layout.expert,
                expert_tensor_parallel_size=layout.expert_tensor)
        set_seed(1234)
        with _simulation_patches(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def _gloo_groups_on_the_fake_backend() -> Iterator[None]:
    new_group = dist.new_group

    def fake_new_group(*args, **kwargs):
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = None
        return new_group(*args, **kwargs)

    dist.new_group = fake_new_group
    try:
        yield
    finally:
        dist.new_group = new_group


@contextlib.contextmanager
def _simulation_patches() -> Iterator[None]:
    import megatron.core.distributed.param_and_grad_buffer as buffers
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from megatron_grpo.models.moe_metrics import RouterStats

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        yield

    original_init = Float16Module.__init__

    def float16_init(self, config, module):
        module.bfloat16 = lambda: module  # params are built in bf16 already (params_dtype)
        try:
            original_init(self, config, module)
        finally:
            del module.bfloat16

    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
        return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None

    class _Done:
        def wait(self):
            return None

    @contextlib.contextmanager
    def one_by_one(group=None, device=None, async_ops=False):
        yield _Done()

    original_preprocess = MoEAlltoAllTokenDispatcher.preprocess

    def preprocess(self, routing_map):
        counts = original_preprocess(self, routing_map)
        if not self.drop_and_pad:
            return counts
        with unset_fake_temporarily():  # capacity x TP x EP tokens per local expert (megatron's value)
            return torch.full(tuple(counts.shape), self.capacity * self.tp_size * self.ep_size, dtype=torch.long)

    MoEAlltoAllTokenDispatcher.preprocess = preprocess
    original_router_metrics = RouterStats.metrics
    RouterStats.metrics = lambda self: {}
    original_coalescing = buffers._coalescing_manager
    buffers._coalescing_manager = one_by_one
    original_fork = mrandom.CudaRNGStatesTracker.fork
    original_gather = dist.all_gather_object
    original_l2_norm = clip_grads.l2_norm_impl
    clip_grads.l2_norm_impl = l2_norm
    mrandom.CudaRNGStatesTracker.fork = fork
    Float16Module.__init__ = float16_init
    dist.all_gather_object = all_gather_object
    try:
        yield
    finally:
        mrandom.CudaRNGStatesTracker.fork = original_fork
        Float16Module.__init__ = original_init
        dist.all_gather_object = original_gather
        clip_grads.l2_norm_impl = original_l2_norm
        buffers._coalescing_manager = original_coalescing
        MoEAlltoAllTokenDispatcher.preprocess = original_preprocess
        RouterStats.metrics = original_router_metrics


def first_rank_of_stage(world_size: int, layout: ParallelLayout, stage: int) -> int:
    """Global rank of TP/CP/DP rank 0 of pipeline stage `stage` (megatron's default order
    tp-cp-ep-dp-pp: the pipeline dimension varies slowest)."""
    return stage * (world_size // layout.pipeline)
