"""Faults the CPU scheduler injects for tests, read from the server's environment (the server's
command line stays exactly SGLang's):

    HARNESS_DIE_ON_GENERATE=N     the process exits hard (os._exit) at the N-th /generate request
                                  (health probes not counted)
    HARNESS_FORWARD_DELAY_S=S     sleep S seconds before every forward pass (slows generation)
    HARNESS_SKIP_WEIGHT=NAME      weight updates skip the tensor NAME without a word, as SGLang's
                                  load_weights skips a name its model does not know (a mis-named push)
    HARNESS_INSTANT=1             no forward pass: every request ends at its first decode step with
                                  one token, the EOS, of log-prob 0.0 (a well-formed answer at once,
                                  to benchmark the client's own overhead; see CpuScheduler._decode_one)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Faults:
    die_on_generate: int = 0
    forward_delay_s: float = 0.0
    skip_weight: str = ""
    instant: bool = False

    @classmethod
    def from_env(cls) -> "Faults":
        return cls(die_on_generate=int(os.environ.get("HARNESS_DIE_ON_GENERATE", "0")),
                   forward_delay_s=float(os.environ.get("HARNESS_FORWARD_DELAY_S", "0")),
                   skip_weight=os.environ.get("HARNESS_SKIP_WEIGHT", ""),
                   instant=bool(int(os.environ.get("HARNESS_INSTANT", "0"))))

    def on_generate(self, count: int) -> None:
        if self.die_on_generate and count >= self.die_on_generate:
            os._exit(17)  # the scheduler dies mid-request; SGLang's watchdog then ends the server

    def before_forward(self) -> None:
        if self.forward_delay_s:
            time.sleep(self.forward_delay_s)
