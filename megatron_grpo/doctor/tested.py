"""The versions tested together on a GPU cluster: the pins of requirements/cluster-cu13.txt (shipped
in the package as cluster-cu13.txt, which the top-level file links to), read once."""
from __future__ import annotations

import functools
import re
from pathlib import Path

PINS_FILE = Path(__file__).resolve().parent / "cluster-cu13.txt"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;#]+)")


def canonical(name: str) -> str:
    """PEP 503 name: `Megatron_Core` and `megatron-core` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=1)
def pinned_versions() -> dict[str, str]:
    """{canonical distribution name: pinned version} of every `name==version` line of the lock."""
    pins = {}
    for line in PINS_FILE.read_text(encoding="utf-8").splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins
