"""A deterministic shuffled batch sampler with epochs and a resumable position.

Epoch e uses the permutation drawn from (seed, e), so the order depends only on the seed, the
number of items and the position; a state_dict saved after k batches and loaded into a new sampler
continues with batch k+1 exactly as an uninterrupted run would.
"""
from __future__ import annotations

import random
from typing import Generic, Iterator, Sequence, TypeVar

from megatron_grpo.errors import CheckpointError, ConfigError

T = TypeVar("T")


def batches_per_epoch(num_items: int, batch_size: int, drop_last: bool = True) -> int:
    return num_items // batch_size if drop_last else -(-num_items // batch_size)


class PromptSampler(Generic[T]):
    """Yields lists of `batch_size` items. drop_last=True skips each epoch's incomplete last batch,
    so every batch has the same size; max_epochs=None never stops."""

    def __init__(self, items: Sequence[T], batch_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True, max_epochs: int | None = None):
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}")
        if drop_last and len(items) < batch_size:
            raise ConfigError(f"the dataset has {len(items)} prompts, fewer than one batch of {batch_size}")
        if not items:
            raise ConfigError("the dataset is empty")
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.max_epochs = max_epochs
        self.epoch = 0
        self.batch_in_epoch = 0  # batches already yielded in the current epoch
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return batches_per_epoch(len(self.items), self.batch_size, self.drop_last)

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            # a string seed is hashed by random with SHA-512: stable across processes and versions
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[T]]:
        return self

    def __next__(self) -> list[T]:
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
            self._order = None
        if self.max_epochs is not None and self.epoch >= self.max_epochs:
            raise StopIteration
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        start = self.batch_in_epoch * self.batch_size
        indices = self._order[start:start + self.batch_size]
        self.batch_in_epoch += 1
        return [self.items[i] for i in indices]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "num_items": len(self.items), "batch_size": self.batch_size, "shuffle": self.shuffle,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Resumes at a saved position; the dataset and sampling settings must be the same."""
        mine = self.state_dict()
        for key in ("seed", "num_items", "batch_size", "shuffle", "drop_last"):
            if state.get(key) != mine[key]:
                raise CheckpointError(f"sampler state does not match: {key} was {state.get(key)!r} when "
                                      f"saved, is {mine[key]!r} now (changed dataset or data settings?)")
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self._order = None
