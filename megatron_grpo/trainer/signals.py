"""Stop signals: a scheduler's SIGTERM / SIGUSR1 stop the run after the step in progress.

SIGTERM (a scheduler's stop / preemption) and SIGUSR1 (Slurm's `--signal=B:USR1@120` warning
before the time limit) only set a flag; the loop asks `requested()` after each step, which
all-reduces the flag so every rank stops at the same step, after a checkpoint. A process forked
from then on (megatron's checkpoint writers) starts with the default actions instead
(launch.lifetime.tie_forked_children): the flag means nothing there, and a writer that inherited
the handler ignored SIGTERM.
"""
from __future__ import annotations

import logging
import signal
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Installs flag-setting handlers for SIGTERM and SIGUSR1 (main thread only); restores the
    previous handlers on uninstall()."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignals":
        from megatron_grpo.launch.lifetime import tie_forked_children

        tie_forked_children()
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: cannot install; the flag stays unset
                log.warning("stop signals: not in the main thread, %s will not trigger a checkpoint",
                            signal.Signals(sig).name)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:  # async-signal context: only set the flag
        self.received = signum

    def requested(self) -> bool:
        """Collective: True on every rank when any rank received a stop signal."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a stop signal on another rank"
