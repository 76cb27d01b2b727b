"""Stop signals: SIGTERM, SIGUSR1, Ctrl-C (SIGINT) and a closed terminal (SIGHUP) stop the run
after the step in progress, with a checkpoint; a second Ctrl-C aborts at once, without one.

SIGTERM (a scheduler's stop / preemption), SIGUSR1 (Slurm's `--signal=B:USR1@120` warning before
the time limit), the first SIGINT and SIGHUP only set a flag; the loop asks `requested()` after
each step, which all-reduces the flag so every rank stops at the same step, after a checkpoint
(the signal may reach every rank, as torchrun and srun forward it, or only one). The first SIGINT
also says so on stderr (rank 0) and gives SIGINT back its default action, so that a second Ctrl-C
ends the process at once, by the kernel, even while it waits inside a collective; whatever it
started ends with it (launch/lifetime.py), a save it interrupts leaves only a `.tmp-step_N`.
SIGHUP points stdout and stderr that are a terminal at /dev/null first: the terminal is gone, and
a write to it would fail the run before its checkpoint. A process started with SIGINT or SIGHUP
ignored (`nohup`, a background job of a script) keeps ignoring them.

A process forked from then on (megatron's checkpoint writers) starts with the default SIGTERM /
SIGUSR1 actions instead (launch.lifetime.tie_forked_children): the flag means nothing there, and a
writer that inherited the handler ignored SIGTERM. Our long-lived children ignore SIGINT and
SIGHUP, which the terminal sends to the whole process group: they end with the trainer
(launch.lifetime.ignore_terminal_signals).
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
# Signals a terminal sends; a process started with them ignored keeps ignoring them.
TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """Installs flag-setting handlers for STOP_SIGNALS (main thread only); restores the previous
    handlers on uninstall()."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignals":
        from megatron_grpo.launch.lifetime import tie_forked_children

        tie_forked_children()
        for sig in self.signals:
            try:
                if sig in TERMINAL_SIGNALS and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # nohup / `cmd &` in a script: whoever started us wants them ignored
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: cannot install; the flag stays unset
                log.warning("stop signals: not in the main thread, %s will not trigger a checkpoint",
                            signal.Signals(sig).name)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        # Python runs this in the main thread between two bytecodes: a flag, and what must happen now.
        if self.received is None:
            self.received = signum
        if signum == signal.SIGHUP:
            _detach_from_terminal()
        elif signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next Ctrl-C ends the process, wherever it waits
            if not dist.is_initialized() or dist.get_rank() == 0:
                _say("megatron-grpo: SIGINT: stopping after the step in progress, with a checkpoint; "
                     "Ctrl-C again aborts at once, without one")

    def requested(self) -> bool:
        """Collective: True on every rank when any rank received a stop signal."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a stop signal on another rank"


def _say(text: str) -> None:
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


def _detach_from_terminal() -> None:
    """stdout / stderr that are a terminal now write to /dev/null: after SIGHUP the terminal is
    gone, and a print (the progress bar, a log line) would raise EIO in the middle of the step."""
    for fd in (1, 2):
        try:
            if os.isatty(fd):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                os.close(devnull)
        except OSError:
            pass
