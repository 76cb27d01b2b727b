"""SGLangClient: concurrent /generate over several servers, with retries, failover and abort.

Requests are spread round-robin over the servers by a thread pool of `concurrency` workers (one
blocking HTTP request each; the standard library only). A request that meets a connection error
or HTTP 5xx is retried with backoff on the next server, and the failing server is avoided for
`dead_cooldown_s`; after `retry.max_attempts` tries the error names every URL tried. The set of
servers can change between calls (`set_urls`): the engine pool takes dead engines out of rotation
and puts restarted ones back. SGLang's refusal of a request's sampling mask (protocol.py) is raised
at once, never retried. Every Sample names the URL that answered it (`Sample.engine`; with a router
in front, the router's)."""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from megatron_grpo.rollout.sglang.errors import SGLangError, SGLangUnavailableError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, request_json
from megatron_grpo.rollout.sglang.protocol import generate_payloads, parse_generate_response, sampling_mask_error
from megatron_grpo.rollout.types import GenerationRequest, Sample


class SGLangClient:
    def __init__(self, urls: Sequence[str], *, concurrency: int = 64, timeout_s: float = 600.0,
                 retry: RetryPolicy = RetryPolicy(), api_key: str | None = None, dead_cooldown_s: float = 30.0):
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.retry = retry
        self.api_key = api_key
        self.dead_cooldown_s = dead_cooldown_s
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sglang-client")
        self._round_robin = itertools.count()
        self._dead_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._aborted = threading.Event()

    def set_urls(self, urls: Sequence[str]) -> None:
        """The servers later calls use (in-flight requests finish where they are). They were just
        found alive (or restarted), so none of them stays in its failure cooldown."""
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        with self._lock:
            self.urls = [u.rstrip("/") for u in urls]
            for url in self.urls:
                self._dead_until.pop(url, None)

    # ----- plain calls ------------------------------------------------------------------------
    def call(self, url: str, path: str, payload: Any = None, *, method: str = "POST",
             timeout_s: float | None = None, retry: RetryPolicy | None = None) -> Any:
        """One endpoint of one server (no failover: control and weight calls target a server)."""
        policy = retry or self.retry
        for attempt in range(policy.max_attempts):
            try:
                return request_json(url, path, payload, method=method, api_key=self.api_key,
                                    timeout_s=timeout_s or self.timeout_s)
            except SGLangError as exc:
                if not policy.retryable(exc) or attempt + 1 == policy.max_attempts:
                    raise
                time.sleep(policy.delay(attempt))
        raise AssertionError("unreachable")

    def call_all(self, path: str, payload: Any = None, *, method: str = "POST", urls: Sequence[str] | None = None,
                 timeout_s: float | None = None, retry: RetryPolicy | None = None) -> list[Any]:
        """The same call on every server in parallel; raises the first failure after all finished."""
        targets = list(urls or self.urls)
        with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
            futures = [pool.submit(self.call, url, path, payload, method=method, timeout_s=timeout_s, retry=retry)
                       for url in targets]
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]

    # ----- generation -------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Sample]:
        """All samples of `requests`, in request order then sample order."""
        self._aborted.clear()
        calls = [(request, first, payload) for request in requests for first, payload in generate_payloads(request)]
        futures = [self._pool.submit(self._generate_call, request, first, payload)
                   for request, first, payload in calls]
        results: list[Sample] = []
        try:
            for future in futures:
                results.extend(future.result())
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return results

    def stop_generating(self) -> None:
        """Makes the current generate() return: requests not sent yet come back as 'abort'
        samples. The engines' running requests are aborted by the caller (/abort_request must go
        to each engine, never through a router)."""
        self._aborted.set()

    def _pick_url(self, tried: list[str]) -> str:
        now = time.monotonic()
        with self._lock:
            first = next(self._round_robin)
            order = [self.urls[(first + i) % len(self.urls)] for i in range(len(self.urls))]
            alive = [u for u in order if self._dead_until.get(u, 0.0) <= now]
        # Prefer live servers not yet tried for this request, then any live one, then one not yet
        # tried, then any at all.
        untried = [u for u in order if u not in tried]
        for candidates in ([u for u in alive if u not in tried], alive, untried, order):
            if candidates:
                return candidates[0]
        raise AssertionError("unreachable")

    def _mark_dead(self, url: str) -> None:
        with self._lock:
            self._dead_until[url] = time.monotonic() + self.dead_cooldown_s

    def _generate_call(self, request: GenerationRequest, first: int, payload: dict) -> list[Sample]:
        count = payload["sampling_params"]["n"]
        if self._aborted.is_set():
            return _aborted_samples(request, first, count)
        tried: list[str] = []
        errors: list[str] = []
        for attempt in range(self.retry.max_attempts):
            url = self._pick_url(tried)
            tried.append(url)
            try:
                body = request_json(url, "/generate", payload, timeout_s=self.timeout_s, api_key=self.api_key)
                return parse_generate_response(body, request, f"{url}/generate", first, count, engine=url)
            except SGLangError as exc:
                refused = sampling_mask_error(exc, request, url) if payload.get("return_sampling_mask") else None
                if refused is not None:
                    raise refused from None  # SGLang's limit, not the engine's fault: no retry, no cooldown
                if not self.retry.retryable(exc):
                    raise
                errors.append(str(exc))
                self._mark_dead(url)
                if self._aborted.is_set():
                    return _aborted_samples(request, first, count)
                if attempt + 1 < self.retry.max_attempts:
                    time.sleep(self.retry.delay(attempt) if len(set(tried)) >= len(self.urls) else 0.0)
        raise SGLangUnavailableError(f"/generate for request {request.group_id!r} failed {len(errors)} times on "
                                     f"{sorted(set(tried))}: " + " | ".join(errors), tried[-1])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _aborted_samples(request: GenerationRequest, first: int, count: int) -> list[Sample]:
    return [Sample(group_id=request.group_id, sample_index=first + j, prompt_ids=list(request.prompt_ids),
                   response_ids=[], logprobs=[], finish_reason="abort", weight_version=-1) for j in range(count)]
