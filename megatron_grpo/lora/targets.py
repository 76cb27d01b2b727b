"""Which Megatron linear layer carries the adapter of each PEFT target module, and its fused layout.

PEFT names the HF projections (q_proj, ..., down_proj); Megatron fuses some of them (linear_qkv,
linear_fc1). This table is the only place that pairs the two (and spells PEFT's tensor names); the
layouts are convert/transforms.py's.
Dense decoder layers of the llama / qwen2 / qwen3 families (the attention and the dense MLP); MoE
experts and multi-head latent attention have no adapters yet (config/validate.py refuses them).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.lora.adapters import Parallel
from megatron_grpo.models.hf_config import ModelArchitecture


@dataclass(frozen=True)
class LinearTarget:
    module: str                     # the Megatron linear layer, relative to the decoder layer
    hf_module: str                  # its HF parent module, relative to model.layers.{i}
    parallel: Parallel
    projections: tuple[str, ...]    # the PEFT target names fused into it, in the fused order


TARGETS = (
    LinearTarget("self_attention.linear_qkv", "self_attn", "column", ("q_proj", "k_proj", "v_proj")),
    LinearTarget("self_attention.linear_proj", "self_attn", "row", ("o_proj",)),
    LinearTarget("mlp.linear_fc1", "mlp", "column", ("gate_proj", "up_proj")),
    LinearTarget("mlp.linear_fc2", "mlp", "row", ("down_proj",)),
)
TARGET_MODULES = tuple(p for t in TARGETS for p in t.projections)
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head


def expand_targets(target_modules) -> tuple[str, ...]:
    """PEFT's target_modules (a list of names, or "all-linear") as projection names, in TARGETS order."""
    if target_modules == ALL_LINEAR or list(target_modules) == [ALL_LINEAR]:
        return TARGET_MODULES
    wanted = set(target_modules)
    return tuple(p for p in TARGET_MODULES if p in wanted)


def unknown_targets(target_modules) -> list[str]:
    if target_modules == ALL_LINEAR or list(target_modules) == [ALL_LINEAR]:
        return []
    return [name for name in target_modules if name not in TARGET_MODULES]


def peft_prefix(target: LinearTarget, layer: int) -> str:
    """The start of PEFT's names of the adapter tensors of `target` in HF layer `layer` (0-based)."""
    return f"base_model.model.model.layers.{layer}.{target.hf_module}."


def rows_per_projection(target: LinearTarget, cfg: ModelArchitecture) -> tuple[int, ...]:
    """Full output rows of each projection of a column-parallel target; the output width of a row one."""
    if target.projections == ("q_proj", "k_proj", "v_proj"):
        kv = cfg.num_query_groups * cfg.head_dim
        return cfg.num_attention_heads * cfg.head_dim, kv, kv
    if target.projections == ("gate_proj", "up_proj"):
        return cfg.ffn_hidden_size, cfg.ffn_hidden_size
    return (cfg.hidden_size,)


def input_width(target: LinearTarget, cfg: ModelArchitecture) -> int:
    """The full input width of a target (hidden for column-parallel ones)."""
    if target.projections == ("o_proj",):
        return cfg.num_attention_heads * cfg.head_dim
    if target.projections == ("down_proj",):
        return cfg.ffn_hidden_size
    return cfg.hidden_size


def row_groups(target: LinearTarget, cfg: ModelArchitecture, tp_size: int) -> int:
    """Blocks each projection's rows are interleaved in on one TP rank (fuse_rows)."""
    return cfg.num_query_groups // tp_size if target.projections[0] == "q_proj" else 1
