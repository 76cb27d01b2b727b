"""Resolve an environment class from rollout.multi_turn.environment: a built-in name,
"pkg.module:Class" or "path/to/file.py:Class" (the same spec forms as reward functions)."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from megatron_grpo.environments.base import Environment
from megatron_grpo.errors import ConfigError
from megatron_grpo.rewards.loader import import_user_file

BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "lookup": "megatron_grpo.environments.lookup:LookupEnvironment",
    "python_gsm8k": "megatron_grpo.environments.python_tool:PythonToolEnvironment",
}
KEY = "rollout.multi_turn.environment"


def load_environment_class(spec: str) -> type[Environment]:
    """The Environment subclass named by `spec`; one ConfigError naming the spec otherwise."""
    canonical = BUILTIN_ENVIRONMENTS.get(spec.strip(), spec.strip())
    target, sep, name = canonical.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"{KEY}={spec!r}: expected a built-in name ({', '.join(sorted(BUILTIN_ENVIRONMENTS))}), "
                          "'pkg.module:Class' or 'path/to/file.py:Class'")
    module = _load_file(spec, Path(target)) if target.endswith(".py") else _import(spec, target)
    cls = getattr(module, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ConfigError(f"{KEY}={spec!r}: {target} has no Environment subclass named {name!r} "
                          "(subclass megatron_grpo.environments.Environment)")
    return cls


def check_environment(spec: str, kwargs: dict) -> type[Environment]:
    """The class `spec` names, whose constructor takes `kwargs`; one ConfigError otherwise. The
    trainer calls it before any model is built (a typo must not cost a model load)."""
    cls = load_environment_class(spec)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"rollout.multi_turn.environment_kwargs {sorted(kwargs)} do not fit {cls.__name__}: "
                          f"{exc}") from exc
    return cls


def build_environment(spec: str, kwargs: dict) -> Environment:
    """One environment instance (one per trajectory)."""
    return check_environment(spec, kwargs)(**kwargs)


def _import(spec: str, target: str):
    try:
        return importlib.import_module(target)
    except Exception as exc:  # ImportError, or the module's own error (a SyntaxError, ...) at import
        raise ConfigError(f"{KEY}={spec!r}: cannot import module {target!r}: {type(exc).__name__}: {exc}") from exc


def _load_file(spec: str, path: Path):
    return import_user_file(path.resolve(), "megatron_grpo_user_env_", f"{KEY}={spec!r}: file")
