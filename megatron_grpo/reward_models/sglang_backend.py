"""SGLangBackend: a scorer's model on SGLang servers (backend=sglang), given by URL or launched.

Reward models go to `/classify` ({"input_ids": [...]} -> one {"embedding": [score, ...]} per
sequence: the classification head's raw outputs). Not `/v1/classify`: it answers softmax
probabilities over the labels, which for a one-output reward model is 1.0 for every input.
Judges go to `/generate` (greedy; yes_no asks `token_ids_logprob` for the two tokens).

A batch is one request. It goes to the servers in turn (rollout/sglang/rotation.py, as the rollout
client's); a connection error or HTTP 5xx marks the server dead for a cooldown and the request
moves to the next, up to max_retries tries; then the error names every URL tried. HTTP 4xx (e.g.
an input longer than the model's context) fails the batch at once. Each try has the scorer's
timeout; a timeout is not retried (a hung server would be waited on again). At start every server
must answer /model_info and serve the right kind of model (a reward model is not a generation model
in SGLang's sense; a judge is), else one error naming it. Requests are blocking http.client calls
on the scorer's batch threads (rewards/combined.py): a batch is one request, so there are few in flight."""
from __future__ import annotations

import time
from typing import Any, Sequence

from megatron_grpo.errors import MegatronGRPOError
from megatron_grpo.reward_models.backend import BackendTimeout, JudgeReply
from megatron_grpo.rollout.sglang.errors import SGLangError, SGLangTimeoutError, SGLangUnavailableError
from megatron_grpo.rollout.sglang.http_json import RetryPolicy, request_json
from megatron_grpo.rollout.sglang.rotation import ServerRotation

DEAD_COOLDOWN_S = 30.0


class ScorerServerError(MegatronGRPOError):
    """A scorer's server is unreachable or serves the wrong kind of model (at start)."""


class SGLangBackend:
    def __init__(self, urls: Sequence[str], *, key: str, timeout_s: float, max_retries: int,
                 max_concurrency: int, api_key: str | None = None, launcher=None):
        self.rotation = ServerRotation(urls, DEAD_COOLDOWN_S)
        self.key = key
        self.timeout_s = timeout_s
        self.retry = RetryPolicy(max_attempts=max_retries)
        self.api_key = api_key
        self.concurrency = max_concurrency * len(self.urls)
        self.where = "SGLang " + ", ".join(self.urls)
        self.launcher = launcher  # servers started for this scorer (stopped by close)

    @property
    def urls(self) -> list[str]:
        return self.rotation.urls

    def check(self, want_generation: bool) -> dict[str, Any]:
        """Every server answers /model_info and serves a model of the right kind; its answers by URL."""
        infos = {}
        for url in self.urls:
            try:
                info = request_json(url, "/model_info", method="GET", timeout_s=30.0, api_key=self.api_key)
            except SGLangError as exc:
                raise ScorerServerError(f"{self.key}: its SGLang server does not answer: {exc}") from None
            if not isinstance(info, dict) or info.get("is_generation") != want_generation:
                what = "a generation model" if info.get("is_generation") else "an embedding / reward model"
                need = ("a chat model (a judge generates its answer)" if want_generation else
                        "a *ForSequenceClassification reward model served by SGLang's classification path")
                raise ScorerServerError(f"{self.key}: {url} serves {info.get('model_path')!r} as {what}; this "
                                        f"scorer needs {need}")
            infos[url] = info
        return infos

    def classify(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        body, url = self._post("/classify", {"input_ids": [list(s) for s in sequences]})
        if not isinstance(body, list) or len(body) != len(sequences):
            raise SGLangError(f"POST {url}/classify: expected a list of {len(sequences)} results, got "
                              f"{type(body).__name__} {str(body)[:200]}", url)
        scores = []
        for item in body:
            embedding = item.get("embedding") if isinstance(item, dict) else None
            if not isinstance(embedding, list) or not embedding:
                raise SGLangError(f"POST {url}/classify: a result without an embedding: {str(item)[:200]}", url)
            scores.append(float(embedding[0]))
        return scores

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 logprob_token_ids: Sequence[int] | None = None) -> list[JudgeReply]:
        payload: dict[str, Any] = {"input_ids": [list(p) for p in prompts],
                                   "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
        if logprob_token_ids is not None:
            payload.update(return_logprob=True, logprob_start_len=-1, token_ids_logprob=list(logprob_token_ids))
        body, url = self._post("/generate", payload)
        if not isinstance(body, list) or len(body) != len(prompts):
            raise SGLangError(f"POST {url}/generate: expected a list of {len(prompts)} results, got "
                              f"{type(body).__name__} {str(body)[:200]}", url)
        return [JudgeReply(item["text"], _first_token_logprobs(item) if logprob_token_ids is not None else None)
                for item in body]

    def _post(self, path: str, payload: dict) -> tuple[Any, str]:
        tried: list[str] = []
        errors: list[str] = []
        for attempt in range(self.retry.max_attempts):
            url = self.rotation.first_tier(tried)[0]
            tried.append(url)
            try:
                return request_json(url, path, payload, timeout_s=self.timeout_s, api_key=self.api_key), url
            except SGLangTimeoutError as exc:
                raise BackendTimeout(str(exc)) from None
            except SGLangError as exc:
                if not self.retry.retryable(exc):
                    raise
                errors.append(str(exc))
                self.rotation.mark_dead(url)
            if attempt + 1 < self.retry.max_attempts and len(set(tried)) >= len(self.urls):
                time.sleep(self.retry.delay(attempt))
        raise SGLangUnavailableError(f"{self.key}: {path} failed {len(errors)} times on {sorted(set(tried))}: "
                                     + " | ".join(errors), tried[-1])

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.shutdown()
            self.launcher = None


def _first_token_logprobs(item: dict) -> dict[int, float]:
    """meta_info.output_token_ids_logprobs[0]: [(logprob, token id, text or None), ...] of the first answer token."""
    positions = (item.get("meta_info") or {}).get("output_token_ids_logprobs") or []
    if not positions or positions[0] is None:
        return {}
    return {int(entry[1]): float(entry[0]) for entry in positions[0]}
