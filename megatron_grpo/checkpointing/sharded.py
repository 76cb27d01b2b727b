"""Model chunks as megatron dist_checkpointing sees them, and what its reads raise.

One key scheme for every torch_dist folder this project writes (training checkpoints' model_optim/,
`convert hf-to-megatron`'s model/): "model" for one chunk, "model0", "model1", ... for virtual
pipeline chunks (megatron-LM's names), so either kind loads into any layout.
"""
from __future__ import annotations

import re
from typing import Collection, Sequence

import torch
from torch.distributed.checkpoint.api import CheckpointException

# What reading a torch_dist folder can raise: torch DCP reports a failed collective read as
# CheckpointException, a BaseException, so `except Exception` alone lets it through as a traceback.
READ_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


def model_sharded_state_dict(model_chunks: Sequence[torch.nn.Module]) -> dict:
    """{"model": ...} or {"model0": ..., "model1": ...}: each chunk's (unwrapped) sharded state dict."""
    from megatron_grpo.models.builder import unwrap

    chunks = [unwrap(c) for c in model_chunks]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def load_model_state(model_chunks: Sequence[torch.nn.Module], loaded: dict) -> None:
    """Copies what dist_checkpointing.load returned for model_sharded_state_dict's keys into the chunks."""
    from megatron_grpo.models.builder import unwrap

    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    for key, chunk in zip(keys, model_chunks):
        unwrap(chunk).load_state_dict(loaded[key])


def short_error(exc: BaseException) -> str:
    """'Type: first line' of an error whose text may hold whole tracebacks; for torch DCP's
    CheckpointException (which carries every failing rank's exception), of the first rank's."""
    failures = getattr(exc, "failures", None) if isinstance(exc, CheckpointException) else None
    if failures:
        rank, failure = next(iter(sorted(failures.items())))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {short_error(inner)}"
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\][^\n]*")


def os_error_text(exc: BaseException, codes: Collection[int]) -> str | None:
    """The one-line text of the first OSError with an errno in `codes` inside `exc`: itself, its
    __cause__ / __context__ chain, exceptions among its args, a CheckpointException's per-rank
    failures. Failing that, the first "[Errno N] ..." with N in `codes` in their messages: an error
    from megatron's checkpoint writer processes arrives as text only ("Worker failure: [Errno 28]
    No space left on device: ...", its cause lost on the way between processes). None if neither."""
    pending, seen, texts = [exc], set(), []
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in codes:
            return str(current)
        texts.append(str(current))
        failures = getattr(current, "failures", None) if isinstance(current, CheckpointException) else None
        for value in [*(failures or {}).values(), *current.args, current.__cause__, current.__context__]:
            inner = value[0] if isinstance(value, tuple) and value else value  # DCP's (exception, traceback)
            if isinstance(inner, BaseException):
                pending.append(inner)
    for text in texts:
        for match in _ERRNO_TEXT.finditer(text):
            if int(match[1]) in codes:
                return match[0].strip()
    return None
