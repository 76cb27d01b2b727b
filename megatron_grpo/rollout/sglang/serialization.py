"""SGLang's tensor payloads for /update_weights_from_tensor.

Wire format: one base64 string per engine TP rank, each the ForkingPickler bytes of the payload.
ForkingPickler reduces CUDA tensors to CUDA IPC handles (no copy); CPU tensors are moved to shared
memory and reduced to a shm file name ("file_system" strategy, since the receiving server is not
our child process and cannot receive file descriptors).

The server unpickles with SGLang's SafeUnpickler, which admits torch types, builtins and SGLang's
own classes only (anything else crashes its scheduler). So the payload is either
- `flattened_bucket` (one flat uint8 tensor + SGLang's `FlattenedTensorMetadata` per tensor), when
  sglang is importable here, as in colocated deployments; or
- `load_format=None`: a plain list of (name, tensor) pairs, builtins and torch only, when it is not.
"""
from __future__ import annotations

import base64
import contextlib
import io
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.multiprocessing as torch_mp
from multiprocessing.reduction import ForkingPickler

from megatron_grpo.optional import available

_SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"


@dataclass(frozen=True)
class TensorPayload:
    """What one /update_weights_from_tensor call carries: its `load_format` and the object to pickle."""

    load_format: Optional[str]
    obj: Any


@contextlib.contextmanager
def _cpu_file_system_sharing() -> Iterator[None]:
    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(previous)


def serialize(obj: Any) -> str:
    """ForkingPickler bytes of obj, base64 (what sglang's MultiprocessingSerializer produces)."""
    buffer = io.BytesIO()
    with _cpu_file_system_sharing():
        ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def sglang_bucket_available() -> bool:
    return available(_SGLANG_BUCKET_MODULE)


def tensor_payload(named_tensors: list[tuple[str, torch.Tensor]], flattened: bool | None = None) -> TensorPayload:
    """The payload of one bucket; `flattened=None` picks flattened_bucket when sglang imports."""
    if not named_tensors:
        raise ValueError("cannot send an empty bucket")
    if flattened is None:
        flattened = sglang_bucket_available()
    if not flattened:
        return TensorPayload(None, [(name, tensor.detach().contiguous()) for name, tensor in named_tensors])
    return TensorPayload("flattened_bucket", flatten_bucket(named_tensors))


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """{"flattened_tensor", "metadata"} with SGLang's metadata class: all tensors' bytes concatenated."""
    import importlib

    meta_cls = importlib.import_module(_SGLANG_BUCKET_MODULE).FlattenedTensorMetadata
    parts, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        metadata.append(meta_cls(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                 end_idx=offset + flat.numel(), numel=flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}
