"""Hang watchdog: every rank's phase as a heartbeat file, and one report when a rank stops making progress.

    dog = HangWatchdog(run_dir / "heartbeats" / life, run_dir / "hangs" / life, rank, world_size, timeout_s).start()
    dog.phase("rollout", step)           # the main thread, at each phase change (= progress)
    ...
    dog.report("gloo collective timed out: ...")   # the main thread, after a collective timeout
    dog.stop()                           # a clean end: the files go, the thread ends

A thread writes this rank's heartbeat (`rank-N.json`: phase, step, detail, seconds since the last
phase change, a counter) every `poll_s` and reads every other rank's. Peers are judged by when their
counter last changed on this rank's own clock, so nodes need no common time. A rank is

  * stuck      when it made no progress (phase change) for `timeout_s`, by its own heartbeat;
  * silent     when its counter has not moved for SILENT_AFTER_S: its process does not run (SIGSTOP,
               a node gone, frozen in C with the GIL held) and cannot say anything itself.

When any rank is stuck, or silent for `timeout_s`, every rank that still runs dumps its Python stacks
(faulthandler: `<hangs>/rank-N.txt` and stderr), the lowest rank that is not silent writes the
summary (one line on stderr and `<hangs>/summary.json`) naming the stuck ranks and their phase, and
every rank exits with HANG_EXIT_CODE. A collective timeout (gloo raises after the process group's
timeout, which the trainer sets below `timeout_s`) goes through the same `report`, from the main
thread, and is raised as HangError.

Which ranks the summary calls stuck: the silent ones if any; else those whose (step, phase) the
fewest ranks share (rank 0 scoring rewards while the others wait in the batch's broadcast); else all.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from megatron_grpo.errors import HANG_EXIT_CODE, HangError, MegatronGRPOError

log = logging.getLogger(__name__)

SILENT_AFTER_S = 5.0  # a heartbeat counter that has not moved this long: the process does not run
COLLECTIVE_TIMEOUT_SHARE = 0.9  # process-group timeout = this x hang_timeout_s: gloo raises first
_SUMMARY_WAIT_S = 5.0  # the others wait this long for the reporter's summary before they exit


def collective_timeout_s(hang_timeout_s: float) -> float:
    return COLLECTIVE_TIMEOUT_SHARE * hang_timeout_s


def is_collective_timeout(exc: BaseException | None) -> bool:
    """gloo's 'Timed out waiting Nms for recv/send ...' or 'Application timeout caused pair closure' (a
    RuntimeError), also as the cause of another
    error; a project error that says 'timed out' (an SGLang request) is not one."""
    for _ in range(10):
        if exc is None:
            return False
        text = str(exc).lower()
        # gloo says "Timed out waiting ..." or "Application timeout caused pair closure" (a peer's timeout)
        if isinstance(exc, RuntimeError) and not isinstance(exc, MegatronGRPOError) and \
                ("timed out" in text or "timeout" in text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(frozen=True)
class PeerView:
    rank: int
    host: str
    pid: int
    step: int
    phase: str
    detail: str
    idle_s: float    # seconds since its last phase change, as it last said
    silent_s: float  # seconds since its heartbeat last moved, on this rank's clock

    @property
    def where(self) -> str:
        return f"{self.phase} (step {self.step}{', ' + self.detail if self.detail else ''})"


class HangWatchdog:
    def __init__(self, folder: Path, hang_dir: Path, rank: int, world_size: int, timeout_s: float,
                 poll_s: float = 1.0):
        self.folder, self.hang_dir, self.rank, self.world_size = Path(folder), Path(hang_dir), rank, world_size
        self.timeout_s, self.poll_s = float(timeout_s), poll_s
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # phase() and the thread both write the one heartbeat file
        self._phase, self._step, self._detail = "start", 0, ""
        self._progress_at = time.monotonic()
        self._count = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it last moved here)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = threading.Event()

    # ------------------------------------------------------------------ the main thread
    def start(self) -> "HangWatchdog":
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread = threading.Thread(target=self._run, name="megatron-grpo-watchdog", daemon=True)
        self._thread.start()
        return self

    def phase(self, name: str, step: int, detail: str = "") -> None:
        with self._lock:
            moved = (name, step) != (self._phase, self._step)
            self._phase, self._step, self._detail = name, step, detail
            self._progress_at = time.monotonic()
        if moved:  # at once, so that a rank stopped right after says where (details wait for the thread)
            try:
                self._write()
            except OSError:
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s * 5)
        if self._reported.is_set():
            return  # the heartbeats stay beside the report (and a rank woken late reads them)
        try:
            (self.folder / f"rank-{self.rank}.json").unlink()
            if self.rank == 0:
                self.folder.rmdir()  # empty once every rank has stopped; otherwise left, harmless
        except OSError:
            pass

    def report(self, cause: str) -> NoReturn:
        """Dumps this rank's stacks, writes the summary when this rank is the reporter, and raises
        HangError (the main thread, after a collective timeout)."""
        summary = self._report(cause)
        raise HangError(summary)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._write()
                peers = self._read()
            except OSError as exc:  # a full or vanished run folder: the run says so elsewhere
                log.warning("hang watchdog: %s", exc)
                continue
            if self._hung(peers) and not self._reported.is_set():
                self._report(f"no progress for {self.timeout_s:g} s (trainer.hang_timeout_s)", peers, say=True)
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except (OSError, ValueError):
                        pass
                os._exit(HANG_EXIT_CODE)  # the main thread is stuck: nothing else can end this process

    def _hung(self, peers: dict[int, PeerView]) -> bool:
        return any(p.idle_s >= self.timeout_s or p.silent_s >= self.timeout_s for p in peers.values())

    def _write(self) -> None:
        with self._write_lock:  # the newest count is the one left on disk
            with self._lock:
                self._count += 1
                beat = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "step": self._step,
                        "phase": self._phase, "detail": self._detail,
                        "idle_s": round(time.monotonic() - self._progress_at, 3), "count": self._count}
            path = self.folder / f"rank-{self.rank}.json"
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(beat))
            os.replace(tmp, path)

    def _read(self) -> dict[int, PeerView]:
        now = time.monotonic()
        peers = {}
        for rank in range(self.world_size):
            try:
                beat = json.loads((self.folder / f"rank-{rank}.json").read_text())
            except (OSError, ValueError):  # not written yet (a rank still starting), or mid-replace
                beat = None
            if beat is None:
                count, last = self._seen.get(rank, (-1, now))
                self._seen[rank] = (count, last)
                peers[rank] = PeerView(rank, "?", 0, 0, "not started", "", 0.0, now - last)
                continue
            count, last = self._seen.get(rank, (None, now))
            if count != beat["count"]:
                last = now
            self._seen[rank] = (beat["count"], last)
            peers[rank] = PeerView(rank, beat["host"], beat["pid"], beat["step"], beat["phase"], beat["detail"],
                                   beat["idle_s"], now - last)
        return peers

    # ------------------------------------------------------------------ the report
    def _report(self, cause: str, peers: dict[int, PeerView] | None = None, say: bool = False) -> str:
        self._reported.set()
        if peers is None:
            peers = self._read()
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        stacks = self.hang_dir / f"rank-{self.rank}.txt"
        with open(stacks, "w") as handle:
            me = peers.get(self.rank)
            handle.write(f"rank {self.rank} pid {os.getpid()}: {me.where if me else '?'}; {cause}\n")
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        sys.stderr.write(f"megatron-grpo: hang watchdog, rank {self.rank}: Python stacks (also in {stacks}):\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        stuck, silent = stuck_ranks(peers, min(SILENT_AFTER_S, self.timeout_s))
        line = summary_line(peers, stuck, silent, cause, self.hang_dir)
        reporter = min((r for r in peers if r not in silent), default=self.rank)
        path = self.hang_dir / "summary.json"
        if self.rank == reporter:
            record = {"at": time.time(), "cause": cause, "stuck_ranks": stuck, "silent_ranks": silent,
                      "phases": {str(r): {"phase": p.phase, "step": p.step, "detail": p.detail, "host": p.host,
                                          "pid": p.pid, "idle_s": round(p.idle_s, 1),
                                          "silent_s": round(p.silent_s, 1)} for r, p in peers.items()},
                      "summary": line, "reporter": self.rank}
            tmp = path.with_name(f".summary-{self.rank}.json.tmp")
            tmp.write_text(json.dumps(record, indent=1))
            try:  # the first report stands: a stopped rank that a launcher's SIGCONT wakes reports late
                os.link(tmp, path)
            except FileExistsError:
                line = json.loads(path.read_text())["summary"]
                say = False
            finally:
                tmp.unlink()
            if say:  # the exception path raises HangError, which the CLI prints as this line
                sys.stderr.write(f"error: {line}\n")
                sys.stderr.flush()
        else:  # leave the reporter time to write before a launcher ends the job on this exit
            deadline = time.monotonic() + _SUMMARY_WAIT_S
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        return line


def stuck_ranks(peers: dict[int, PeerView], silent_after_s: float = SILENT_AFTER_S) -> tuple[list[int], list[int]]:
    """(the ranks the summary names as stuck, the silent ones): see the module docstring."""
    silent = sorted(r for r, p in peers.items() if p.silent_s >= silent_after_s)
    if silent:
        return silent, silent
    places = Counter((p.step, p.phase) for p in peers.values())
    fewest = min(places.values())
    if len(places) > 1 and fewest < max(places.values()):
        return sorted(r for r, p in peers.items() if places[(p.step, p.phase)] == fewest), []
    return sorted(peers), []


def summary_line(peers: dict[int, PeerView], stuck: list[int], silent: list[int], cause: str,
                 hang_dir: Path) -> str:
    parts = []
    for r in stuck:
        p = peers[r]
        state = (f"silent for {p.silent_s:.0f} s (stopped or frozen)" if r in silent
                 else f"no progress for {p.idle_s:.0f} s")
        parts.append(f"rank {r} ({p.host} pid {p.pid}) in {p.where}, {state}")
    others: dict[str, list[int]] = {}
    for r, p in sorted(peers.items()):
        if r not in stuck:
            others.setdefault(p.where, []).append(r)
    waiting = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} waiting in {w}"
                        for w, rs in others.items())
    return (f"hang: stuck: {'; '.join(parts)}{'; ' + waiting if waiting else ''}; {cause}; "
            f"stacks in {hang_dir}/rank-*.txt; exit {HANG_EXIT_CODE}")
