"""Copy a stream of HF-named tensors into an HF model, strictly (every name known, every shape right)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


class WeightUpdateError(ValueError):
    """A weight update named an unknown parameter, had a wrong shape, or left parameters stale."""


@dataclass
class WeightLoadReport:
    """What one update touched: tensors, bytes received, and parameters that were not updated."""

    num_tensors: int
    num_bytes: int
    missing: list[str]


class HFWeightLoader:
    """Writes HF-named tensors into `model`'s parameters (and persistent buffers) in place.

    Tied parameters (e.g. lm_head.weight sharing model.embed_tokens.weight) are one storage with
    several names: a tensor sent under any of its names updates all of them, which is how an HF
    checkpoint of a tied model (embed_tokens only) is loaded."""

    def __init__(self, model: torch.nn.Module):
        self._params: dict[str, torch.nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        # Persistent buffers are checkpoint tensors too (GLM-4.5's router bias); rotary caches are not persistent.
        persistent = set(model.state_dict())
        self._params.update((name, buffer) for name, buffer in model.named_buffers(remove_duplicate=False)
                            if name in persistent)
        # name -> canonical name (the first name of each shared storage)
        self._canonical: dict[str, str] = {}
        first_name_of: dict[int, str] = {}
        for name, param in self._params.items():
            key = id(param)
            first_name_of.setdefault(key, name)
            self._canonical[name] = first_name_of[key]
        self.canonical_names: list[str] = sorted(set(self._canonical.values()))

    def names(self) -> list[str]:
        return sorted(self._params)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], require_all: bool = True) -> WeightLoadReport:
        """Copies each tensor into its parameter (dtype/device converted by `copy_`).

        With require_all, raises WeightUpdateError after the stream ends if some parameter got no
        tensor, since stale weights would silently make the rollout off-policy."""
        updated: set[str] = set()
        count = 0
        nbytes = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                param = self._params.get(name)
                if param is None:
                    raise WeightUpdateError(
                        f"weight update: unknown parameter name {name!r} (the model has {len(self._params)} "
                        f"parameters, e.g. {self.names()[:3]})")
                if tuple(tensor.shape) != tuple(param.shape):
                    raise WeightUpdateError(f"weight update: {name!r} has shape {tuple(tensor.shape)}, "
                                            f"the model expects {tuple(param.shape)}")
                if not (tensor.is_floating_point() and param.is_floating_point()):
                    raise WeightUpdateError(f"weight update: {name!r} has dtype {tensor.dtype}, expected a "
                                            f"floating-point tensor like the model's {param.dtype}")
                param.copy_(tensor)
                updated.add(self._canonical[name])
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
        missing = [n for n in self.canonical_names if n not in updated]
        if require_all and missing:
            raise WeightUpdateError(f"weight update left {len(missing)} of {len(self.canonical_names)} "
                                    f"parameters stale, e.g. {missing[:5]}")
        return WeightLoadReport(num_tensors=count, num_bytes=nbytes, missing=missing)
