"""Megatron DDP wrapping, the (distributed) optimizer and the LR schedule for the policy."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    scheduler: str = "constant"        # constant | cosine
    total_steps: int = 1
    use_distributed_optimizer: bool = True
    bf16: bool = False


def wrap_with_ddp(model_chunks: list[torch.nn.Module], use_distributed_optimizer: bool) -> list[torch.nn.Module]:
    """Megatron DDP: contiguous grad buffers, grad all-reduce (or reduce-scatter) over DP x CP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        # Average (not sum) over data-parallel ranks: the loss scaling in train_step relies on it.
        average_in_collective=False,
    )
    wrapped = []
    for index, chunk in enumerate(model_chunks):
        wrapped.append(DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                               disable_bucketing=index > 0))
    return wrapped


def build_optimizer(model_chunks: list[torch.nn.Module], settings: OptimizerSettings):
    """Returns (megatron optimizer, megatron OptimizerParamScheduler)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        clip_grad=settings.grad_clip,
        bf16=settings.bf16,
        params_dtype=torch.bfloat16 if settings.bf16 else torch.float32,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, model_chunks)
    # The schedule calls these after the last micro-batch: finalize_model_grads does the DP
    # all-reduce / reduce-scatter, the tied-embedding grad all-reduce across pipeline stages and
    # the TP all-reduce of sequence-parallel norm grads. Without it none of them happen.
    from megatron.core.distributed import finalize_model_grads

    for chunk in model_chunks:
        chunk.config.finalize_model_grads_func = finalize_model_grads
        chunk.config.grad_scale_func = optimizer.scale_loss
    decay_style = {"constant": "constant", "cosine": "cosine"}[settings.scheduler]
    decay_steps = max(settings.total_steps, settings.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr if decay_style == "cosine" else settings.lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
