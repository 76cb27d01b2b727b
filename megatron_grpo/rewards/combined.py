"""CombinedRewards: the rule reward (a RewardRunner) and model scorers (reward models, LLM judges:
reward_models/) combined by weights, with RewardRunner's interface (score, stream, close).

Each model scorer gets the requests whose data source weighs it non-zero, in batches of at most
its batch_size, `concurrency` batches at a time, each call on its own daemon thread and given at
most its timeout_s: past it the batch's samples fail as timeouts and the call is abandoned (its
thread ends when the call does). Under stream() a group is handed to the scorers the moment it is
submitted, so model scoring overlaps generation as the rule reward's does.

A failed sample (the call raised or timed out, or a judge's answer did not parse) scores the
scorer's failure_score and counts in reward/errors/<kind> with the rule reward's failures; more
than max_error_frac of one scorer's samples failing in a batch stops the run with one error naming
the scorer, its servers and the first failure (failures.py). Metrics per scorer:
reward/<name>/mean (its successful scores), reward/<name>/errors, time/reward_model/<name> (the
seconds its calls ran, summed over concurrent calls)."""
from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from megatron_grpo.rewards.failures import CallFailure, FailureReport, SampleView
from megatron_grpo.rewards.runner import RewardBatchResult, RewardRequest, RewardRunner, RewardStream

RULE = "rule"  # the rule reward's component name (config/reward_models.py's RULE)


@dataclass(frozen=True)
class ModelScore:
    """One sample's outcome from a model scorer: a finite score, or kind (failures.KINDS) + detail."""

    score: float | None
    kind: str | None = None
    detail: str = ""


class ModelScorer(Protocol):
    """What CombinedRewards calls: reward_models/scorers.py implements it."""

    name: str          # reward.models key: metric prefix and reward.combine component
    description: str   # for messages: its key, kind and where it runs (its URLs)
    batch_size: int
    concurrency: int   # batches in flight at once
    timeout_s: float
    failure_score: float

    def score(self, requests: Sequence[RewardRequest]) -> list[ModelScore]:
        """One outcome per request; a failure of the whole call may also raise."""

    def close(self) -> None: ...


Weight = Callable[[str, Any], float]  # (component, data_source) -> weight


class CombinedRewards:
    """sum over components of weight(component, data_source) x score; `rule` None when reward.function
    weighs 0 everywhere (it is then never called)."""

    def __init__(self, rule: RewardRunner | None, scorers: Sequence[ModelScorer], weight: Weight,
                 max_error_frac: float):
        self.rule = rule
        self.scorers = list(scorers)
        self.weight = weight
        self._reports = {s.name: FailureReport(s.description, max_error_frac, what="scorer",
                                               failure_score=s.failure_score) for s in self.scorers}

    def score(self, requests: Sequence[RewardRequest]) -> RewardBatchResult:
        stream = self.stream()
        stream.submit(0, requests)
        return stream.result()

    def stream(self) -> "CombinedStream":
        return CombinedStream(self)

    def close(self) -> None:
        try:
            if self.rule is not None:
                self.rule.close()
        finally:
            for scorer in self.scorers:
                scorer.close()

    def __enter__(self) -> "CombinedRewards":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CombinedStream:
    """RewardStream's contract (submit from any thread, result in key order) over every component."""

    def __init__(self, rewards: CombinedRewards):
        self.rewards = rewards
        self.rule: RewardStream | None = rewards.rule.stream() if rewards.rule is not None else None
        self.feeds = {s.name: _ScorerFeed(s) for s in rewards.scorers}
        self._submissions: list[tuple[int, list[RewardRequest], int, float]] = []  # key, requests, start, when
        self._count = 0
        self._lock = threading.Lock()

    def submit(self, key: int, requests: Sequence[RewardRequest]) -> None:
        requests = list(requests)
        with self._lock:
            start, self._count = self._count, self._count + len(requests)
            self._submissions.append((key, requests, start, time.perf_counter()))
        if self.rule is not None:
            self.rule.submit(key, requests)
        for name, feed in self.feeds.items():
            feed.submit([(start + i, r) for i, r in enumerate(requests)
                         if self.rewards.weight(name, _source(r)) != 0])

    def result(self) -> RewardBatchResult:
        rule = self.rule.result() if self.rule is not None else None
        ordered = sorted(self._submissions, key=lambda sub: sub[0])
        requests = [r for _, rs, _, _ in ordered for r in rs]
        order = [start + i for _, rs, start, _ in ordered for i in range(len(rs))]  # key order -> submission index
        n = len(requests)
        totals = [0.0] * n
        errors = list(rule.errors) if rule is not None else [False] * n
        metrics: dict[str, float] = dict(rule.metrics) if rule is not None else {}
        if rule is not None:
            for i, request in enumerate(requests):
                totals[i] += self.rewards.weight(RULE, _source(request)) * rule.scores[i]
            if self.feeds:
                metrics[f"reward/{RULE}/mean"] = sum(rule.scores) / n if n else 0.0
        views = [SampleView(r.prompt, r.response, r.ground_truth, _source(r)) for r in requests]
        for scorer in self.rewards.scorers:
            feed = self.feeds[scorer.name]
            outcomes = feed.wait()
            scored, failures, good = [], [], []
            for i, index in enumerate(order):
                outcome = outcomes.get(index)
                if outcome is None:
                    continue  # weight 0 for this sample's data source: not scored
                scored.append(views[i])
                if outcome.kind is None:
                    good.append(outcome.score)
                    totals[i] += self.rewards.weight(scorer.name, _source(requests[i])) * outcome.score
                else:
                    errors[i] = True
                    failures.append(CallFailure(outcome.kind, len(scored) - 1, 1, outcome.detail))
                    totals[i] += self.rewards.weight(scorer.name, _source(requests[i])) * scorer.failure_score
            counts = self.rewards._reports[scorer.name].account(failures, scored)  # raises past max_error_frac
            for key, value in counts.items():
                metrics[key] = metrics.get(key, 0.0) + value
            metrics[f"reward/{scorer.name}/errors"] = counts["reward/errors"]
            if good:
                metrics[f"reward/{scorer.name}/mean"] = sum(good) / len(good)
            metrics[f"time/reward_model/{scorer.name}"] = feed.busy_s
        self._latencies(metrics)
        sample_metrics = rule.sample_metrics if rule is not None else [dict() for _ in range(n)]
        return RewardBatchResult(totals, sample_metrics, errors, metrics)

    def _latencies(self, metrics: dict[str, float]) -> None:
        """reward/first_latency_s and reward/last_latency_s over every component: from the first
        and the last submission to its last score."""
        if not self._submissions or not self.feeds:
            return
        for name, (_, requests, start, submitted) in (("first", self._submissions[0]), ("last", self._submissions[-1])):
            done = [feed.done_at.get(start + i, submitted) for feed in self.feeds.values()
                    for i in range(len(requests))]
            latency = max(done, default=submitted) - submitted
            key = f"reward/{name}_latency_s"
            metrics[key] = max(metrics.get(key, 0.0), latency)


