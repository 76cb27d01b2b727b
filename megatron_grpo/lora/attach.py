"""Puts LoRA adapters on a built policy and freezes its base weights.

attach_adapters(chunks, cfg, settings) runs after the base weights are loaded and before the chunks are
wrapped for data parallelism, so that megatron's DDP and (distributed) optimizer see the adapters as
the only trainable parameters: the base keeps its dtype, with no gradient buffer, master copy or
optimizer state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_grpo.errors import ConfigError
from megatron_grpo.lora.adapters import AdapterShape, LoraAdapter, adapters_of
from megatron_grpo.lora.targets import (TARGETS, LinearTarget, expand_targets, input_width, peft_prefix,
                                       row_groups, rows_per_projection)
from megatron_grpo.models.hf_config import ModelArchitecture

ADAPTER_SUFFIX = "_lora"  # the adapter of `linear_qkv` is the module `linear_qkv_lora` beside it


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]   # PEFT projection names (expanded)
    seed: int = 0                     # A's initialisation; the same on every rank


def is_adapter_parameter(name: str) -> bool:
    """A parameter name of an adapter (convert.mappings.bind leaves them out: they are not HF weights)."""
    return f"{ADAPTER_SUFFIX}.lora_" in name


def attach_adapters(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture,
                    settings: LoraSettings) -> list[LoraAdapter]:
    """Adapters on every targeted linear layer of the (unwrapped) chunks; every other parameter frozen."""
    from megatron_grpo.models.builder import unwrap

    wanted = set(expand_targets(settings.target_modules))
    adapters = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        for param in model.parameters():
            param.requires_grad_(False)
        for layer in model.decoder.layers:
            for target in TARGETS:
                trained = tuple(p for p in target.projections if p in wanted)
                if trained:
                    adapters.append(_attach(layer, target, trained, cfg, settings))
        if model.pre_process and model.config.recompute_granularity == "full":
            model.embedding.register_forward_hook(_embedding_output_requires_grad)
    return adapters


def _embedding_output_requires_grad(module, args, output):
    """Full recompute runs each layer block through megatron's CheckpointFunction, whose output takes part in
    autograd only if one of its inputs does; with the embedding frozen none would, and the adapters would get
    no gradient (transformers' enable_input_require_grads answers the same problem)."""
    return output if output.requires_grad else output.requires_grad_(True)


def _attach(layer, target: LinearTarget, trained: tuple[str, ...], cfg: ModelArchitecture,
            settings: LoraSettings) -> LoraAdapter:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    parent_name, name = target.module.rsplit(".", 1)
    parent = layer.get_submodule(parent_name)
    base = getattr(parent, name)
    expected = ColumnParallelLinear if target.parallel == "column" else RowParallelLinear
    if not isinstance(base, expected):  # e.g. TE's LayerNormLinear: its input is the un-normalised hidden state
        raise ConfigError(f"model.lora: {target.module} is {type(base).__name__}, not megatron's "
                          f"{expected.__name__}; adapters sit beside the local layer spec's linear layers: set "
                          "model.attention_backend=torch_varlen (CUDA, bf16) or local (Transformer Engine's fused "
                          "layers are not supported yet)")
    tp_group = base.tp_group
    tp = torch.distributed.get_world_size(tp_group)
    rows = rows_per_projection(target, cfg)
    column = target.parallel == "column"
    shape = AdapterShape(parallel=target.parallel, projections=target.projections, trained=trained,
                         in_features=input_width(target, cfg) // (1 if column else tp),
                         out_features=tuple(r // tp for r in rows) if column else rows,
                         groups=row_groups(target, cfg, tp))
    adapter = LoraAdapter(shape, settings.rank, settings.alpha, settings.dropout,
                          peft_prefix=peft_prefix(target, layer.layer_number - 1),
                          tp_group=tp_group,
                          sequence_parallel=bool(getattr(base, "sequence_parallel", False)),
                          dtype=base.weight.dtype, device=base.weight.device)
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + (layer.layer_number - 1) * 16
                                              + TARGETS.index(target))
    adapter.reset_parameters(generator)
    parent.add_module(name + ADAPTER_SUFFIX, adapter)
    base.register_forward_hook(adapter.hook, with_kwargs=True)
    base.weight.lora_adapter = adapter  # convert/export.py merges it into what it exports
    return adapter


def trainable_parameter_count(model_chunks: Sequence[torch.nn.Module]) -> int:
    return sum(p.numel() for a in adapters_of(model_chunks) for p in a.parameters())
