"""The doctor's findings and their table: one row per check, one line per blocker."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class Status(enum.Enum):
    OK = "ok"
    NOTE = "note"  # works, but the user should know (a version other than the tested one, ...)
    BLOCKER = "BLOCKER"  # the job would fail: exit 1


@dataclass(frozen=True)
class Finding:
    check: str  # what was looked at: "torch", "model folder", "port 30000"
    needs: str  # what the recipe needs of it
    has: str  # what this node has
    status: Status

    @classmethod
    def ok(cls, check: str, needs: str, has: str) -> "Finding":
        return cls(check, needs, has, Status.OK)

    @classmethod
    def note(cls, check: str, needs: str, has: str) -> "Finding":
        return cls(check, needs, has, Status.NOTE)

    @classmethod
    def blocker(cls, check: str, needs: str, has: str) -> "Finding":
        return cls(check, needs, has, Status.BLOCKER)


def render_table(findings: Sequence[Finding], title: str) -> str:
    """A fixed-width table (columns: check, needs, has, status), then one `blocker:` line each."""
    header = ("check", "needs", "has", "status")
    rows = [header] + [(f.check, f.needs, f.has, f.status.value) for f in findings]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [title]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3])
    lines += [f"blocker: {f.check}: needs {f.needs}, has {f.has}" for f in blockers(findings)]
    return "\n".join(lines) + "\n"


def blockers(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.status is Status.BLOCKER]
