"""A stand-in for torch_memory_saver (a CUDA virtual-memory allocator) in the SGLang test server.

With --enable-memory-saver, SGLang 0.5.23's engine creates its TorchMemorySaverAdapter in the
server process, which imports torch_memory_saver and wraps the scheduler's start in
`configure_subprocess()` (LD_PRELOAD of its CUDA hook). Neither exists without a GPU. Here
`configure_subprocess` is a no-op context and the allocator's region/pause/resume do nothing: the
scheduler side of the memory tags is the harness's CpuMemorySaver (scheduler.py), which zeroes
released weights as a GPU loses them. Installed only where the real package does not import."""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types


class _NoopSaver:
    hook_mode = "preload"

    @contextlib.contextmanager
    def region(self, tag: str = "", enable_cpu_backup: bool = False):
        yield

    @contextlib.contextmanager
    def cuda_graph(self, **kwargs):
        yield

    def disable(self):
        return contextlib.nullcontext()

    def pause(self, tag: str | None = None) -> None:
        pass

    def resume(self, tag: str | None = None) -> None:
        pass


def install() -> None:
    if "torch_memory_saver" in sys.modules or importlib.util.find_spec("torch_memory_saver") is not None:
        return
    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = _NoopSaver()
    module.configure_subprocess = contextlib.nullcontext
    sys.modules["torch_memory_saver"] = module
