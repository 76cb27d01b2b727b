"""Simulate one pipeline stage's rank through a GRPO step with the trainer's own functions, on
fake tensors, and record its device memory per phase (plan/tracker.py).

The phases, in the order a step runs them once the optimizer state exists (step 2 on):
  build        the policy chunks (models/builder.py), megatron DDP's grad buffers and the
               distributed optimizer (trainer/assembly/optimizer.py), whose Adam state appears at
               its first step: one step on zero gradients creates it, as step 1 would
  old-log-prob the forward-only pass (trainer/step/train_step.py compute_logprobs) over one
               micro-batch at the pass's token budget
  reference    the reference model's forward-only pass; with ref.param_offload its weights are
               on the device only during the pass (built inside it), else resident from the start
  train        train_on_mini_batch: forward/backward over the micro-batches a rank holds at once
               (the first stage of a pipeline keeps up to PP x VPP in flight: PP x VPP + 1 are
               run), then the optimizer step
  weight sync  the stage's HF export (convert/export.py) grouped into rollout.weight_bucket_mb
               buckets as the sync sends them (rollout/sglang/buckets.py)
  checkpoint   a save: nothing on the GPU in the format saved (checkpoint_save_memory: the host
               copies megatron's writer makes, computed from the simulated buckets)
Samples are the recipe's longest (max_prompt_length + max_response_length), cut into micro-batches
by the trainer's planner (trainer/batches/micro_batches.py); with equal lengths the padded layout
holds exactly the packed tokens, and it is the one simulated (see _micro_batches). Attention is the
GPU's: a flash-attention memory model (ops/flash_attention_memory.py) stands in for the CPU's O(L^2)
local kernel.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.launch.parallel import ParallelLayout
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.plan.tracker import MemoryTracker, PhasePeak

# Categories of what stays on the device between phases, in report order.
RESIDENT = ("parameters", "gradient buffers", "optimizer state", "reference")


@dataclass(frozen=True)
class StageJob:
    """What one simulated rank needs: the recipe, the model, the layout and the world size."""

    cfg: Config
    arch: ModelArchitecture
    layout: ParallelLayout
    world_size: int
    dtype: torch.dtype = torch.bfloat16
    train_micro_batches: int | None = None  # None: as many as a rank holds at once (PP x VPP + 1)


@dataclass
class StageMemory:
    stage: int
    rank: int
    phases: list[PhasePeak]
    resident: dict[str, int]  # after build: parameters, gradient buffers, optimizer state, reference
    parameters: int  # numel of this rank's policy parameters
    buffer_numel: int  # DDP's contiguous buffers (parameters padded per bucket for DP sharding)
    micro_batch_tokens: int
    train_micro_batches: int
    save_host_bytes: int = 0
    save_device_bytes: int = 0
    save_local_copy_bytes: int = 0
    measured_save_bytes: int | None = None  # real runs only: the save state dict's host + device peak
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> PhasePeak:
        return max(self.phases, key=lambda p: p.peak_bytes)


def simulate_stage(job: StageJob, stage: int) -> StageMemory:
    """The phases on fake tensors, as the first rank of `stage` of a job of job.world_size ranks
    (in this process; torch.distributed must not be initialised)."""
    from megatron_grpo.plan.fake_rank import fake_rank, first_rank_of_stage

    rank = first_rank_of_stage(job.world_size, job.layout, stage)
    start = time.perf_counter()
    with fake_rank(job.world_size, rank, job.layout):
        memory = run_stage_phases(job, stage, rank, fake=True)
    memory.seconds = time.perf_counter() - start
    return memory


def _recompute(cfg: Config):
    from megatron_grpo.models.builder import Recompute

    m = cfg.model
    return Recompute(granularity=None if m.recompute_granularity == "none" else m.recompute_granularity,
                     method=m.recompute_method, num_layers=m.recompute_num_layers)


def run_stage_phases(job: StageJob, stage: int, rank: int, fake: bool) -> StageMemory:
    """The phases under megatron's current parallel state, on fake tensors (inside fake_rank) or
    on real ones (the validation: a real gloo job at shapes a CPU holds, same tracker)."""
    from megatron_grpo.lora.adapters import adapters_off
    from megatron_grpo.lora.attach import LoraSettings, attach_adapters
    from megatron_grpo.lora.targets import expand_targets
    from megatron_grpo.models.builder import build_model, build_reference_model
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.setup import kl_reference_needed

    cfg, arch = job.cfg, job.arch
    tracker = MemoryTracker(answer_scalar_reads=fake)
    device = torch.device("cpu")
    with tracker:
        with tracker.phase("build policy", "parameters"):
            chunks = build_model(arch, job.layout, dtype=job.dtype, recompute=_recompute(cfg),
                                 fp32_lm_head=cfg.model.fp32_lm_head, backend="memory-model")
            lora = cfg.model.lora
            if lora.rank:  # the adapters train, the base is frozen: DDP and the optimizer see the adapters only
                attach_adapters(chunks, arch, LoraSettings(lora.rank, lora.alpha, lora.dropout,
                                                           expand_targets(lora.target_modules)))
        parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        with tracker.phase("build DDP grad buffers", "gradient buffers"):
            policy = wrap_with_ddp(chunks, cfg.parallel.use_distributed_optimizer)
            # DDP moved the weights into its contiguous param buffer: that buffer is parameters
            tracker.track([p for chunk in policy for p in chunk.parameters()], "parameters")
        buffer_numel = sum(b.numel for chunk in policy for b in chunk.buffers + chunk.expert_parallel_buffers)
        with tracker.phase("build optimizer", "optimizer state"):
            optimizer, _ = build_optimizer(policy, OptimizerSettings(
                lr=1e-6, grad_clip=cfg.actor.grad_clip or 0.0,
                use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                bf16=job.dtype == torch.bfloat16))
            optimizer.step()  # Adam's state is created at the first step
        reference = None
        with_reference = kl_reference_needed(cfg)
        if with_reference and lora.rank:
            reference = policy  # its base, the adapters off (trainer/loop.py): no second copy
        elif with_reference and not cfg.ref.param_offload:
            with tracker.phase("build reference", "reference"):
                reference = build_reference_model(arch, job.layout, dtype=job.dtype, backend="memory-model",
                                                  fp32_lm_head=cfg.model.fp32_lm_head)
        resident = {k: v for k, v in tracker.by_category.items() if k in RESIDENT and v}

        count = job.train_micro_batches or _in_flight(job.layout)
        samples = _longest_samples(cfg, count)
        passes = _micro_batches(cfg, arch, samples, purpose="old_logprobs", count=_forward_micro_batches(job.layout))
        with tracker.phase("old-log-prob pass", "activations"), logits_apart(tracker, policy):
            _forward_only(policy, passes, cfg, arch, device)
        if with_reference:
            with tracker.phase("reference pass", "activations"):
                if reference is None:  # ref.param_offload: its weights come in for the pass only
                    with tracker.phase("reference in", "reference"):
                        offloaded = build_reference_model(arch, job.layout, dtype=job.dtype,
                                                          backend="memory-model",
                                                          fp32_lm_head=cfg.model.fp32_lm_head)
                    with logits_apart(tracker, offloaded):
                        _forward_only(offloaded, _micro_batches(cfg, arch, samples, "ref_logprobs", len(passes)), cfg,
                                      arch, device)
                    del offloaded
                else:
                    with logits_apart(tracker, reference), adapters_off(reference):
                        _forward_only(reference, _micro_batches(cfg, arch, samples, "ref_logprobs", len(passes)), cfg,
                                      arch, device)
        train = _micro_batches(cfg, arch, samples, purpose="train", count=count)
        with tracker.phase("train forward/backward + optimizer step", "activations"), logits_apart(tracker, policy):
            _train(policy, optimizer, train, cfg, arch, device)
        with tracker.phase("weight-sync export", "sync buckets"):
            _export(policy, cfg, arch)
        save = checkpoint_save_memory(policy, optimizer, job.dtype)
        measured_save = None
        if not fake:  # the validation: megatron's own save state dict, host and device together
            before = tracker.live_bytes
            with tracker.phase("checkpoint state dict, measured", "checkpoint"):
                _save_state_dict(policy, optimizer)
            measured_save = tracker.phases[-1].peak_bytes - before
        phases = [p for p in tracker.phases if p.phase not in ("reference in", "checkpoint state dict, measured")]
        resident_live = tracker.live_bytes
        gather = {"checkpoint gather": save.device_bytes} if save.device_bytes else {}
        phases.append(PhasePeak("checkpoint save", peak_bytes=resident_live + save.device_bytes,
                                by_category={**{k: v for k, v in tracker.by_category.items() if v}, **gather},
                                end_bytes=resident_live))
    return StageMemory(stage=stage, rank=rank, phases=phases, resident=resident, parameters=parameters,
                       buffer_numel=buffer_numel,
                       micro_batch_tokens=max(mb.processed_tokens for mb in train),
                       train_micro_batches=len(train), save_host_bytes=save.host_bytes,
                       save_device_bytes=save.device_bytes, save_local_copy_bytes=save.local_copy_bytes,
                       measured_save_bytes=measured_save)


@contextlib.contextmanager
def logits_apart(tracker: MemoryTracker, chunks) -> Iterator[None]:
    """Inside the passes: what the output layer and the loss create (logits, log-softmax
    temporaries and their gradients) is filed under "logits/loss", the rest under "activations".
    The output layer's forward starts the logits; the chunk's next forward, or the output layer's
    backward (after which backward runs through the layers), returns to activations."""
    from megatron_grpo.models.builder import unwrap

    handles = []
    for chunk in chunks:
        model = unwrap(chunk)
        handles.append(model.register_forward_pre_hook(lambda *_: tracker.file_under("activations")))
        head = getattr(model, "output_layer", None) if model.post_process else None
        if head is not None:
            handles.append(head.register_forward_pre_hook(lambda *_: tracker.file_under("logits/loss")))
            handles.append(head.register_full_backward_hook(lambda *_: tracker.file_under("activations")))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _in_flight(layout: ParallelLayout) -> int:
    """Micro-batches whose activations the first pipeline stage can hold at once, plus one; under
    the interleaved schedule rounded up to its micro-batch groups of PP (the trainer's count too)."""
    if layout.pipeline == 1:
        return 1
    count = layout.pipeline * (layout.virtual_pipeline or 1) + 1
    return -(-count // layout.pipeline) * layout.pipeline if layout.virtual_pipeline else count


def _forward_micro_batches(layout: ParallelLayout) -> int:
    """A forward-only pass holds one micro-batch's activations at a time; the interleaved schedule
    needs at least PP micro-batches."""
    return layout.pipeline if layout.virtual_pipeline else 1


def _longest_samples(cfg: Config, micro_batches: int):
    """Samples of the recipe's longest length, enough for `micro_batches` full micro-batches on
    every data-parallel rank (their values size nothing)."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.config.derived import sampling_replay_enabled
    from megatron_grpo.trainer.batches.batching import TrainSample
    from megatron_grpo.trainer.setup import kl_reference_needed

    prompt, response = cfg.data.max_prompt_length, cfg.data.max_response_length
    length = prompt + response
    if cfg.actor.max_tokens_per_micro_batch is not None:
        per_micro_batch = max(1, cfg.actor.max_tokens_per_micro_batch // length)
    else:
        per_micro_batch = cfg.actor.ppo_micro_batch_size_per_gpu or 1
    count = per_micro_batch * micro_batches * ps.get_data_parallel_world_size()
    support = max(cfg.rollout.top_k, 1) if sampling_replay_enabled(cfg) else None
    with_ref = kl_reference_needed(cfg)
    return [TrainSample(prompt_ids=[1] * prompt, response_ids=[1] * response, advantage=1.0,
                        rollout_logprobs=[-1.0] * response, old_logprobs=[-1.0] * response,
                        ref_logprobs=[-1.0] * response if with_ref else None,
                        sampling_support=[[1] * support] * response if support else None)
            for _ in range(count)]


def _micro_batches(cfg: Config, arch: ModelArchitecture, samples, purpose: str, count: int):
    """This rank's first `count` micro-batches of one mini-batch made of `samples`."""
    from megatron_grpo.trainer.batches.micro_batches import (MicroBatching, ParallelShape, attention_cost_weight,
                                                             plan)

    # Every sample has the same length, so the padded layout holds exactly the packed tokens; the
    # packed one splits per sequence by cu_seqlens values (rope, attention), which fake tensors lack.
    batching = dataclasses.replace(MicroBatching.from_config(cfg, purpose, attention_cost_weight(arch)),
                                   mini_batch_size=len(samples), packing=False)
    micro_batches = plan(samples, batching, ParallelShape.current(cfg.parallel.sequence_parallel))[0]
    if len(micro_batches) < count:
        raise ValueError(f"{len(samples)} samples made {len(micro_batches)} micro-batches, {count} wanted")
    return micro_batches[:count]


def _forward_only(chunks, micro_batches, cfg: Config, arch: ModelArchitecture, device) -> None:
    from megatron_grpo.trainer.step.train_step import compute_logprobs

    compute_logprobs(chunks, micro_batches, temperature=cfg.rollout.temperature, vocab_size=arch.vocab_size,
                     device=device)


def _train(policy, optimizer, micro_batches, cfg: Config, arch: ModelArchitecture, device) -> None:
    from megatron_grpo.trainer.step_settings import global_batch_info, grpo_loss_config
    from megatron_grpo.trainer.step.train_step import train_on_mini_batch

    train_on_mini_batch(policy, optimizer, micro_batches, loss_config=grpo_loss_config(cfg),
                        batch_info=global_batch_info(micro_batches, cfg), temperature=cfg.rollout.temperature,
                        vocab_size=arch.vocab_size, device=device, need_entropy=True)


def _export(policy, cfg: Config, arch: ModelArchitecture) -> None:
    """The stage's tensors as the weight sync streams them: one bucket alive at a time."""
    from megatron_grpo.convert.export import export_hf_weights
    from megatron_grpo.rollout.sglang.buckets import iter_buckets

    for bucket in iter_buckets(export_hf_weights(policy, arch), cfg.rollout.weight_bucket_mb * 2**20):
        del bucket


def _save_state_dict(policy, optimizer) -> None:
    """megatron's sharded state dict of a save, built and dropped (the validation measures it)."""
    from types import SimpleNamespace

    from megatron_grpo.trainer.state.checkpoint import training_sharded_state_dict

    state = training_sharded_state_dict(SimpleNamespace(policy=policy, optimizer=optimizer), is_loading=False)
    del state


@dataclass(frozen=True)
class SaveMemory:
    device_bytes: int  # the largest transient on the GPU while the state dict is built
    host_bytes: int  # held in host memory by each rank until the write ends
    local_copy_bytes: int  # of device_bytes: the GPU copy of the local shard (no copy on a CPU)


def checkpoint_save_memory(policy, optimizer, dtype: torch.dtype) -> SaveMemory:
    """What a save costs above training's resident state, in the format trainer/state/checkpoint.py
    saves ('fully_sharded_model_space', launch/mcore_compat.py): nothing on the GPU (a rank's slices
    of its optimizer state are views of it; nothing is gathered). On the host, megatron's checkpoint
    writer copies what the rank writes off the GPU before writing it: its fp32 param / exp_avg /
    exp_avg_sq slices (3 x 4 B per element of its shard of each bucket; a non-distributed
    optimizer's whole state) and, as data-parallel rank 0 of its TP x PP group (the planned rank),
    the weights. benchmarks/bench_checkpoint.py measures these figures to the byte on CPU, with every
    tensor filed where a CUDA run keeps it (docs/checkpoints.md); the format megatron-core's
    'fully_reshardable' (before) all-gathered the state over DP on the GPU and held DP-full copies on
    every rank's host."""
    host = sum(param.numel() * param.element_size() for chunk in policy for param in chunk.parameters())
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):  # MoE: dense + expert optimizers
        if hasattr(inner, "buffers"):
            dp = inner.data_parallel_group.size()
            host += sum(3 * 4 * (bucket.grad_data.numel() // dp)
                        for buffer in inner.buffers for bucket in buffer.buckets)
        else:  # not distributed: the whole state, keyed like the model
            per = bytes_per_parameter(dtype, distributed_optimizer=False, dp=1)["optimizer state"]
            host += int(per * sum(p.numel() for group in inner.param_groups for p in group["params"]))
    return SaveMemory(device_bytes=0, host_bytes=host, local_copy_bytes=0)


def bytes_per_parameter(dtype: torch.dtype, distributed_optimizer: bool, dp: int) -> dict[str, float]:
    """The analytic resident terms per parameter of a rank (megatron DDP with fp32 grad buffers,
    Adam with fp32 main params and two fp32 moments, sharded over DP by the distributed optimizer)."""
    weight = torch.finfo(dtype).bits // 8
    optimizer = (4 + 4 + 4) if dtype != torch.float32 else (4 + 4)  # bf16: fp32 main copy + m + v
    return {"parameters": weight, "gradient buffers": 4.0,
            "optimizer state": optimizer / (dp if distributed_optimizer else 1)}

