"""After a trainer step of a job failed: why, from which checkpoint, and whether to start it again.

    python -m megatron_grpo.launch.restarts RUN_DIR --exit-code RC --srun-log FILE --log-offset BYTES
        --started EPOCH_S --save-dir DIR --max-restarts N

slurm/lib/grpo_common.sh calls this once per failed trainer step (the engines and the router keep
running). It reads what the failure left: srun's first `task N: ...` line in the batch log after
`--log-offset` (the rank that failed first, killed by a signal or exited with a code) and a hang
summary written since `--started` (launch/watchdog.py: the stuck ranks and their phase); the newest
complete checkpoint under `--save-dir`; and `restarts.jsonl` in the run folder. Then

  * restart (exit 0): appends one row to restarts.jsonl (time, exit code, reason death / hang /
    signal, the rank, the last complete step, the step's srun line) and prints one line, and on a
    second line `step=N` (the checkpoint the next trainer continues from, 0: none);
  * stop (exit 1): the failure came `--max-restarts` times in a row with no newer checkpoint between
    (a failure that repeats at the same step): prints one line saying so, writes no row.

Only the standard library: it runs in the job's python before anything else is imported.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_grpo.errors import HANG_EXIT_CODE

RESTARTS_FILE = "restarts.jsonl"

# srun: error: node1: task 2: Killed  /  srun: error: node1: tasks 0-1,3: Exited with exit code 1
_SRUN_TASK = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+)$")
_EXITED = re.compile(r"Exited with exit code (\d+)")
_TERMINATED_BY_SRUN = 128 + 15  # a task's shell after SIGTERM


def _exit_code(what: str) -> int | None:
    """The code of srun's "Exited with exit code N"; None for a task ended by a signal."""
    code = _EXITED.search(what)
    return None if code is None else int(code[1])


@dataclass(frozen=True)
class Failure:
    exit_code: int                # the srun step's (for a step of several ranks, often srun's own 143)
    reason: str                   # hang | signal | death
    rank: str | None              # "2", "0-1,3", or None when nothing says
    detail: str                   # srun's line, or the hang summary


def classify(exit_code: int, srun_lines: list[str], hang: dict | None) -> Failure:
    """The first task srun reports failing is the one that failed first: the others are killed
    after it (--kill-on-bad-exit). When that task exited with the hang code (or srun said nothing),
    the hang summary names the stuck ranks; a summary after a death is its consequence, not the cause."""
    reported = [(match, line) for line in srun_lines if (match := _SRUN_TASK.search(line)) is not None]
    # A task that exited with 143 was ended by srun's SIGTERM after another task failed
    # (--kill-on-bad-exit); srun may print it before the cause when both arrive at once.
    causes = [(m, line) for m, line in reported if _exit_code(m["what"]) != _TERMINATED_BY_SRUN]
    if not causes and hang is None:
        causes = reported  # every task was terminated: a stop from outside (scancel, preemption)
    for match, line in causes:
        code = _exit_code(match["what"])
        if code is None:
            return Failure(exit_code, "signal", match["tasks"], line.strip())
        if code != HANG_EXIT_CODE:
            return Failure(exit_code, "death", match["tasks"], line.strip())
        break
    else:
        if exit_code != HANG_EXIT_CODE and hang is None:
            return Failure(exit_code, "signal" if exit_code > 128 else "death", None, f"exit code {exit_code}")
    stuck = (hang or {}).get("stuck_ranks") or []
    return Failure(exit_code, "hang", ",".join(map(str, stuck)) or None,
                   (hang or {}).get("summary", f"exit code {HANG_EXIT_CODE}, no summary"))


def newest_hang_summary(run_dir: Path, since: float) -> dict | None:
    found = []
    for path in (run_dir / "hangs").glob("*/summary.json"):
        try:
            if path.stat().st_mtime >= since:
                found.append((path.stat().st_mtime, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return max(found, key=lambda item: item[0])[1] if found else None


def last_complete_step(save_dir: Path) -> int:
    steps = []
    for path in save_dir.glob("step_*/complete.json"):
        try:
            steps.append(int(path.parent.name.removeprefix("step_")))
        except ValueError:
            continue
    return max(steps, default=0)


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / RESTARTS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a row cut short by a full disk: the rest still counts
            continue
    return rows


def failures_at_step(rows: list[dict], step: int) -> int:
    """Restarts in a row (the newest rows) that continued from `step`."""
    count = 0
    for row in reversed(rows):
        if row.get("last_complete_step") != step:
            break
        count += 1
    return count


def decide(run_dir: Path, save_dir: Path, failure: Failure, max_restarts: int, now: float) -> tuple[bool, str, int]:
    """(restart?, the one line, the step the next trainer continues from); appends the row on restart."""
    rows = read_rows(run_dir)
    step = last_complete_step(save_dir)
    where = f"rank {failure.rank}" if failure.rank else "a rank"
    already = failures_at_step(rows, step)
    if already >= max_restarts:
        return False, (f"not restarting the trainer: it failed {already + 1} times in a row with no checkpoint "
                       f"after step {step} (this time {failure.reason}, {where}: {failure.detail}); "
                       f"GRPO_MAX_RESTARTS={max_restarts}"), step
    row = {"time": now, "restart": len(rows) + 1, "exit_code": failure.exit_code, "reason": failure.reason,
           "rank": failure.rank, "last_complete_step": step, "detail": failure.detail}
    with open(run_dir / RESTARTS_FILE, "a") as handle:
        handle.write(json.dumps(row) + "\n")
    return True, (f"restart {row['restart']} of the trainer ({failure.reason}, {where}, exit code "
                  f"{failure.exit_code}) from step {step}; {already + 1} of {max_restarts} in a row at this "
                  f"step"), step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo.launch.restarts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--exit-code", type=int, required=True)
    parser.add_argument("--srun-log", type=Path, required=True)
    parser.add_argument("--log-offset", type=int, default=0)
    parser.add_argument("--started", type=float, required=True, help="when the failed step started (epoch s)")
    parser.add_argument("--save-dir", type=Path, required=True)
    parser.add_argument("--max-restarts", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        with open(args.srun_log, errors="replace") as handle:
            handle.seek(args.log_offset)
            lines = handle.read().splitlines()
    except OSError:
        lines = []
    failure = classify(args.exit_code, lines, newest_hang_summary(args.run_dir, args.started))
    restart, line, step = decide(args.run_dir, args.save_dir, failure, args.max_restarts, time.time())
    print(line)
    print(f"step={step}")
    return 0 if restart else 1


if __name__ == "__main__":
    sys.exit(main())
