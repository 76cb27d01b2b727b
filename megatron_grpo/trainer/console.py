"""The console may go away under a running trainer: the terminal closes (writes to it then fail
with EIO) or whatever read a pipe exits (EPIPE). Neither may fail the run, whose record is
metrics.jsonl, the logs written to files and the checkpoints: a console stream that is gone has
its descriptor pointed at /dev/null, and the run goes on.

    with console_may_be_gone():   # around a console write (the progress bar, a printed line)
        print(text, flush=True)

A stream is gone when poll(2) reports an error on it: a hung-up terminal and a pipe without a
reader do, a working terminal, a file or /dev/null never do (a file that fails is an error).
"""
from __future__ import annotations

import contextlib
import errno
import os
import select
from typing import Iterator

CONSOLE_GONE = (errno.EIO, errno.EPIPE)
CONSOLE_FDS = (1, 2)  # stdout, stderr


def is_gone(fd: int) -> bool:
    """Whether writes to `fd` can only fail: a hung-up terminal or a pipe nobody reads."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    try:
        return any(events & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, events in poller.poll(0))
    except OSError:
        return False


def to_devnull(fd: int) -> None:
    """From now on writes to `fd` succeed and go nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def detach_gone_console(also: tuple[int, ...] = ()) -> None:
    """Points stdout / stderr at /dev/null where they are gone, and the descriptors in `also`."""
    for fd in CONSOLE_FDS:
        try:
            if fd in also or is_gone(fd):
                to_devnull(fd)
        except OSError:
            pass


@contextlib.contextmanager
def console_may_be_gone() -> Iterator[None]:
    """Around a write to stdout / stderr: EIO or EPIPE (the console went away) detaches the
    console instead of failing the run. Any other error is raised."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in CONSOLE_GONE:
            raise
        detach_gone_console()
