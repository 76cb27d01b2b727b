"""ServerRotation: which of several servers a request tries next (the SGLang client's generation
and the reward models' scorer servers share it).

Servers take turns (round robin). A server that failed is sat out for `dead_cooldown_s`. For each
try of a request the candidates come in tiers: live servers this request has not tried, then any
live one, then one it has not tried, then any; the caller picks within the first tier that is not
empty (the client by load, the scorers the first in turn). Thread-safe."""
from __future__ import annotations

import itertools
import threading
import time
from typing import Sequence


class ServerRotation:
    def __init__(self, urls: Sequence[str], dead_cooldown_s: float = 30.0):
        self.dead_cooldown_s = dead_cooldown_s
        self._turn = itertools.count()
        self._dead_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self.set_urls(urls)

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    def set_urls(self, urls: Sequence[str]) -> None:
        """The servers later tries use. They were just found alive (or restarted), so none of them
        stays in its failure cooldown."""
        if not urls:
            raise ValueError("a server rotation needs at least one server URL")
        with self._lock:
            self._urls = [u.rstrip("/") for u in urls]
            for url in self._urls:
                self._dead_until.pop(url, None)

    def mark_dead(self, url: str) -> None:
        with self._lock:
            self._dead_until[url] = time.monotonic() + self.dead_cooldown_s

    def is_dead(self, url: str) -> bool:
        with self._lock:
            return self._dead_until.get(url, 0.0) > time.monotonic()

    def first_tier(self, tried: Sequence[str]) -> list[str]:
        """This try's candidates, in this turn's order (never empty; see the module docstring)."""
        now = time.monotonic()
        with self._lock:
            first = next(self._turn)
            order = [self._urls[(first + i) % len(self._urls)] for i in range(len(self._urls))]
            alive = [u for u in order if self._dead_until.get(u, 0.0) <= now]
        untried = [u for u in order if u not in tried]
        return next(tier for tier in ([u for u in alive if u not in tried], alive, untried, order) if tier)
