"""Process lifetime: every process a run starts ends with it, also when the trainer is killed by SIGKILL.

A parent killed by SIGKILL cleans nothing up, so each child arranges its own end: Linux's
parent-death signal (prctl PR_SET_PDEATHSIG) makes the kernel signal the child when its parent dies.

  die_with_parent(parent_pid)        first call in a child we start ourselves (reward workers); also
                                     the body of preexec_die_with_parent() for subprocess.Popen
  tie_forked_children()              an os.register_at_fork hook: a child this process forks from its
                                     main thread (megatron-core's checkpoint writers) gets SIGKILL when
                                     the parent dies, and the default SIGTERM / SIGUSR1 action instead of
                                     the parent's Python handlers (the trainer's only set a flag, so an
                                     inherited one made a forked writer ignore SIGTERM); no child writes
                                     to the parent's signal wakeup fd
  tie_megatron_checkpoint_manager()  megatron-core's checkpoint writers report through a
                                     multiprocessing Manager started with the spawn method: a fresh
                                     interpreter that no fork hook reaches. Ours starts that Manager with
                                     die_with_parent as its initializer (see the function for why here)
  bind_children_to_this_process()    both of the above; launch.init_distributed() calls it
  ignore_terminal_signals()          first calls in a long-lived child of the trainer (reward workers,
                                     the local engine's process, the checkpoint Manager): a terminal's
                                     Ctrl-C (SIGINT) and hang-up (SIGHUP) reach the whole foreground
                                     process group, and only the trainer decides what they mean
                                     (trainer/signals.py: save, then stop); the child ends with it

multiprocessing's resource tracker needs nothing: it exits when the last process holding its pipe
(the trainer, the Manager, the writers) is gone. The kernel sends the parent-death signal when the
*thread* that forked the child exits, so forks from other threads are not armed (they would die
with that thread). Linux only: elsewhere these functions do nothing and say so (return False).

Only the standard library is imported at module level: spawned children import this module first.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import sys
import threading
from multiprocessing import get_context
from multiprocessing.managers import SyncManager
from typing import Callable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Signals whose Python handlers a forked child must not inherit: the trainer's StopSignals only set a
# flag that nothing in the child reads.
_RESET_IN_FORKED_CHILD = (signal.SIGTERM, signal.SIGUSR1)


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def _arm(prctl: Callable[..., int], parent_pid: int, sig: int) -> None:
    if prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Makes the kernel send `sig` to this process when its parent `parent_pid` dies; if the parent
    is already gone, sends it now. Call it first thing in a child (the parent passes os.getpid()).
    Returns False where the platform has no parent-death signal."""
    prctl = _prctl()
    if prctl is None:
        return False
    _arm(prctl, parent_pid, sig)
    return True


def ignore_terminal_signals() -> None:
    """SIGINT and SIGHUP are ignored from now on in this process (see the module docstring)."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def _start_managed_child(parent_pid: int) -> None:
    """The checkpoint Manager's initializer: dies with `parent_pid`, leaves the terminal's signals to it."""
    die_with_parent(parent_pid, signal.SIGKILL)
    ignore_terminal_signals()


def preexec_die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A preexec_fn for subprocess.Popen: the started program gets `sig` when this process dies.
    (The parent-death signal survives exec.) None where the platform has none."""
    prctl = _prctl()  # resolved here, in the parent: the preexec_fn runs between fork and exec
    if prctl is None:
        return None
    return functools.partial(_arm, prctl, os.getpid(), sig)


# ---------------------------------------------------------------------------------- forked children
# Written by the fork hook in the parent just before a fork; the child reads its copy.
_fork = {"installed": False, "parent_pid": None, "from_main_thread": False, "signal_mask": None}


def _before_fork() -> None:
    _fork["parent_pid"] = os.getpid()
    _fork["from_main_thread"] = threading.current_thread() is threading.main_thread()
    # A SIGTERM reaching the child before its hook below resets the handlers would run the inherited
    # flag-only handler (or be dropped by CPython's own after-fork cleanup), so the child would live
    # on: the forking thread holds the signals blocked across the fork; they stay pending in the child.
    _fork["signal_mask"] = signal.pthread_sigmask(signal.SIG_BLOCK, _RESET_IN_FORKED_CHILD)


def _after_fork_in_parent() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, _fork["signal_mask"])


def _after_fork_in_child() -> None:
    try:
        for sig in _RESET_IN_FORKED_CHILD:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(ValueError):  # (the forking thread is the child's main thread)
            # the parent's signal wakeup fd (trainer/signals.py watches it): a signal this child
            # gets must not read there as one the parent got
            signal.set_wakeup_fd(-1)
        if _fork["from_main_thread"] and _fork["parent_pid"] is not None:
            die_with_parent(_fork["parent_pid"], signal.SIGKILL)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, _fork["signal_mask"])  # a pending SIGTERM is delivered now


def tie_forked_children() -> bool:
    """From now on, every child this process (or a forked descendant) forks from its main thread
    dies by SIGKILL with its parent and starts with default SIGTERM / SIGUSR1 actions.
    Idempotent. Returns False where the platform has no parent-death signal."""
    if _prctl() is None:
        return False
    if not _fork["installed"]:
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                           after_in_child=_after_fork_in_child)
        _fork["installed"] = True
    return True


# ------------------------------------------------------------------- megatron-core's checkpoint Manager
def tie_megatron_checkpoint_manager() -> bool:
    """Starts megatron-core's dist-checkpointing results-queue Manager (when it first saves) with
    die_with_parent as the Manager process's initializer, so a killed trainer does not leave it
    (and, through it, multiprocessing's resource tracker) running.

    Why a patch, and why here and not in launch/cpu.py: the Manager orphans on GPU as on CPU, and
    megatron-core creates it inside filesystem_async's results-queue function (its name and
    signature per version: mcore_compat.checkpoint_results_queue_factory) with
    mp.get_context(mode).Manager(), which takes no initializer; we replace that function with one
    that builds the same Manager through SyncManager.start(initializer). Idempotent. Returns False
    when this megatron-core has no such function (then nothing is patched)."""
    from megatron_grpo.launch.mcore_compat import checkpoint_results_queue_factory

    found = checkpoint_results_queue_factory()
    if found is None:
        log.warning("megatron-core's checkpoint writer Manager is not where megatron-core 0.16-0.19 have it "
                    "(filesystem_async.get_write_results_queue); it may outlive a killed trainer")
        return False
    filesystem_async, name = found
    if getattr(getattr(filesystem_async, name), "dies_with_parent", False):
        return True

    def results_queue_dying_with_parent(mp_mode: str = "spawn"):
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=get_context(mp_mode))
            manager.start(_start_managed_child, (os.getpid(),))
            filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
        return filesystem_async._results_queue

    results_queue_dying_with_parent.dies_with_parent = True
    setattr(filesystem_async, name, results_queue_dying_with_parent)
    return True


def bind_children_to_this_process() -> None:
    """tie_forked_children() and tie_megatron_checkpoint_manager(): the children megatron-core and
    multiprocessing start for this process end with it."""
    tie_forked_children()
    tie_megatron_checkpoint_manager()
