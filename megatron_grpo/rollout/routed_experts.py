"""Which experts an HF MoE model routed each position to (the local engine's side of routing replay).

RoutedExpertsRecorder hooks the routers and gives, per sequence position, the top-k experts of
every layer in SGLang's `return_routed_experts` layout ([positions, num_layers, k] int32; dense
layers hold -1).
"""
from __future__ import annotations

import torch


def sparse_blocks(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index -> the layer's MoE block (it has a router `gate` and `experts`)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return {i: layer.mlp for i, layer in enumerate(layers)
            if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")}


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
