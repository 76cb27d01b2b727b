"""Counts what would stall the host on an accelerator: a tensor's value read on the host
(`.item()`, `.tolist()`, `.cpu()` / `.numpy()`, `bool()` / `float()` / `int()` of a tensor, and
`.nonzero()`, whose result's shape depends on the values). On a CPU nothing stalls, but the calls
are the code a GPU run executes, so tests count them here (tests/test_host_syncs.py).

Each read is counted once, by the method called and where the caller is (the first frame outside
torch and this project's CPU shims). Reads of tensors built on the host (from Python lists, or
torch's CPU RNG state) count too, though they cost nothing on a GPU: a test says which sites it
expects and why."""
from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from typing import Iterator

import torch

WATCHED = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__float__", "__int__")
_SKIPPED_FILES = ("/torch/", "megatron_grpo/launch/cpu.py", "megatron_grpo/testing/host_syncs.py")


@contextlib.contextmanager
def counting_host_syncs() -> Iterator[Counter]:
    """Within the block, every outermost call of a WATCHED tensor method, from any thread, is
    counted in the yielded Counter under (method, "path:line" of its caller)."""
    counts: Counter = Counter()
    inside = threading.local()  # a read made by another read (float() calling item()) is not counted
    originals = {name: getattr(torch.Tensor, name) for name in WATCHED}

    def counted(name, original):
        def call(self, *args, **kwargs):
            if getattr(inside, "depth", 0) == 0:
                counts[(name, _caller())] += 1
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return original(self, *args, **kwargs)
            finally:
                inside.depth -= 1
        return call

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in _SKIPPED_FILES):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for marker in ("site-packages/", "megatron_grpo/", "tests/"):
        if marker in path:
            path = (marker if marker != "site-packages/" else "") + path.split(marker, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"
