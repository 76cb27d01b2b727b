"""PolicyClipConfig: the one definition of the policy loss's clip and TIS settings, torch-free. The
recipe keeps verl's flat keys (actor.clip_ratio_low, clip_ratio_high, clip_ratio_c, tis_cap);
validation reports clip_problems(), and algo/policy_loss.py computes the loss with this class."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_grpo.errors import ConfigError


def clip_problems(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
                  tis_cap: Optional[float], prefix: str = "") -> list[str]:
    """Every rule these values break, one message each, the keys named with `prefix` ("actor.")."""
    out = []
    for name, value in (("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high)):
        if not 0 <= value < 1:
            out.append(f"{prefix}{name}={value} must be in [0, 1)")
    if not clip_ratio_c > 1:
        out.append(f"{prefix}clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip bound)")
    if tis_cap is not None and not tis_cap > 0:
        out.append(f"{prefix}tis_cap={tis_cap} must be > 0 or null (off)")
    return out


@dataclass(frozen=True)
class PolicyClipConfig:
    """PPO ratio clip [1 - low, 1 + high], the dual-clip bound c for negative advantages, and the
    cap of truncated importance sampling against the engine's log-probs (None: off)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2  # DAPO clip-higher: 0.28
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (vanilla only)
    tis_cap: Optional[float] = None  # None: no truncated importance sampling

    def __post_init__(self) -> None:
        problems = clip_problems(self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c, self.tis_cap)
        if problems:
            raise ConfigError("; ".join(problems))
