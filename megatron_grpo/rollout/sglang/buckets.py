"""Group a stream of named tensors into size-bounded buckets (the unit of one weight-update call).

A bucket is never cut between a layer's MLA q_a_proj and kv_a_proj_with_mqa (DeepSeek-V3):
SGLang 0.5.23's DeepseekV2 loader fuses the two, and only when both arrive in one load_weights
call; split over two calls both are dropped without a word (convert.mappings.sglang_load_together)."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from megatron_grpo.convert.mappings import SGLANG_FUSED_A_PROJ


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields lists of (name, tensor) of at most `bucket_bytes` each (a larger tensor goes alone,
    a fused MLA pair together).

    Consumes the stream lazily, so at most one bucket of exported tensors is alive at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes and not _completes_fused_pair(bucket[-1][0], name):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _completes_fused_pair(previous: str, name: str) -> bool:
    first, second = SGLANG_FUSED_A_PROJ
    return previous.endswith(first) and name == previous[: -len(first)] + second
