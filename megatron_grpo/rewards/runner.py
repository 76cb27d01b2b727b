"""RewardRunner: scores a batch of responses in a pool of spawned worker processes.

Each call has a timeout that starts when a worker receives it; a call that raises, times out, kills
its worker or returns something that is not a score gets reward 0 and is counted per kind in
metrics["reward/errors/<kind>"] (failures.py: the first of each kind is logged once with its
traceback; more than max_error_frac failed calls in a batch raise RewardFailure). verl's
compute_score signature is detected and adapted (signature.py).
A timed-out worker is killed and replaced, so a hung function never blocks a batch. Results come
back in input order. Workers die with the process that started them, also when it is killed by
SIGKILL (launch.lifetime.die_with_parent).

With num_workers=0 the calls run in this process, one at a time, each in a helper thread that the
caller waits on for at most timeout_s: a call past it is a timeout as in the pool (score 0,
reward/errors/timeout), and the batch goes on. Python cannot stop a thread, so a hung call goes on
in its abandoned thread (holding whatever it holds, using CPU if it spins) until the process ends;
only the pool reclaims it (its worker is killed). timeout_s=None calls in the caller's thread.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from megatron_grpo.errors import ConfigError
from megatron_grpo.rewards._worker import worker_main
from megatron_grpo.rewards.failures import BadResult, CallFailure, FailureReport, SampleView, normalize
from megatron_grpo.rewards.loader import RewardSpec, canonical_spec, prepare_reward_function


@dataclass(frozen=True)
class RewardRequest:
    """One response to score. `extra` is the record's extra_info (plus whatever the caller adds);
    `messages` the prompt's chat messages, which model scorers render with their own chat template
    (None: `prompt` as one user message); reward functions are called without them, as before."""

    prompt: str
    response: str
    ground_truth: Any
    extra: dict = field(default_factory=dict)
    messages: tuple | None = None


@dataclass
class RewardBatchResult:
    scores: list[float]                     # input order; 0.0 for every failed call
    sample_metrics: list[dict[str, float]]  # the extra keys a function returned, per sample
    errors: list[bool]                      # True where the call failed (error or timeout)
    metrics: dict[str, float]               # reward/errors, reward/timeouts, reward/<key> means


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    ready: bool = False
    task: tuple[int, float] | None = None  # (task id, deadline) while busy


class RewardRunner:
    """Scores RewardRequests with the reward function named by `function` (see loader.py).

    num_workers=0 calls the function in this process (no isolation; a call past timeout_s is given
    up on, not stopped: see the module docstring). batched=True calls
    fn(prompts, responses, ground_truths, extras) -> list on chunks of `chunk_size` requests
    (default: an even split over the workers); a failed chunk fails all its samples. A function
    whose parameters say it is batched (responses / solution_strs) is called batched anyway.
    `signature` (auto | verl | native) and `max_error_frac` are reward.signature / max_error_frac.
    """

    def __init__(self, function: str, *, num_workers: int = 4, timeout_s: float | None = 30.0,
                 kwargs: dict | None = None, batched: bool = False, chunk_size: int | None = None,
                 startup_timeout_s: float = 120.0, signature: str = "auto", max_error_frac: float = 0.5):
        if num_workers < 0:
            raise ConfigError(f"reward.num_workers must be >= 0, got {num_workers}")
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s must be > 0 or null, got {timeout_s}")
        self.spec = canonical_spec(function)
        self.kwargs = dict(kwargs or {})
        self._load_spec = RewardSpec(self.spec, signature)  # what each worker loads
        # fails here, early, with the spec in the message: missing function, wrong arity
        prepared = prepare_reward_function(self._load_spec, self.kwargs)
        self._fn = prepared.fn
        self.batched = batched or prepared.convention.batched
        self.chunk_size = chunk_size
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self.signature, self.max_error_frac = signature, max_error_frac  # reward.signature / max_error_frac
        self._failures = FailureReport(self.spec, max_error_frac)
        self._in_process = _InProcessCalls(self._fn, self.kwargs, timeout_s, self.spec)
        self._workers: list[_Worker] = [self._start_worker() for _ in range(num_workers)]
        self._pool_in_use = threading.Lock()
        self.workers_replaced = 0  # how many workers were killed (timeout) or died

    # -- pool management -------------------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(target=worker_main,
                                        args=(child_conn, self._load_spec, self.kwargs, os.getpid()),
                                        daemon=True, name="reward-worker")
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn)

    def _replace(self, index: int) -> None:
        worker = self._workers[index]
        worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()
        self._workers[index] = self._start_worker()
        self.workers_replaced += 1

    def close(self) -> None:
        self._in_process.close()
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=10)
            worker.conn.close()
        self._workers = []

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, requests: Sequence[RewardRequest]) -> RewardBatchResult:
        tasks = self._make_tasks(requests)
        if self.num_workers == 0:
            outcomes = [self._call_here(args) for args in tasks]
        else:
            with self._pool_in_use:
                outcomes = self._run_pool(_TaskFeed(tasks, closed=True))
        return self._collect(requests, tasks, outcomes)

    def stream(self) -> "RewardStream":
        """Scoring that starts before the batch is complete: submit() requests as they arrive (from
        any thread), result() for all of them in key order. One stream or score() at a time."""
        return RewardStream(self)

    def _make_tasks(self, requests: Sequence[RewardRequest]) -> list[tuple]:
        rows = [(r.prompt, r.response, r.ground_truth, r.extra) for r in requests]
        if not self.batched:
            return rows
        size = self.chunk_size or max(1, math.ceil(len(rows) / max(1, self.num_workers)))
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        return [tuple(list(column) for column in zip(*chunk)) for chunk in chunks]

    def _call_here(self, args: tuple) -> tuple[str, Any]:
        return self._in_process.call(args)

    @property
    def abandoned_calls(self) -> int:
        """In-process calls given up on after timeout_s (each still runs in its thread)."""
        return self._in_process.abandoned

    def _run_pool(self, feed: "_TaskFeed") -> list[tuple[str, Any]]:
        """Runs every task of `feed` (also those added while it runs, until it is closed); returns
        (status, payload) per task: ("ok", result) | ("error", text) | ("timeout", text)."""
        tasks = feed.tasks  # grows while the feed is open
        outcomes: list[tuple[str, Any] | None] = []
        queue: deque[int] = deque()
        remaining = 0
        last_progress = time.monotonic()
        while True:
            closed, arrived = feed.closed, len(tasks)  # closed first: nothing arrives after it
            for task_id in range(len(outcomes), arrived):
                outcomes.append(None)
                queue.append(task_id)
                remaining += 1
            if closed and not remaining:
                break
            for worker in self._workers:
                if worker.ready and worker.task is None and queue:
                    task_id = queue.popleft()
                    deadline = time.monotonic() + self.timeout_s if self.timeout_s is not None else math.inf
                    worker.task = (task_id, deadline)
                    worker.conn.send((task_id, tasks[task_id]))
            now = time.monotonic()
            deadlines = [w.task[1] for w in self._workers if w.task is not None]
            wait_s = min([d - now for d in deadlines] + [1.0])
            ready_conns = wait([w.conn for w in self._workers] + [feed.waker], timeout=max(0.0, wait_s))
            if feed.waker in ready_conns:
                feed.drain()
            for index, worker in enumerate(list(self._workers)):
                if worker.conn not in ready_conns:
                    continue
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError):
                    if worker.task is not None:
                        outcomes[worker.task[0]] = ("error", f"reward worker process died (exit code "
                                                              f"{worker.process.exitcode}) during the call")
                        remaining -= 1
                        feed.finished(worker.task[0])
                    self._replace(index)
                    continue
                if message[0] == "ready":
                    worker.ready = True
                elif message[0] == "fatal":
                    raise ConfigError(f"reward function {self.spec!r} failed to load in a worker:\n{message[1]}")
                else:
                    task_id, ok, payload = message
                    outcomes[task_id] = ("ok", payload) if ok else ("error", payload)
                    worker.task = None
                    remaining -= 1
                    feed.finished(task_id)
                    last_progress = time.monotonic()
            now = time.monotonic()
            for index, worker in enumerate(list(self._workers)):
                if worker.task is not None and now >= worker.task[1]:
                    outcomes[worker.task[0]] = ("timeout", f"reward call timed out after {self.timeout_s} s "
                                                           f"({self.spec}); its worker was replaced")
                    remaining -= 1
                    feed.finished(worker.task[0])
                    last_progress = now
                    self._replace(index)
            if not any(w.ready for w in self._workers) and now - last_progress > self.startup_timeout_s:
                raise RuntimeError(f"no reward worker became ready within {self.startup_timeout_s} s")
        return outcomes  # type: ignore[return-value]

    def _collect(self, requests: Sequence[RewardRequest], tasks: list[tuple],
                 outcomes: list[tuple[str, Any]]) -> RewardBatchResult:
        n = len(requests)
        scores, sample_metrics, errors = [0.0] * n, [dict() for _ in range(n)], [False] * n
        failures: list[CallFailure] = []
        start = 0
        for args, (status, payload) in zip(tasks, outcomes):
            count = len(args[0]) if self.batched else 1
            span = range(start, start + count)
            start += count
            kind = {"error": "raised", "timeout": "timeout"}.get(status)
            if status == "ok":
                try:
                    results = payload if self.batched else [payload]
                    if self.batched and (not isinstance(results, (list, tuple)) or len(results) != count):
                        raise BadResult("bad_type", f"a batched call must return a list of {count} results, got "
                                                    f"{type(results).__name__} of length {_length(results)}")
                    normalized = [normalize(r) for r in results]
                except BadResult as exc:
                    kind, payload = exc.kind, f"{self.spec}: {exc}"
                else:
                    for i, (score, extras) in zip(span, normalized):
                        scores[i], sample_metrics[i] = score, extras
                    continue
            for i in span:
                errors[i] = True
            failures.append(CallFailure(kind, span.start, count, str(payload)))
        inputs = [SampleView(r.prompt, r.response, r.ground_truth, (r.extra or {}).get("data_source"))
                  for r in requests]
        metrics = self._failures.account(failures, inputs)  # raises RewardFailure past max_error_frac
        keys = sorted({k for m in sample_metrics for k in m})
        for key in keys:
            values = [m[key] for m in sample_metrics if key in m]
            metrics[f"reward/{key}"] = sum(values) / len(values)
        return RewardBatchResult(scores, sample_metrics, errors, metrics)


def _call(fn, args: tuple, kwargs: dict) -> tuple[str, Any]:
    import traceback

    try:
        return "ok", fn(*args, **kwargs)
    except Exception:
        return "error", traceback.format_exc()


class _InProcessCalls:
    """num_workers=0: one call at a time in a daemon helper thread, waited on for at most timeout_s
    (module docstring). A thread whose call timed out is abandoned (told to exit once its call
    returns, if ever) and the next call gets a new one."""

    def __init__(self, fn, kwargs: dict, timeout_s: float | None, spec: str):
        self.fn, self.kwargs, self.timeout_s, self.spec = fn, kwargs, timeout_s, spec
        self.abandoned = 0
        self._requests: queue.SimpleQueue | None = None  # the current helper thread's

    def call(self, args: tuple) -> tuple[str, Any]:
        if self.timeout_s is None:
            return _call(self.fn, args, self.kwargs)
        if self._requests is None:
            self._requests = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._requests,), name="reward-call", daemon=True).start()
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put((args, answer))
        try:
            return answer.get(timeout=self.timeout_s)
        except queue.Empty:
            self._requests.put(None)  # read only if the hung call ever returns: then the thread exits
            self._requests = None
            self.abandoned += 1
            return "timeout", (f"reward call timed out after {self.timeout_s} s ({self.spec}); with "
                               f"reward.num_workers=0 it runs in the trainer's process, where it cannot be stopped: "
                               f"it goes on in an abandoned thread (reward.num_workers >= 1 kills a hung call)")

    def _serve(self, requests: queue.SimpleQueue) -> None:
        while (item := requests.get()) is not None:
            args, answer = item
            answer.put(_call(self.fn, args, self.kwargs))

    def close(self) -> None:
        if self._requests is not None:
            self._requests.put(None)
            self._requests = None


def _length(value: Any) -> str:
    try:
        return str(len(value))
    except TypeError:
        return "-"


class _TaskFeed:
    """The pool loop's tasks: all at once (closed), or added over time by a stream; `waker` wakes
    the loop when tasks arrive or the feed closes."""

    def __init__(self, tasks: Sequence[tuple] = (), closed: bool = False):
        self.tasks = list(tasks)
        self.closed = closed
        self.waker, self._wake = multiprocessing.Pipe(duplex=False)
        self.done_at: dict[int, float] = {}  # task id -> when its outcome came in
        self._lock = threading.Lock()

    def add(self, tasks: Sequence[tuple]) -> range:
        with self._lock:
            start = len(self.tasks)
            self.tasks.extend(tasks)
            self._wake.send_bytes(b"+")
        return range(start, start + len(tasks))

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._wake.send_bytes(b".")

    def drain(self) -> None:
        while self.waker.poll():
            self.waker.recv_bytes()

    def finished(self, task_id: int) -> None:
        self.done_at[task_id] = time.perf_counter()


@dataclass
class _Submission:
    key: int
    requests: list[RewardRequest]
    tasks: range  # their task ids in the feed
    submitted_at: float


class RewardStream:
    """Scores requests while more arrive (RewardRunner.stream): the worker pool runs in a thread
    from the first submit() until result(). With num_workers=0 the calls run in result(): an
    in-process call has nothing to overlap with."""

    def __init__(self, runner: RewardRunner):
        self.runner = runner
        self.feed = _TaskFeed()
        self.submissions: list[_Submission] = []
        self._outcomes: list[tuple[str, Any]] | BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        if runner.num_workers > 0:
            runner._pool_in_use.acquire()
            self._thread = threading.Thread(target=self._run, name="reward-stream", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._outcomes = self.runner._run_pool(self.feed)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._outcomes = exc
            self.feed.close()

    def submit(self, key: int, requests: Sequence[RewardRequest]) -> None:
        """Scores `requests`; result() orders everything by key (e.g. the request index)."""
        with self._lock:
            if self.feed.closed:
                raise RuntimeError("RewardStream.submit after result()")
            tasks = self.runner._make_tasks(requests)
            submitted_at = time.perf_counter()  # before the workers can see the tasks: latency >= 0
            ids = self.feed.add(tasks) if self._thread is not None else range(0)
            self.submissions.append(_Submission(key, list(requests), ids, submitted_at))

    def result(self) -> RewardBatchResult:
        """Every submitted request's score, in key order; metrics as RewardRunner.score's, plus
        reward/first_latency_s and reward/last_latency_s: from the first and the last submission
        to its last score."""
        with self._lock:
            self.feed.close()
        ordered = sorted(self.submissions, key=lambda sub: sub.key)
        requests = [r for sub in ordered for r in sub.requests]
        if self._thread is None:  # num_workers=0: score() calls them here
            return self.runner.score(requests)
        self._thread.join()
        self.runner._pool_in_use.release()
        if isinstance(self._outcomes, BaseException):
            raise self._outcomes
        tasks = [self.feed.tasks[i] for sub in ordered for i in sub.tasks]
        outcomes = [self._outcomes[i] for sub in ordered for i in sub.tasks]
        result = self.runner._collect(requests, tasks, outcomes)
        if self.submissions:
            first, last = self.submissions[0], self.submissions[-1]  # in submission order
            for name, sub in (("first", first), ("last", last)):
                done = max((self.feed.done_at[i] for i in sub.tasks), default=sub.submitted_at)
                result.metrics[f"reward/{name}_latency_s"] = done - sub.submitted_at
        return result
