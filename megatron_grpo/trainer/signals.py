"""Stop signals: SIGTERM, SIGUSR1, Ctrl-C (SIGINT) and a closed terminal (SIGHUP) stop the run
after the step in progress, with a checkpoint; a second Ctrl-C aborts at once, without one.

SIGTERM (a scheduler's stop / preemption), SIGUSR1 (Slurm's `--signal=B:USR1@120` warning before
the time limit), the first SIGINT and SIGHUP only set a flag; the loop asks `requested()` after
each step, which all-reduces the flag so every rank stops at the same step, after a checkpoint
(the signal may reach every rank, as torchrun and srun forward it, or only one). The first SIGINT
also says so on stderr (rank 0) and gives SIGINT back its default action, so that a second Ctrl-C
ends the process at once, by the kernel, wherever it waits; whatever it started ends with it
(launch/lifetime.py), a save it interrupts leaves only a `.tmp-step_N`.
torchrun's ranks run in sessions of their own: torchrun forwards the first Ctrl-C as SIGINT, and
answers a second one with SIGTERM (then SIGKILL 30 s later). So SIGTERM after SIGINT is a second
Ctrl-C too: one line (rank 0), then exit 130 at once. Python runs signal handlers in the main
thread only, between bytecodes: a main thread waiting inside a collective (gloo, a CUDA sync)
runs none, so a first Ctrl-C there has not yet given SIGINT its default action. A thread of ours
therefore also watches the signals as they arrive (the interpreter's wakeup fd: its C-level
handler writes each signal's number there at once) and ends the process on a second Ctrl-C
(SIGINT or SIGTERM after SIGINT) wherever the main thread is.
SIGHUP points stdout and stderr that were or are a terminal, or that are gone (console.py), at
/dev/null first: the terminal is gone (a hung-up terminal no longer says it is one), and a write
to it would fail the run. A process started with SIGINT or SIGHUP ignored (`nohup`, a background
job of a script) keeps ignoring them.

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
import threading
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.trainer.console import CONSOLE_FDS, detach_gone_console

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
        self._terminals: tuple[int, ...] = ()  # stdout / stderr that were a terminal at install()
        self._interrupted = False  # a SIGINT came: SIGTERM from now on is a second Ctrl-C
        self._wakeup_fd: int | None = None  # the write end of the watcher's pipe (set_wakeup_fd)
        self._aborting = threading.Lock()

    def install(self) -> "StopSignals":
        from megatron_grpo.launch.lifetime import tie_forked_children

        tie_forked_children()
        self._terminals = _terminal_fds()
        for sig in self.signals:
            try:
                if sig in TERMINAL_SIGNALS and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # nohup / `cmd &` in a script: whoever started us wants them ignored
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: cannot install; the flag stays unset
                log.warning("stop signals: not in the main thread, %s will not trigger a checkpoint",
                            signal.Signals(sig).name)
        if signal.SIGINT in self._previous:
            self._start_watcher()
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._wakeup_fd is not None:
            current = signal.set_wakeup_fd(-1)
            if current != self._wakeup_fd:  # someone set theirs since: it stays
                signal.set_wakeup_fd(current)
            os.close(self._wakeup_fd)  # the watcher reads the end of its pipe and ends
            self._wakeup_fd = None

    def _start_watcher(self) -> None:
        """The thread that ends the process on a second Ctrl-C while the main thread cannot
        (module docstring). Not when something else (an asyncio loop) owns the wakeup fd."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup_fd = write_fd
        threading.Thread(target=self._watch, args=(read_fd,), name="stop-signals", daemon=True).start()

    def _watch(self, read_fd: int) -> None:
        interrupted = False
        try:
            while data := os.read(read_fd, 64):
                for signum in data:
                    if interrupted and signum in (signal.SIGINT, signal.SIGTERM):
                        self._abort(signum)
                    interrupted = interrupted or signum == signal.SIGINT
        except OSError:
            pass
        finally:
            os.close(read_fd)

    def _abort(self, signum: int) -> None:
        """Ends this process at once (exit 130), after one line on rank 0: a second Ctrl-C."""
        if not self._aborting.acquire(blocking=False):
            return  # the other thread is ending the process
        if not dist.is_initialized() or dist.get_rank() == 0:
            why = "SIGINT again" if signum == signal.SIGINT else \
                "SIGTERM after SIGINT (torchrun's answer to a second Ctrl-C)"
            _say(f"megatron-grpo: {why}: aborting at once, without a checkpoint")
        os._exit(130)

    def _handle(self, signum, frame) -> None:
        # Python runs this in the main thread between two bytecodes: a flag, and what must happen now.
        if signum == signal.SIGTERM and self._interrupted:
            self._abort(signum)  # torchrun's answer to a second Ctrl-C
        if self.received is None:
            self.received = signum
        if signum == signal.SIGHUP:
            detach_gone_console(also=self._terminals + _terminal_fds())
        elif signum == signal.SIGINT:
            self._interrupted = True
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


def _terminal_fds() -> tuple[int, ...]:
    return tuple(fd for fd in CONSOLE_FDS if os.isatty(fd))
