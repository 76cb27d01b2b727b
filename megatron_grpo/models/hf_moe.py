"""The in-process HF Qwen3-MoE model (the local rollout engine's) as the trainer sees it.

Two gaps between a checkpoint's names and transformers >= 5's modules:
  * weights: checkpoints (and our exporter) name every expert's tensors
    (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight); transformers 5 keeps one fused
    parameter per layer (experts.gate_up_proj [E, 2I, H]: gate rows then up rows; experts.down_proj
    [E, H, I]). fuse_expert_tensors turns a stream of the first into the second.
  * routing: RoutedExpertsRecorder hooks the routers and gives, per sequence position, the top-k
    experts of every layer, SGLang's `return_routed_experts` layout ([positions, num_layers, k]
    int32; dense layers hold -1).
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


def sparse_blocks(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index -> the layer's MoE block (it has a router `gate` and `experts`)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return {i: layer.mlp for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")}


class RoutedExpertsRecorder:
    """Forward hooks on an HF MoE model's routers (registered until remove()); `take()` returns
    what the last forward routed: [batch, seq, num_layers, k] int32 (-1 on dense layers), in the
    forward's input layout.

        recorder = RoutedExpertsRecorder(model)
        model(input_ids, ...)
        routed = recorder.take(*input_ids.shape)
    """

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.top_k = config.num_experts_per_tok
        self._blocks = sparse_blocks(model)
        self._last: dict[int, torch.Tensor] = {}
        self._handles = [block.gate.register_forward_hook(self._hook(index)) for index, block in self._blocks.items()]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if isinstance(output, tuple):  # transformers >= 5: (logits, weights, indices)
                indices = output[2]
            else:  # a plain linear gate (transformers 4): the block takes softmax, then top-k
                indices = torch.topk(torch.softmax(output.float(), dim=-1), self.top_k, dim=-1).indices
            self._last[layer] = indices.detach().to(torch.int32)
        return hook

    def take(self, batch: int, seq: int) -> torch.Tensor:
        out = torch.full((batch, seq, self.num_layers, self.top_k), -1, dtype=torch.int32)
        for layer, indices in self._last.items():
            out[:, :, layer] = indices.reshape(batch, seq, self.top_k).cpu()
        self._last = {}
        return out
