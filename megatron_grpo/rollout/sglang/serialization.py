"""SGLang's tensor payloads for /update_weights_from_tensor.

Wire format (sglang >= 0.5, `load_format="flattened_bucket"`): one base64 string per engine TP
rank, each the ForkingPickler bytes of {"flattened_tensor": uint8 tensor, "metadata": [meta...]}
where meta has name, shape, dtype, start_idx, end_idx, numel (byte offsets into the flat tensor).
ForkingPickler reduces CUDA tensors to CUDA IPC handles (no copy); CPU tensors are moved to shared
memory and reduced to a shm file name ("file_system" strategy, since the receiving server is not
our child process and cannot receive file descriptors)."""
from __future__ import annotations

import base64
import contextlib
import io
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch
import torch.multiprocessing as torch_mp
from multiprocessing.reduction import ForkingPickler

MetadataFormat = Literal["sglang", "plain"]


@dataclass
class FlatTensorMeta:
    """Field-for-field the metadata of sglang's FlattenedTensorBucket (used when sglang is absent)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


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


def deserialize(data: str) -> Any:
    import pickle

    return pickle.loads(base64.b64decode(data, validate=True))


def _metadata_class(metadata_format: MetadataFormat) -> type:
    if metadata_format == "plain":
        return FlatTensorMeta
    from megatron_grpo.optional import require

    # The real server unpickles only its own class, so the payload must carry sglang's.
    module = require("sglang.srt.weight_sync.tensor_bucket", "the colocated /update_weights_from_tensor transport")
    return module.FlattenedTensorMetadata


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]], metadata_format: MetadataFormat = "sglang"
                   ) -> dict[str, Any]:
    """{"flattened_tensor", "metadata"}: all tensors' bytes concatenated (any mix of dtypes)."""
    if not named_tensors:
        raise ValueError("cannot flatten an empty bucket")
    meta_cls = _metadata_class(metadata_format)
    parts, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        metadata.append(meta_cls(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                 end_idx=offset + flat.numel(), numel=flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def unflatten_bucket(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of flatten_bucket (the fake server's side); views into the flat tensor."""
    flat = payload["flattened_tensor"]
    out = []
    for meta in payload["metadata"]:
        get = meta.get if isinstance(meta, dict) else lambda key, m=meta: getattr(m, key)
        piece = flat[get("start_idx"):get("end_idx")]
        out.append((get("name"), piece.view(get("dtype")).reshape(get("shape"))))
    return out
