"""KV caches the local engine keeps between generate calls, for sequences a later request continues.

A multi-turn episode's next turn is a request whose prompt is the previous turn's prompt + response
+ the observation. Its prefix was already computed; re-reading it every turn makes a turn cost as
much as its whole trajectory. The engine keeps the KV of each finished row that asks for it
(GenerationRequest.keep_kv) under its ids, and a request whose prompt starts with kept ids prefills
only the rest: SGLang's radix cache, reduced to what an episode needs.

Kept entries are dropped when used, when the weights change (their KV was computed with the old
ones), and oldest first beyond a byte budget."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class KeptPrefix:
    """The KV of `ids`: per layer (keys, values), each [kv_heads, len(ids), head_dim]."""

    ids: tuple[int, ...]
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        # counted once: the budget reads it on every keep and drop
        object.__setattr__(self, "nbytes", sum(t.numel() * t.element_size() for kv in self.layers for t in kv))


class KeptPrefixes:
    """Kept prefixes by their ids, at most `max_bytes` of tensors (the oldest go first)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._by_ids: dict[tuple[int, ...], KeptPrefix] = {}  # insertion order = age
        self._lengths: dict[int, int] = {}  # kept length -> how many entries have it
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._by_ids)

    def keep(self, prefix: KeptPrefix) -> None:
        if prefix.nbytes > self.max_bytes:
            return
        self._drop(prefix.ids)
        self._by_ids[prefix.ids] = prefix
        self._lengths[len(prefix.ids)] = self._lengths.get(len(prefix.ids), 0) + 1
        self._bytes += prefix.nbytes
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._by_ids)))

    def longest_prefix_of(self, prompt_ids: Sequence[int]) -> KeptPrefix | None:
        """The longest kept entry whose ids are a strict prefix of `prompt_ids` (at least one id
        must be left to prefill: its logits sample the first new token)."""
        prompt = tuple(prompt_ids)
        for length in sorted((n for n in self._lengths if n < len(prompt)), reverse=True):
            found = self._by_ids.get(prompt[:length])
            if found is not None:
                return found
        return None

    def discard(self, ids: tuple[int, ...]) -> None:
        self._drop(ids)

    def clear(self) -> None:
        self._by_ids.clear()
        self._lengths.clear()
        self._bytes = 0

    def _drop(self, ids: tuple[int, ...]) -> None:
        prefix = self._by_ids.pop(ids, None)
        if prefix is None:
            return
        self._bytes -= prefix.nbytes
        self._lengths[len(ids)] -= 1
        if not self._lengths[len(ids)]:
            del self._lengths[len(ids)]
