"""The SGLang engines of a run, their health, and what happens when one dies.

As slime and NeMo-RL handle it:
- a periodic `/health_generate` probe (with a timeout) takes an engine that stopped answering out of
  the generation rotation; requests it left unfinished are retried on the others by the client;
- at the next weight sync, an engine this trainer launched is restarted and receives the current
  weights with the others before it serves again; an engine given by URL (started by someone else)
  stays out, with a warning;
- fewer than `min_engines` left: SGLangUnavailableError, which stops the run cleanly after the
  finished steps are checkpointed.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron_grpo.rollout.sglang.errors import SGLangError, SGLangUnavailableError
from megatron_grpo.rollout.sglang.http_json import request_json
from megatron_grpo.rollout.sglang.weight_sync import EngineTarget

log = logging.getLogger(__name__)


@dataclass
class EngineSlot:
    target: EngineTarget
    # Relaunches this engine and waits until it is healthy; None for engines given by URL.
    restart: Optional[Callable[[], None]] = None
    alive: bool = True


class EnginePool:
    def __init__(self, slots: Sequence[EngineSlot], *, min_engines: int = 1, probe_timeout_s: float = 60.0,
                 api_key: str | None = None, on_change: Callable[[list[EngineTarget]], None] | None = None):
        if not slots:
            raise ValueError("EnginePool needs at least one engine")
        self.slots = list(slots)
        self.min_engines = min_engines
        self.probe_timeout_s = probe_timeout_s
        self.api_key = api_key
        self.on_change = on_change  # told the live engines after every change of the rotation
        self.restarts = 0
        self._lock = threading.Lock()

    @property
    def alive_targets(self) -> list[EngineTarget]:
        return [s.target for s in self.slots if s.alive]

    def is_healthy(self, url: str) -> bool:
        """/health_generate: the engine generated a token (SGLang answers after >= 1 s by design)."""
        return self._answers(url, "/health_generate")

    def is_up(self, url: str) -> bool:
        """/model_info: the server's HTTP process answers, without the scheduler generating. What a
        sync needs to know first (a killed engine does not answer); a scheduler that hangs behind a
        live server fails the sync's own requests and the background probe. /health_generate here
        would add a second to every step."""
        return self._answers(url, "/model_info")

    def _answers(self, url: str, path: str) -> bool:
        try:
            request_json(url, path, method="GET", timeout_s=self.probe_timeout_s, api_key=self.api_key)
            return True
        except SGLangError as exc:
            log.warning("SGLang engine %s failed its health probe (%s): %s", url, path, exc)
            return False

    def probe(self, generate: bool = True) -> list[str]:
        """Probes every live engine (generating a token, or only asking the server if `generate` is
        false); returns the URLs found dead (they leave the rotation)."""
        check = self.is_healthy if generate else self.is_up
        with self._lock:
            dead = [s for s in self.slots if s.alive and not check(s.target.url)]
            for slot in dead:
                slot.alive = False
        if dead:
            self._changed()
        return [s.target.url for s in dead]

    def recover(self) -> bool:
        """Before a weight sync: finds the engines that are down (a server probe, which also works
        while their memory is released), restarts dead launched engines, drops dead URL-given
        ones. Returns whether an engine was restarted (a new process: it must join the
        weight-update group again); raises below `min_engines`."""
        self.probe(generate=False)
        changed = False
        with self._lock:
            for slot in self.slots:
                if slot.alive:
                    continue
                if slot.restart is None:
                    log.warning("SGLang engine %s is gone and was not launched by this trainer: it stays out of "
                                "the rotation", slot.target.url)
                    continue
                log.warning("restarting SGLang engine %s", slot.target.url)
                try:
                    slot.restart()
                except SGLangError as exc:
                    log.warning("restarting SGLang engine %s failed: %s", slot.target.url, exc)
                    continue
                slot.alive = True
                self.restarts += 1
                changed = True
            alive = self.alive_targets
        if len(alive) < self.min_engines:
            gone = [s.target.url for s in self.slots if not s.alive]
            raise SGLangUnavailableError(f"only {len(alive)} of {len(self.slots)} SGLang engines are alive (gone: "
                                         f"{gone}); rollout.sglang.min_engines={self.min_engines}", gone[0])
        if changed:
            self._changed()
        return changed

    def _changed(self) -> None:
        if self.on_change is not None and self.alive_targets:
            self.on_change(self.alive_targets)


class HealthProber:
    """Probes the pool every `interval_s` seconds in a daemon thread while `enabled()`; `paused()`
    holds it off (a paused or updating engine answers /health_generate slowly with 503, and an
    engine whose memory is released cannot generate at all)."""

    def __init__(self, pool: EnginePool, interval_s: float, enabled: Callable[[], bool] = lambda: True):
        self.pool = pool
        self.interval_s = interval_s
        self.enabled = enabled
        self._stop = threading.Event()
        self._idle = threading.Lock()
        self._held = False  # pause() holds _idle
        self._thread = threading.Thread(target=self._run, name="sglang-health", daemon=True)

    def start(self) -> "HealthProber":
        if self.interval_s > 0:
            self._thread.start()
        return self

    def paused(self):
        return self._idle

    def pause(self) -> None:
        """paused() across calls (a per-stage update spans several); idempotent."""
        if not self._held:
            self._idle.acquire()
            self._held = True

    def resume(self) -> None:
        if self._held:
            self._held = False
            self._idle.release()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._idle:
                if self.enabled():
                    self.pool.probe()

    def stop(self) -> None:
        self._stop.set()