def _source(request: RewardRequest) -> Any:
    return (request.extra or {}).get("data_source")


class _ScorerFeed:
    """One scorer's share of a stream (module docstring): batches dispatched as requests arrive."""

    def __init__(self, scorer: ModelScorer):
        self.scorer = scorer
        self._cond = threading.Condition()
        self._pending: deque[tuple[int, RewardRequest]] = deque()
        self._live: dict[int, list[int]] = {}  # batch id -> its sample indices, while its call runs
        self._ids = itertools.count()
        self._expected = 0
        self.outcomes: dict[int, ModelScore] = {}
        self.done_at: dict[int, float] = {}
        self.busy_s = 0.0

    def submit(self, items: list[tuple[int, RewardRequest]]) -> None:
        with self._cond:
            self._pending.extend(items)
            self._expected += len(items)
            self._dispatch()

    def wait(self) -> dict[int, ModelScore]:
        with self._cond:
            while len(self.outcomes) < self._expected:
                self._cond.wait()
            return dict(self.outcomes)

    def _dispatch(self) -> None:  # under the lock
        while self._pending and len(self._live) < self.scorer.concurrency:
            batch = [self._pending.popleft() for _ in range(min(self.scorer.batch_size, len(self._pending)))]
            batch_id = next(self._ids)
            self._live[batch_id] = [index for index, _ in batch]
            timer = threading.Timer(self.scorer.timeout_s, self._expire, (batch_id,))
            timer.daemon = True
            threading.Thread(target=self._call, args=(batch_id, batch, timer), daemon=True,
                             name=f"reward-model-{self.scorer.name}").start()
            timer.start()

    def _call(self, batch_id: int, batch: list[tuple[int, RewardRequest]], timer: threading.Timer) -> None:
        started = time.perf_counter()
        try:
            outcomes = self.scorer.score([request for _, request in batch])
            if len(outcomes) != len(batch):
                raise RuntimeError(f"{self.scorer.description} returned {len(outcomes)} scores for "
                                   f"{len(batch)} samples")
        except Exception as exc:  # noqa: BLE001 - every sample of the call fails, counted, the batch goes on
            kind = "timeout" if isinstance(exc, TimeoutError) else "raised"  # e.g. a server's HTTP timeout
            outcomes = [ModelScore(None, kind, traceback.format_exc())] * len(batch)
        timer.cancel()
        finished = time.perf_counter()
        with self._cond:
            if self._live.pop(batch_id, None) is None:
                return  # timed out already: its samples are counted as timeouts
            self.busy_s += finished - started
            for (index, _), outcome in zip(batch, outcomes):
                self.outcomes[index] = outcome
                self.done_at[index] = finished
            self._dispatch()
            self._cond.notify_all()

    def _expire(self, batch_id: int) -> None:
        with self._cond:
            indices = self._live.pop(batch_id, None)
            if indices is None:
                return
            now = time.perf_counter()
            self.busy_s += self.scorer.timeout_s
            detail = (f"{self.scorer.description}: a batch of {len(indices)} samples took longer than "
                      f"timeout_s={self.scorer.timeout_s:g} s; its call was abandoned")
            for index in indices:
                self.outcomes[index] = ModelScore(None, "timeout", detail)
                self.done_at[index] = now
            self._dispatch()
            self._cond.notify_all()
