"""ScorerBackend: what a model scorer needs from whatever runs the model. Two implement it:
hf_backend.HFBackend (in this process, transformers) and sglang_backend.SGLangBackend (SGLang
servers over HTTP). Both take token ids rendered by render.py, so both score the same tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class JudgeReply:
    text: str  # the judge's answer, special tokens dropped
    # log-probs of the asked token ids at the answer's first position (yes_no), else None
    first_token_logprobs: dict[int, float] | None = None


class BackendTimeout(TimeoutError):
    """A backend call ran out of time; its samples count as reward/errors/timeout."""


class ScorerBackend(Protocol):
    where: str  # for messages: "in-process (cpu)" or the server URLs
    concurrency: int  # batch calls it serves at once

    def classify(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """A reward model's score (its first output) of each token sequence, pooled at its last
        token as SGLang's classification models pool. Raises on failure (the whole batch fails)."""

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 logprob_token_ids: Sequence[int] | None = None) -> list[JudgeReply]:
        """Greedy answers to each prompt; with logprob_token_ids, the log-probs (of the unscaled
        logits) of those tokens at the first answer position."""

    def close(self) -> None: ...
