"""One weight update of a set of SGLang engines, in the order SGLang 0.5.23 requires:

    pause_generation(abort) -> begin_weight_update -> the push -> end_weight_update ->
    flush_cache (retried while requests drain) -> continue_generation

(/update_weights_from_distributed and /update_weights_from_tensor are refused outside a
begin/end session; /update_weights_from_disk needs none.) After a failed push the session is
ended and generation continued where the engines still answer, so the next update can begin one;
the push's own error is the one raised.

    with UpdateSession(client, urls):            # rank 0's route: the push inside the block
        transport.push(tensors, version)

The routes whose senders push from other ranks (per stage, colocated) open it in one call and close
or abort it in a later one (SGLangEngine.begin/end/abort_stage_update): open(), close(), abort().
"""
from __future__ import annotations

import time
from typing import Sequence

from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy

_BEST_EFFORT = RetryPolicy(max_attempts=1)


class UpdateSession:
    def __init__(self, client: SGLangClient, urls: Sequence[str], *, needs_session: bool = True):
        self.client, self.urls, self.needs_session = client, list(urls), needs_session

    def open(self) -> None:
        self.client.call_all("/pause_generation", {"mode": "abort"}, urls=self.urls)
        if self.needs_session:
            try:
                self.client.call_all("/begin_weight_update", {}, urls=self.urls)
            except BaseException:
                self.abort()
                raise

    def close(self) -> None:
        """After a successful push: end the session (checked), flush, continue."""
        try:
            if self.needs_session:
                for url, answer in zip(self.urls, self.client.call_all("/end_weight_update", {}, urls=self.urls)):
                    if isinstance(answer, dict) and answer.get("success") is False:
                        raise SGLangError(f"{url}/end_weight_update failed: {answer.get('message')}", url)
            for url in self.urls:
                flush_cache(self.client, url)
        except BaseException:
            self._continue_best_effort()
            raise
        self.client.call_all("/continue_generation", {}, urls=self.urls)

    def abort(self) -> None:
        """After a failed push: end the session and continue where the engines still answer (one
        that died is the engine pool's business)."""
        if self.needs_session:
            for url in self.urls:
                try:
                    self.client.call(url, "/end_weight_update", {}, retry=_BEST_EFFORT, timeout_s=30.0)
                except SGLangError:
                    pass
        self._continue_best_effort()

    def _continue_best_effort(self) -> None:
        for url in self.urls:
            try:
                self.client.call(url, "/continue_generation", {}, retry=_BEST_EFFORT, timeout_s=30.0)
            except SGLangError:
                pass

    def __enter__(self) -> "UpdateSession":
        self.open()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def flush_cache(client: SGLangClient, url: str, timeout_s: float = 60.0) -> None:
    """POST /flush_cache until it succeeds: SGLang answers 400 while requests are still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.call(url, "/flush_cache", {})
            return
        except SGLangError as exc:
            if exc.status != 400 or time.monotonic() > deadline:
                raise SGLangError(f"{url}/flush_cache did not succeed within {timeout_s:g}s: {exc}", url) from None
            time.sleep(0.2)
