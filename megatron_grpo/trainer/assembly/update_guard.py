"""Non-finite gradients: the update is skipped, and a run of them stops training.

NonFiniteUpdateGuard wraps the megatron optimizer. Megatron reports a failed update only through a
grad scaler (fp16); in fp32 / bf16 a NaN or Inf gradient would be clipped to NaN and applied. The
guard computes the global grad norm before stepping; when it is not finite the update is skipped
(step() returns update_successful=False, so train_step counts it in actor/updates_skipped) and
after `limit` skipped updates in a row the run stops with NonFiniteUpdatesError.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from megatron_grpo.errors import MegatronGRPOError

log = logging.getLogger(__name__)


class NonFiniteUpdatesError(MegatronGRPOError):
    """Too many consecutive updates had NaN / Inf gradients."""


class NonFiniteUpdateGuard:
    """A megatron optimizer whose step() refuses non-finite gradients. Everything else is
    delegated to `inner` (state dicts, param_groups, zero_grad, ...)."""

    def __init__(self, inner, limit: int):
        self.inner = inner
        self.limit = limit
        self.consecutive = 0
        self.total = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _has_grad_scaler(self) -> bool:
        parts = getattr(self.inner, "chained_optimizers", None) or [self.inner]
        return any(getattr(p, "grad_scaler", None) is not None for p in parts)

    @torch.no_grad()
    def step(self):
        if not self._has_grad_scaler():  # with a scaler megatron checks (and skips) itself
            # Copies model grads to the main grads (idempotent; inner.step() repeats it) so the
            # norm is over the gradients the update would use; the norm is reduced over all
            # ranks that hold gradient shards, so every rank takes the same decision.
            self.inner.prepare_grads()
            grad_norm = float(self.inner.get_grad_norm())
            if not math.isfinite(grad_norm):
                return self._skip(grad_norm)
        update_ok, grad_norm, zeros = self.inner.step()
        if update_ok:
            self.consecutive = 0
        else:
            self._skip(float("nan") if grad_norm is None else float(grad_norm))
        return update_ok, grad_norm, zeros

    def _skip(self, grad_norm: float):
        self.consecutive += 1
        self.total += 1
        if self.limit and self.consecutive >= self.limit:
            raise NonFiniteUpdatesError(
                f"stopping: {self.consecutive} updates in a row had a non-finite gradient (grad norm {grad_norm}) "
                f"and were skipped (trainer.max_consecutive_nan_steps={self.limit}); check the rewards and data, "
                f"or lower actor.optim.lr; resume from the last checkpoint after fixing it")
        if dist.get_rank() == 0:
            log.warning("skipped an update: non-finite gradient (grad norm %s); %d in a row, %d in total",
                        grad_norm, self.consecutive, self.total)
        return False, grad_norm, None

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))
