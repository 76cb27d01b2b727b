"""Peak device memory of a block of torch code, by phase, from the storages it creates.

MemoryTracker is a TorchDispatchMode: every tensor an op returns is looked at once per storage
(views share it), its bytes are added to the live total, and a weakref callback takes them off
when the storage is freed. Each storage keeps the category it was born in (the phase that
created it, e.g. "parameters", "optimizer state"), so the report can say what the peak is made
of. It runs on fake tensors (the planner: FakeTensorMode, no memory is really allocated) and on
real ones (the validation: the same step for real, compared with the fake figures).

Scalar reads (`.item()`, `float(t)`) have no value under fake tensors; with answer_scalar_reads
numbers read 1 and booleans False, which size nothing in the step functions the planner runs
(grad norms, metrics, Adam's step count: 1 keeps its bias correction finite).
torch's MemTracker (torch.distributed._tools.mem_tracker) does the same bookkeeping with module
hooks as well; on a 40-layer stage it made the simulation ~9x slower, so this one keeps to storages.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_RESIZE = (torch.ops.aten.resize_.default, torch.ops.aten.set_.source_Storage,
           torch.ops.aten.set_.source_Storage_storage_offset)


@dataclass
class PhasePeak:
    """The highest live total inside one phase, and what it was made of then."""

    phase: str
    peak_bytes: int = 0
    by_category: dict[str, int] = field(default_factory=dict)
    end_bytes: int = 0  # live when the phase ended


class MemoryTracker(TorchDispatchMode):
    def __init__(self, answer_scalar_reads: bool = False) -> None:
        super().__init__()
        self.answer_scalar_reads = answer_scalar_reads
        self.live_bytes = 0
        self.by_category: dict[str, int] = {}
        self.phases: list[PhasePeak] = []
        self._storages: dict[int, tuple[weakref.ref, int, str]] = {}
        self._phase: PhasePeak | None = None
        self._category = "other"

    # ---- phases -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, category: str | None = None):
        """Storages created inside are filed under `category` (the phase name by default)."""
        previous_phase, previous_category = self._phase, self._category
        self._phase, self._category = PhasePeak(name), category or name
        self._record_peak()
        try:
            yield self._phase
        finally:
            self._phase.end_bytes = self.live_bytes
            self.phases.append(self._phase)
            self._phase, self._category = previous_phase, previous_category

    def file_under(self, category: str) -> None:
        """Files what is created from now on under `category` (until this is called again or the
        current phase ends): module hooks split a phase, e.g. logits from layer activations."""
        self._category = category

    def track(self, tensors, category: str) -> None:
        """Counts tensors created outside the tracker (or moves them into `category`)."""
        for tensor in tensors:
            self._see(tensor, category, recategorise=True)
        self._record_peak()

    def peak(self) -> PhasePeak:
        return max(self.phases, key=lambda p: p.peak_bytes)

    # ---- bookkeeping ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _SCALAR_READ and self.answer_scalar_reads:
            tensor = args[0]
            if not isinstance(tensor, FakeTensor):  # a real tensor inside the fake mode: its value
                with unset_fake_temporarily():
                    return func(*args)
            return False if tensor.dtype == torch.bool else (1.0 if tensor.dtype.is_floating_point else 1)
        out = func(*args, **(kwargs or {}))
        if func in _RESIZE:
            self._resized(args[0])
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._see(value, self._category)
        self._record_peak()
        return out

    def _see(self, tensor: torch.Tensor, category: str, recategorise: bool = False) -> None:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse / nested: nothing the step makes
            return
        key = id(storage)
        known = self._storages.get(key)
        if known is not None and known[0]() is storage:
            if recategorise and known[2] != category:
                self._add(known[2], -known[1])
                self._add(category, known[1])
                self._storages[key] = (known[0], known[1], category)
            return
        nbytes = storage.nbytes()
        ref = weakref.ref(storage, lambda _, key=key: self._freed(key))
        self._storages[key] = (ref, nbytes, category)
        self._add(category, nbytes)

    def _resized(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        known = self._storages.get(id(storage))
        if known is not None and known[0]() is storage and storage.nbytes() != known[1]:
            self._add(known[2], storage.nbytes() - known[1])
            self._storages[id(storage)] = (known[0], storage.nbytes(), known[2])

    def _freed(self, key: int) -> None:
        known = self._storages.pop(key, None)
        if known is not None:
            self._add(known[2], -known[1])

    def _add(self, category: str, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.by_category[category] = self.by_category.get(category, 0) + nbytes

    def _record_peak(self) -> None:
        phase = self._phase
        if phase is not None and self.live_bytes > phase.peak_bytes:
            phase.peak_bytes = self.live_bytes
            phase.by_category = {k: v for k, v in self.by_category.items() if v}
