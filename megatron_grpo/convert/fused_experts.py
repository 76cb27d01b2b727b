"""Per-expert HF tensors -> transformers 5's fused expert parameters (for the local engine).

Checkpoints (and our exporter) name every expert's tensors
model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight; transformers >= 5 keeps one fused
parameter per layer (experts.gate_up_proj [E, 2I, H]: gate rows then up rows; experts.down_proj
[E, H, I]). fuse_expert_tensors turns a stream of the first into the second.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class ExpertStreamError(ValueError):
    """A weight stream left some expert of a fused layer without its tensors."""


def fuse_expert_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], model: torch.nn.Module
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors` with per-expert tensors replaced by the fused parameters `model` has; other
    names pass through unchanged. A layer's fused pair is yielded once all its experts arrived (one
    layer's experts are held at a time when they come layer by layer, as the exporter sends them)."""
    params = dict(model.named_parameters())
    pending: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in named_tensors:
        match = _EXPERT.match(name)
        layer_prefix = f"model.layers.{match.group(1)}.mlp.experts." if match else ""
        if match is None or layer_prefix + "gate_up_proj" not in params:
            yield name, tensor
            continue
        layer, expert, kind = int(match.group(1)), int(match.group(2)), match.group(3)
        parts = pending.setdefault(layer, {})
        parts[(expert, kind)] = tensor
        num_experts = params[layer_prefix + "down_proj"].shape[0]
        if len(parts) == 3 * num_experts:
            del pending[layer]
            yield layer_prefix + "gate_up_proj", torch.stack(
                [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], dim=0) for e in range(num_experts)])
            yield layer_prefix + "down_proj", torch.stack([parts[(e, "down_proj")] for e in range(num_experts)])
    if pending:
        layer, parts = next(iter(pending.items()))
        raise ExpertStreamError(f"weight update: layer {layer} got {len(parts)} expert tensors, its fused experts "
                                f"need all of gate_proj / up_proj / down_proj for every expert")
