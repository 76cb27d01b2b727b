"""Group a stream of named tensors into size-bounded buckets (the unit of one weight-update call)."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields lists of (name, tensor) of at most `bucket_bytes` each (a larger tensor goes alone).

    Consumes the stream lazily, so at most one bucket of exported tensors is alive at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
