"""One JSON request to one server over the standard library's http.client, with typed errors."""
from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from megatron_grpo.rollout.sglang.errors import SGLangConnectionError, SGLangError, SGLangTimeoutError


@dataclass(frozen=True)
class RetryPolicy:
    """Retries on connection errors and HTTP 5xx with exponential backoff; timeouts are not
    retried unless `retry_timeouts` (a hung server would otherwise be waited on several times)."""

    max_attempts: int = 4
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    retry_timeouts: bool = False

    def delay(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * (2 ** attempt))

    def retryable(self, error: SGLangError) -> bool:
        if isinstance(error, SGLangTimeoutError):
            return self.retry_timeouts
        if isinstance(error, SGLangConnectionError):
            return True
        return error.status is not None and error.status >= 500


def request_json(url: str, path: str, payload: Any = None, *, method: str = "POST", timeout_s: float = 600.0,
                 api_key: str | None = None) -> Any:
    """Sends `payload` as JSON to url+path; returns the decoded JSON (or text) of a 2xx answer.

    Raises SGLangConnectionError (unreachable / connection dropped), SGLangTimeoutError, or
    SGLangError with the HTTP status for 4xx/5xx; each message names url+path."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "") or not parts.hostname:
        raise SGLangError(f"bad SGLang server URL {url!r}: expected http://host:port", url)
    where = f"{url.rstrip('/')}{path}"
    body = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        status = response.status
    except (socket.timeout, TimeoutError) as exc:
        raise SGLangTimeoutError(f"{method} {where}: no answer within {timeout_s:g}s ({exc})", url) from None
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        raise SGLangConnectionError(f"{method} {where}: cannot reach the SGLang server "
                                    f"({type(exc).__name__}: {exc})", url) from None
    finally:
        conn.close()
    text = data.decode("utf-8", errors="replace")
    if status >= 400:
        raise http_error(method, where, status, text, url)
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return text


def http_error(method: str, where: str, status: int, text: str, url: str) -> SGLangError:
    """A 4xx/5xx answer as the error every caller reads (status, and SGLang's message cut to 500 chars)."""
    return SGLangError(f"{method} {where}: HTTP {status}: {text[:500]}", url, status)
