"""A small name -> function registry; unknown names raise ConfigError listing the valid ones."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

from megatron_grpo.errors import ConfigError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions of one kind (advantage estimators, policy losses) registered by name."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: `@registry.register("my_name")`. Re-registering another function under a name raises."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            existing = self._entries.get(name)
            if existing is not None and existing is not fn:
                raise ConfigError(f"{self.kind} {name!r} is already registered "
                                  f"({existing.__module__}.{existing.__qualname__})")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
