"""One run per run folder: rank 0 of a training run holds `<folder>/.run.lock` while the run lives.

The lock is a POSIX record lock (fcntl F_SETLK, `fcntl.lockf`) on that file, not the file's
existence: the kernel drops it when the holding process ends, however it ends (kill -9 included),
so a dead run never leaves its folder stuck, and an in-job restart (the next srun step, torchrun
--max-restarts) finds it free once its previous life's rank 0 is gone. A record lock belongs to
the process that took it: the children it forks (megatron's checkpoint writers) do not hold it, so
none can keep it after the run. The holder records its host, pid and start time in the file; a
second start reads them for its one-line refusal. Works on NFS (lockd); on a filesystem without
locks (Lustre mounted without -o flock) the run starts with a warning that nothing guards it.

A record lock is also dropped when its process closes any descriptor of the file: only this
module opens it, once per holder.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from megatron_grpo.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
_HELD = (errno.EACCES, errno.EAGAIN)  # what F_SETLK answers when another process holds the lock
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # the filesystem has no record locks


class RunFolderBusy(ConfigError):
    """Another live run holds the folder (exit code 2, one line naming the holder)."""


@dataclass
class FolderLock:
    """This process's lock on one folder (file None: the filesystem has no locks)."""

    folder: Path
    file: IO[str] | None

    def release(self) -> None:
        if self.file is None:
            return
        try:
            self.file.seek(0)
            self.file.truncate()  # a holder that appears later never shows this run's details
        except OSError:
            pass
        self.file.close()  # drops the lock
        self.file = None


@dataclass
class HeldFolders:
    """The locks of a run's folders (logging.output_dir, checkpoint.save_dir)."""

    locks: list[FolderLock] = field(default_factory=list)

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def lock_folder(key: str, folder: Path) -> FolderLock:
    """Takes `<folder>/.run.lock` (the folder exists) for this process, or raises RunFolderBusy
    naming the run that holds it. Writes nothing into the folder when refused (beyond creating
    the empty lock file where it was missing). Other OSErrors (an unwritable folder) propagate."""
    path = folder / LOCK_FILE
    handle = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+", encoding="utf-8")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _HELD:
            holder = _describe(handle.read())
            handle.close()
            raise RunFolderBusy(f"{key}={folder} is in use by another run ({holder}; its lock {path}): wait for "
                                f"it to end or stop it, or use another {key}") from None
        handle.close()
        if exc.errno not in _NO_LOCKS:
            raise
        log.warning("run folder: %s cannot be locked (%s): nothing stops a second run from using %s at the same time",
                    path, exc.strerror, folder)
        return FolderLock(folder, None)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(record) + "\n")
    handle.flush()
    return FolderLock(folder, handle)


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["started"])))
        return f"pid {holder['pid']} on host {holder['host']}, started {started}"
    except (ValueError, KeyError, TypeError):  # the holder has not written its details yet
        return "a process that has not recorded itself yet"
