"""Runs a tool call's Python code in a separate, limited process.

What limits it: its own process (own session, killed as a group on the wall-clock timeout), CPU
time (RLIMIT_CPU), address space (RLIMIT_AS: a 10 GB allocation fails with MemoryError), file size
(RLIMIT_FSIZE), a fresh scratch directory as its working directory (removed afterwards), an empty
environment, `python -I` (no user site, no PYTHON* variables). Network, writes outside the scratch
directory and starting programs are refused by a CPython audit hook (sys.addaudithook, installed
before the code runs and not removable from Python): socket creation/connect/bind, open() for
writing / os file mutations outside scratch, subprocess / os.exec* / os.system / fork, ctypes
symbol look-ups and calls (libraries such as numpy still import).

Limits of this choice (documented, not hidden): audit hooks guard against a policy model's mistakes,
not a determined attacker; native extension code that makes raw syscalls is not seen by them. No
seccomp and no network namespace are used, so that it runs unprivileged on any Linux node; for
untrusted users run the trainer inside a container without network."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal, Optional

Status = Literal["ok", "error", "timeout", "memory", "blocked"]

# The child's prelude: its limits, the hook, then the user's code read from stdin (argv: the scratch
# dir, CPU seconds, address-space bytes, file bytes). The limits are set here rather than in a
# preexec_fn: that is unsafe in the threaded trainer process and would rule out vfork, which keeps
# starting a child from a large process cheap.
_PRELUDE = r'''
import os, resource, sys
_cpu, _memory, _file = (int(v) for v in sys.argv[2:5])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (_memory, _memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (_file, _file))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_scratch = os.path.realpath(sys.argv[1])
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_MUTATE = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
           "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
_REFUSE = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.fork",
           "os.forkpty", "os.kill", "os.killpg", "pty.", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata",
           "ctypes.addressof", "_posixsubprocess", "resource.setrlimit", "resource.prlimit")
def _inside(path):
    try:
        path = os.fsdecode(path)
    except TypeError:
        return True  # a file descriptor: already open
    full = os.path.realpath(path)
    return full == _scratch or full.startswith(_scratch + os.sep)
def _hook(event, args):
    if event.startswith(_REFUSE):
        raise PermissionError(f"sandbox: {event} is not allowed (no network, no programs)")
    if event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1], args[2]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
            (isinstance(flags, int) and flags & _WRITE)
        if writes and not isinstance(path, int) and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the scratch directory is not allowed")
    elif event in _MUTATE and args and not _inside(args[0]):
        raise PermissionError(f"sandbox: {event} on {args[0]!r} outside the scratch directory is not allowed")
_code = sys.stdin.read()
sys.stdin = open(os.devnull)
sys.addaudithook(_hook)
del _hook
exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0        # wall clock; then the process group is killed
    cpu_s: int = 5                 # RLIMIT_CPU
    memory_bytes: int = 1 << 30    # RLIMIT_AS
    file_bytes: int = 16 << 20     # RLIMIT_FSIZE: largest file it may write
    max_output_chars: int = 2000   # of stdout and of stderr, each


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    stdout: str
    stderr: str
    returncode: Optional[int]

    def report(self) -> str:
        """The observation text for the model."""
        if self.status == "ok":
            return self.stdout if self.stdout.strip() else "(no output; print() the result)"
        reason = {"timeout": "stopped: time limit exceeded", "memory": "stopped: memory limit exceeded",
                  "blocked": "stopped: not allowed in the sandbox", "error": "error"}[self.status]
        detail = self.stderr.strip().splitlines()[-1:] if self.stderr.strip() else []
        return "\n".join([self.stdout.rstrip(), reason, *detail]).strip()


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), scratch_root: Optional[str] = None) -> SandboxResult:
    """Runs `code` under `limits` in a fresh scratch directory; never raises for what the code does."""
    scratch = tempfile.mkdtemp(prefix="mgrpo_tool_", dir=scratch_root)

    try:
        limit_args = [str(limits.cpu_s), str(limits.memory_bytes), str(limits.file_bytes)]
        proc = subprocess.Popen([sys.executable, "-I", "-c", _PRELUDE, scratch, *limit_args], cwd=scratch,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch},
                                start_new_session=True)
        try:
            out, err = proc.communicate(code.encode("utf-8", "replace"), timeout=limits.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    stdout = out.decode("utf-8", "replace")[: limits.max_output_chars]
    stderr = err.decode("utf-8", "replace")[-limits.max_output_chars:]
    return SandboxResult(_status(proc.returncode, stderr, timed_out), stdout, stderr, proc.returncode)


def _status(returncode: int, stderr: str, timed_out: bool) -> Status:
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if returncode == 0:
        return "ok"
    if "MemoryError" in stderr:
        return "memory"
    if "PermissionError: sandbox:" in stderr:
        return "blocked"
    return "error"
