"""SGLangClient: /generate over several servers with a bounded number of sequences in flight per
engine, pooled keep-alive connections, retries, failover and abort.

Generation runs on one asyncio event loop in a background thread (aiohttp, the HTTP client SGLang
itself uses), so thousands of requests in flight cost one thread and one keep-alive connection
each, not a thread each. `concurrency` is the number of *sequences* (samples: a request with n
takes n) in flight per engine; a URL that stands for several engines (a router) holds
`concurrency x engines_per_url`. Without a router each request goes to the engine with the fewest
sequences in flight (ties: round-robin), and waits while every engine is full.

A request that meets a connection error or HTTP 5xx is retried with backoff on the next server,
and the failing server is avoided for `dead_cooldown_s`; after `retry.max_attempts` tries the error
names every URL tried. The set of servers can change between and during calls (`set_urls`,
`set_engines_per_url`): the engine pool takes dead engines out of rotation and puts restarted ones
back. SGLang's refusal of a request's sampling mask (protocol.py) is raised at once, never retried.
Every Sample names the URL that answered it (`Sample.engine`; with a router in front, the router's).
Control and weight calls (`call`, `call_all`) target one server each and stay on http.client.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from megatron_grpo.rollout.engine import RequestDone
from megatron_grpo.rollout.sglang.errors import (SGLangConnectionError, SGLangError, SGLangTimeoutError,
                                                 SGLangUnavailableError)
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, http_error, request_json
from megatron_grpo.rollout.sglang.protocol import generate_payloads, parse_generate_response, sampling_mask_error
from megatron_grpo.rollout.sglang.rotation import ServerRotation
from megatron_grpo.rollout.types import GenerationRequest, Sample


# uvicorn under SGLang closes idle connections after SGLANG_TIMEOUT_KEEP_ALIVE (5 s): dropping ours
# first means a pooled connection is never reused at the moment the server closes it.
KEEPALIVE_S = 3.0


class SGLangClient:
    def __init__(self, urls: Sequence[str], *, concurrency: int = 64, engines_per_url: int = 1,
                 timeout_s: float = 600.0, retry: RetryPolicy = RetryPolicy(), api_key: str | None = None,
                 dead_cooldown_s: float = 30.0):
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        if concurrency < 1 or engines_per_url < 1:
            raise ValueError(f"concurrency and engines_per_url must be >= 1, got {concurrency}, {engines_per_url}")
        self.rotation = ServerRotation(urls, dead_cooldown_s)
        self.concurrency = concurrency
        self.engines_per_url = engines_per_url
        self.timeout_s = timeout_s
        self.retry = retry
        self.api_key = api_key
        self.in_flight: dict[str, int] = {}  # sequences per URL now (read from any thread, written on the loop)
        self.peak_in_flight: dict[str, int] = {}  # the most each URL held since reset_peaks()
        self._lock = threading.Lock()
        self._aborted = threading.Event()
        self._loop: _LoopThread | None = None  # started by the first generate (control-only clients need none)
        self._room: asyncio.Condition | None = None  # notified whenever a slot frees or the servers change

    @property
    def capacity(self) -> int:
        """Sequences in flight one URL may hold."""
        return self.concurrency * self.engines_per_url

    @property
    def urls(self) -> list[str]:
        return self.rotation.urls

    def set_urls(self, urls: Sequence[str]) -> None:
        """The servers later requests use (in-flight requests finish where they are); none of them
        stays in its failure cooldown (ServerRotation.set_urls)."""
        self.rotation.set_urls(urls)
        self._wake()

    def set_engines_per_url(self, count: int) -> None:
        """A router's live engines changed: its URL holds `concurrency x count` sequences."""
        self.engines_per_url = max(1, count)
        self._wake()

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak_in_flight = {}

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
    def generate(self, requests: Sequence[GenerationRequest],
                 on_request_done: RequestDone | None = None) -> list[Sample]:
        """All samples of `requests`, in request order then sample order. `on_request_done(i, samples)`
        is told each request's samples as soon as they are all in (in completion order), on the
        client's event loop: it must be quick and thread-safe."""
        self._aborted.clear()
        if self._loop is None:
            self._loop = _LoopThread(self._open_session)
            # closes the session and stops the thread when the client is dropped or at exit
            self._closer = weakref.finalize(self, self._loop.close)
        return self._loop.run(self._generate_all(list(requests), on_request_done))

    def stop_generating(self) -> None:
        """Makes the current generate() return: requests not sent yet come back as 'abort'
        samples. The engines' running requests are aborted by the caller (/abort_request must go
        to each engine, never through a router)."""
        self._aborted.set()
        self._wake()

    async def _generate_all(self, requests: list[GenerationRequest],
                            on_request_done: RequestDone | None) -> list[Sample]:
        async def one_request(index: int, request: GenerationRequest) -> list[Sample]:
            parts = await asyncio.gather(*(self._generate_call(request, first, payload)
                                           for first, payload in generate_payloads(request)))
            samples = [sample for part in parts for sample in part]
            if on_request_done is not None:
                on_request_done(index, samples)
            return samples

        tasks = [asyncio.ensure_future(one_request(i, r)) for i, r in enumerate(requests)]
        if not tasks:
            return []
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise failed[0].exception()
        return [sample for task in tasks for sample in task.result()]

    async def _generate_call(self, request: GenerationRequest, first: int, payload: dict) -> list[Sample]:
        count = payload["sampling_params"]["n"]
        tried: list[str] = []
        errors: list[str] = []
        for attempt in range(self.retry.max_attempts):
            url = await self._acquire(count, tried)
            if url is None:  # stop_generating() while it waited
                return _aborted_samples(request, first, count)
            tried.append(url)
            try:
                body = await self._post(url, "/generate", payload)
                return parse_generate_response(body, request, f"{url}/generate", first, count, engine=url)
            except SGLangError as exc:
                refused = sampling_mask_error(exc, request, url) if payload.get("return_sampling_mask") else None
                if refused is not None:
                    raise refused from None  # SGLang's limit, not the engine's fault: no retry, no cooldown
                if not self.retry.retryable(exc):
                    raise
                errors.append(str(exc))
                self.rotation.mark_dead(url)
            finally:
                self._release(url, count)
            if self._aborted.is_set():
                return _aborted_samples(request, first, count)
            if attempt + 1 < self.retry.max_attempts:
                await asyncio.sleep(self.retry.delay(attempt) if len(set(tried)) >= len(self.urls) else 0.0)
        raise SGLangUnavailableError(f"/generate for request {request.group_id!r} failed {len(errors)} times on "
                                     f"{sorted(set(tried))}: " + " | ".join(errors), tried[-1])

    async def _acquire(self, count: int, tried: list[str]) -> str | None:
        """Waits until a server has room for `count` sequences, takes it and returns its URL; None
        once generation is stopped. A request larger than a server's capacity waits for an idle one."""
        async with self._room:
            while not self._aborted.is_set():
                url = self._pick_url(count, tried)
                if url is not None:
                    with self._lock:
                        held = self.in_flight[url] = self.in_flight.get(url, 0) + count
                        self.peak_in_flight[url] = max(self.peak_in_flight.get(url, 0), held)
                    return url
                await self._room.wait()
        return None

    def _release(self, url: str, count: int) -> None:
        with self._lock:
            self.in_flight[url] -= count
        self._room_changed()

    def _pick_url(self, count: int, tried: list[str]) -> str | None:
        """Within the rotation's first tier for this try, the least loaded server with room (ties:
        the rotation's turn)."""
        tier = self.rotation.first_tier(tried)
        with self._lock:
            load = {u: self.in_flight.get(u, 0) for u in tier}
        room = [u for u in tier if load[u] == 0 or load[u] + count <= self.capacity]
        return min(room, key=load.__getitem__) if room else None

    def _room_changed(self) -> None:
        """On the loop: wake the requests waiting for room."""
        async def notify() -> None:
            async with self._room:
                self._room.notify_all()
        asyncio.ensure_future(notify())

    def _wake(self) -> None:
        """From any thread."""
        if self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._room_changed)

    async def _open_session(self):
        import aiohttp

        self._room = asyncio.Condition()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)
        return aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def _post(self, url: str, path: str, payload: Any) -> Any:
        """request_json's contract (errors, messages) over the pooled session."""
        import aiohttp

        where = f"{url}{path}"
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            async with self._loop.session.post(where, data=json.dumps(payload), headers=headers) as response:
                status, data = response.status, await response.read()
        except asyncio.TimeoutError as exc:  # aiohttp's ServerTimeoutError is one
            raise SGLangTimeoutError(f"POST {where}: no answer within {self.timeout_s:g}s ({exc})", url) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise SGLangConnectionError(f"POST {where}: cannot reach the SGLang server "
                                        f"({type(exc).__name__}: {exc})", url) from None
        text = data.decode("utf-8", errors="replace")
        if status >= 400:
            raise http_error("POST", where, status, text, url)
        return json.loads(text) if text else None

    def close(self) -> None:
        if self._loop is not None:
            self._closer()
            self._loop = None


class _LoopThread:
    """An asyncio event loop in a daemon thread and the HTTP session opened on it; run() waits for
    one coroutine from any thread."""

    def __init__(self, open_session: Callable[[], Any]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-client", daemon=True)
        self.thread.start()
        self.session = self.run(open_session())

    def run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        """Cancels what runs, closes the session, stops the loop (a caller still blocked in run()
        gets CancelledError)."""
        async def shutdown() -> None:
            current = asyncio.current_task()
            others = [t for t in asyncio.all_tasks() if t is not current]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await self.session.close()

        if not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def _aborted_samples(request: GenerationRequest, first: int, count: int) -> list[Sample]:
    return [Sample(group_id=request.group_id, sample_index=first + j, prompt_ids=list(request.prompt_ids),
                   response_ids=[], logprobs=[], finish_reason="abort", weight_version=-1) for j in range(count)]
