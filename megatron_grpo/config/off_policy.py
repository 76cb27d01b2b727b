"""OffPolicyConfig: the one definition of the off-policy correction settings, torch-free. The
recipe schema types `actor.off_policy` with it, validation reports its problems, and
algo/off_policy.py computes the weights from it (see there for the definitions and sources)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_grpo.errors import ConfigError

OBJECTIVES = ("decoupled", "behaviour")
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class OffPolicyConfig:
    """Corrections for samples the trained weights did not generate (algo/off_policy.py, with sources):
    rho = pi_prox / pi_behav, the trainer's log-probs of the weights at the step start over the
    engine's; not in verl under these names (verl: algorithm.rollout_correction)."""

    # decoupled: the PPO ratio against pi_prox, each token weighted by w(rho) (AReaL);
    # behaviour: the PPO ratio against the engine's log-probs, no weight (verl's bypass mode)
    objective: Literal["decoupled", "behaviour"] = "decoupled"
    is_level: Optional[Literal["token", "sequence"]] = None  # truncated IS w = min(rho, is_cap); None = off
    is_cap: float = 2.0
    # rejection (masked IS): weight 0 where rho (token, sequence = product, geometric = mean in log
    # space) leaves [rs_low, rs_high]; None = off. rs_low None = 1 / rs_high.
    rs_level: Optional[Literal["token", "sequence", "geometric"]] = None
    rs_low: Optional[float] = None
    rs_high: float = 2.0

    @property
    def weighted(self) -> bool:
        """Whether each token's loss is multiplied by a weight from pi_prox / pi_behav."""
        return self.is_level is not None or self.rs_level is not None

    @property
    def rs_bounds(self) -> tuple[float, float]:
        return (1.0 / self.rs_high if self.rs_low is None else self.rs_low), self.rs_high

    def problems(self, key: str = "actor.off_policy") -> list[str]:
        """Every rule this combination breaks, one message each, naming `key`."""
        out = []
        if self.objective not in OBJECTIVES:
            out.append(f"{key}.objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.is_level is not None and self.is_level not in IS_LEVELS:
            out.append(f"{key}.is_level must be null or one of {', '.join(IS_LEVELS)}, got {self.is_level!r}")
        if self.rs_level is not None and self.rs_level not in RS_LEVELS:
            out.append(f"{key}.rs_level must be null or one of {', '.join(RS_LEVELS)}, got {self.rs_level!r}")
        if self.objective == "behaviour" and self.weighted:
            out.append(f"{key}.objective=behaviour clips against the engine's log-probs, so there is no "
                       "proximal/behaviour ratio to weight by: leave is_level and rs_level null")
        if not self.is_cap > 0:
            out.append(f"{key}.is_cap must be > 0, got {self.is_cap}")
        if not self.rs_high > 0:
            out.append(f"{key}.rs_high must be > 0, got {self.rs_high}")
        elif self.rs_low is not None and not 0 <= self.rs_low <= self.rs_high:
            out.append(f"{key}.rs_low must be in [0, rs_high={self.rs_high}], got {self.rs_low}")
        return out

    def check(self, key: str = "off_policy") -> None:
        """Raises one ConfigError listing the problems (for direct users of the algorithm)."""
        problems = self.problems(key)
        if problems:
            raise ConfigError("; ".join(problems))


@dataclass(frozen=True)
class OffPolicySection(OffPolicyConfig):
    """The recipe's actor.off_policy: OffPolicyConfig whose is_level defaults to `auto`, resolved
    per run by `resolve`: token-level truncated IS whenever rollouts run ahead of training
    (rollout.max_staleness > 0) and no other correction is set, else none. Why token TIS: on the
    embedded default at K = 1, no correction ends at reward 0.66 and token TIS at 0.995 (as the
    synchronous run), masked token IS at 0.72 (docs/async.md). null turns it off explicitly."""

    is_level: Optional[Literal["auto", "token", "sequence"]] = "auto"

    def resolve(self, max_staleness: int, tis_cap: Optional[float]) -> OffPolicyConfig:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(OffPolicyConfig)}
        if self.is_level == "auto":
            other = tis_cap is not None or self.rs_level is not None or self.objective == "behaviour"
            values["is_level"] = "token" if max_staleness > 0 and not other else None
        return OffPolicyConfig(**values)

    def problems(self, key: str = "actor.off_policy") -> list[str]:
        return self.resolve(1, None).problems(key) if self.is_level == "auto" else super().problems(key)
