"""Checks that build/sglang-runtime-venv is whole: every package of requirements.txt at its pinned
version, SGLang's and the router's code importable, `sgl_kernel` the stand-in beside this file, and
torch the base venv's. Exit 0, or 1 with one line per problem (scripts/setup_sglang_runtime.sh then
rebuilds the venv from scratch: a partial install never passes for a good one).

    build/sglang-runtime-venv/bin/python tools/sglang_cpu/verify_install.py EXPECTED_TORCH
"""
from __future__ import annotations

import importlib
import warnings
import re
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)$")


def problems(expected_torch: str) -> list[str]:
    warnings.simplefilter("ignore")  # SGLang warns at import about GPU-only quantization methods
    out = []
    for line in (HERE / "requirements.txt").read_text().splitlines():
        match = PIN.match(line.strip())
        if not match:
            continue
        name, pinned = match.groups()
        try:
            got = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(f"{name}=={pinned} is not installed")
            continue
        if got != pinned:
            out.append(f"{name} is {got}, expected {pinned}")
    for module in ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler", "sglang_router",
                   "sgl_kernel"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # what a broken install raises varies: say which module and why
            out.append(f"import {module} failed: {type(exc).__name__}: {exc}")
    kernel = sys.modules.get("sgl_kernel")
    if kernel is not None and Path(kernel.__file__).resolve().parent.parent != HERE:
        out.append(f"sgl_kernel comes from {kernel.__file__}, not the stand-in in {HERE}")
    import torch

    if torch.__version__.split("+")[0] != expected_torch:
        out.append(f"torch is {torch.__version__}, expected the base venv's {expected_torch}")
    return out


if __name__ == "__main__":
    found = problems(sys.argv[1])
    for line in found:
        print(f"sglang-runtime-venv: {line}", file=sys.stderr)
    sys.exit(1 if found else 0)
