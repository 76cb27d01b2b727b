"""Resolve a reward function from a spec string: a built-in name, "pkg.module:fn" or "path/to/file.py:fn".

Workers of the reward pool resolve the same spec again, so it must be importable by name or path in
a fresh (spawned) interpreter: lambdas and closures are not specs. A RewardSpec adds how the
function is called (signature.py): a verl `compute_score` comes back behind this project's
convention, so the runner and its workers call every function the same way.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megatron_grpo.errors import ConfigError
from megatron_grpo.rewards.signature import Convention, adapt, check_callable, convention_of

# Built-in reward functions: name -> "module:function". Each takes (prompt, response, ground_truth, extra).
BUILTIN_REWARDS: dict[str, str] = {
    "by_data_source": "megatron_grpo.rewards.by_source:reward",
    "gsm8k": "megatron_grpo.rewards.gsm8k:reward",
    "math": "megatron_grpo.rewards.math_equiv:reward",
    "synthetic": "megatron_grpo.rewards.synthetic:reward",
}


def canonical_spec(spec: str) -> str:
    """A built-in name becomes its "module:fn"; a file path becomes absolute (workers may chdir)."""
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    target, sep, fn_name = spec.rpartition(":")
    if not sep or not target or not fn_name:
        raise ConfigError(
            f"reward function {spec!r}: expected a built-in name ({', '.join(sorted(BUILTIN_REWARDS))}), "
            "'pkg.module:fn' or 'path/to/file.py:fn'")
    if target.endswith(".py"):
        return f"{Path(target).resolve()}:{fn_name}"
    return spec


def _load_file(path: Path):
    return import_user_file(path, "megatron_grpo_user_reward_", "reward function file")


def import_user_file(path: Path, module_prefix: str, what: str):
    """A user's .py file as a module, imported once (a stable, path-derived module name: loading the
    same file twice gives the same module). Also loads environments (environments/loader.py).
    `what` starts the one-line errors, e.g. "reward function file"."""
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    name = module_prefix + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: lets dataclasses/pickle inside the file find it
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(f"{what} {path} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


@dataclass(frozen=True)
class RewardSpec:
    """What a reward worker loads: the function (a spec string) and its call convention."""

    target: str
    signature: str = "auto"  # auto | verl | native (reward.signature)


@dataclass(frozen=True)
class PreparedReward:
    fn: Callable            # called as fn(prompt, response, ground_truth, extra) (or the batched form)
    convention: Convention  # what the function itself declares


def load_reward_function(spec: str | RewardSpec) -> Callable:
    """The callable named by `spec`; ConfigError with the spec when it cannot be found. A string
    gives the function itself; a RewardSpec gives it behind this project's call convention."""
    if isinstance(spec, RewardSpec):
        fn = _load(spec.target)
        return adapt(fn, convention_of(fn, spec.signature))
    return _load(spec)


def prepare_reward_function(spec: RewardSpec, kwargs: dict) -> PreparedReward:
    """Loads, checks that the function takes the arguments its convention passes (ConfigError
    otherwise, naming the function), and adapts it; what the runner does before any call."""
    fn = _load(spec.target)
    convention = convention_of(fn, spec.signature)
    check_callable(fn, convention, kwargs, spec.target)
    return PreparedReward(adapt(fn, convention), convention)


def _load(spec: str) -> Callable:
    canonical = canonical_spec(spec)
    target, _, fn_name = canonical.rpartition(":")
    if target.endswith(".py"):
        module = _load_file(Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"reward function {spec!r}: cannot import module {target!r}: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r}: {target} has no callable named {fn_name!r}")
    return fn
