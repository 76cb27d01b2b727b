"""The cross-rank patterns of the trainer, each written once (over the default process group).

    broadcast_from_rank0(value)     every rank gets rank 0's small picklable value
    all_gather_objects(value)       every rank's small picklable value, in rank order
    raise_if_any_failed(message)    every rank raises when any rank failed (its message or None)
    on_rank0(fn, *args)             fn on rank 0; every rank gets its result or its error
    rank0_only(fn, *args)           the same, the result staying on rank 0
    attempt_on_rank0 / agree        the two halves, for rank-0 work that interleaves with
                                    collectives (a weight push while every rank drains the export)
    in_turns(turn, turns, fn)       fn on every rank, all at once or turn by turn (barriers)

The error rule (Invariants, "Every rank stops together", docs/architecture.md): a project error
(MegatronGRPOError) on rank 0 reaches every rank as itself; any other exception is a bug: rank 0
raises it with its traceback, the others raise Rank0Failure naming it. No rank is left waiting in
a collective for a peer that failed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

import torch.distributed as dist

from megatron_grpo.errors import MegatronGRPOError, Rank0Failure

T = TypeVar("T")


def broadcast_from_rank0(value: Any) -> Any:
    """Every rank gets global rank 0's `value` (a small picklable object; others pass anything)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's `value` (small, picklable), in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def raise_if_any_failed(message: Optional[str], error: type[MegatronGRPOError] = MegatronGRPOError) -> None:
    """Collective: `error` on every rank when any rank passed a message (the first failing rank's,
    prefixed by its rank when there are several)."""
    failures = [(rank, m) for rank, m in enumerate(all_gather_objects(message)) if m is not None]
    if failures:
        rank, first = failures[0]
        raise error(first if dist.get_world_size() == 1 else f"rank {rank}: {first}")


def in_turns(turn: Optional[int], num_turns: int, fn: Callable[[], T]) -> T:
    """Collective: fn() on every rank. turn None: all at once; else the ranks of turn 0 first, then
    those of turn 1, ... with a barrier between turns. fn must not raise (return the failure): a
    rank that left the loop would leave the others waiting at a barrier."""
    if turn is None:
        return fn()
    result = None
    for current in range(num_turns):
        if current == turn:
            result = fn()
        dist.barrier()
    return result


@dataclass(frozen=True)
class Rank0Outcome(Generic[T]):
    """What rank 0's part of a collective step produced: a value, or a project error."""

    value: Optional[T] = None
    error: Optional[MegatronGRPOError] = None
    bug: Optional[BaseException] = None  # not a project error: stays on rank 0 (agree raises it)


def attempt_on_rank0(fn: Callable[..., T], *args: Any) -> Rank0Outcome[T]:
    """fn(*args), on rank 0 only, with its failure caught (see agree)."""
    try:
        return Rank0Outcome(value=fn(*args))
    except MegatronGRPOError as exc:
        return Rank0Outcome(error=exc)
    except BaseException as exc:  # a bug (or an interrupt): agree() raises it on rank 0, Rank0Failure elsewhere
        return Rank0Outcome(bug=exc)


def agree(outcome: Optional[Rank0Outcome[T]], *, share_value: bool = True) -> Rank0Outcome[T]:
    """Collective: rank 0's outcome on every rank (`outcome` is ignored elsewhere). A bug is raised
    (as itself on rank 0, as Rank0Failure on the others); a project error is returned for the
    caller to raise or retry. With share_value=False the value stays on rank 0 (None elsewhere)."""
    is_rank0 = dist.get_rank() == 0
    sent = None
    if is_rank0:
        bug = outcome.bug
        failure = Rank0Failure(f"rank 0 failed: {type(bug).__name__}: {bug}") if bug is not None else None
        sent = (outcome.value if share_value else None, outcome.error, failure)
    value, error, failure = broadcast_from_rank0(sent)
    if failure is not None:
        raise outcome.bug if is_rank0 else failure
    return Rank0Outcome(value=outcome.value if is_rank0 else value, error=error)


def on_rank0(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on global rank 0; every rank returns its result (small and picklable), or raises
    its error (module docstring)."""
    return _raise_or_value(agree(attempt_on_rank0(fn, *args) if dist.get_rank() == 0 else None))


def rank0_only(fn: Callable[..., T], *args: Any) -> Optional[T]:
    """fn(*args) on global rank 0, whose result stays there (other ranks get None); its error is
    raised on every rank. For what only rank 0 holds: the rollout engine, the reward workers, the
    metric sinks."""
    outcome = attempt_on_rank0(fn, *args) if dist.get_rank() == 0 else None
    return _raise_or_value(agree(outcome, share_value=False))


def _raise_or_value(outcome: Rank0Outcome[T]) -> T:
    if outcome.error is not None:
        raise outcome.error
    return outcome.value
