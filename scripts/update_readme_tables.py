"""Rewrites README.md's two generated tables from the code: the verl key table (between the
verl-keys markers; tests/test_verl_keys.py checks it) and "Every recipe key" (the section's table,
from `megatron-grpo config keys`).

    .venv/bin/python scripts/update_readme_tables.py
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
CLI = [sys.executable, "-m", "megatron_grpo.cli", "config"]


def _cli(*args: str) -> str:
    return subprocess.run([*CLI, *args], check=True, capture_output=True, text=True).stdout


def render(text: str) -> str:
    """README text with both generated tables as the code makes them now."""
    text, found = re.subn(r"(<!-- verl-keys:begin[^>]*-->\n)(.*?)(<!-- verl-keys:end -->)",
                          lambda m: m.group(1) + _cli("verl-keys") + m.group(3), text, flags=re.S)
    if found != 1:
        raise SystemExit("README.md: no verl-keys markers")
    rows = [line.split("\t") for line in _cli("keys").splitlines() if line.strip()]
    table = "| key | type | default |\n|---|---|---|\n" + "".join(
        f"| `{key}` | {kind} | `{default}` |\n" for key, kind, default in rows)
    text, found = re.subn(r"(## Every recipe key\n\n[^\n]*\n\n)\| key \| type \| default \|\n\|---\|---\|---\|\n(?:\|[^\n]*\n)*",
                          lambda m: m.group(1) + table, text)
    if found != 1:
        raise SystemExit("README.md: no 'Every recipe key' table")
    return text


def main() -> None:
    README.write_text(render(README.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":
    main()
