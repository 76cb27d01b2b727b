"""How a reward function is called: this project's convention or verl's, decided from its parameter names.

    native          fn(prompt, response, ground_truth, extra, **reward.kwargs)
    native batched  fn(prompts, responses, ground_truths, extras, **reward.kwargs) -> list
    verl            compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward.kwargs)
    verl batched    compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=, **kwargs) -> list

verl calls its functions with keywords (NaiveRewardManager / BatchRewardManager), so a verl file
works here unchanged: `data_source` is the record's data_source (the trainer puts it into `extra`),
`extra_info` the record's extra_info. A function that declares only some of verl's names (verl's
own scorers: `gsm8k.compute_score(solution_str, ground_truth, method="strict", ...)`) gets only
those, so its own defaults stay; one with **kwargs gets all four. `async def` verl functions are
awaited. reward.signature=verl or native overrides the detection; a forced verl function that
declares neither solution_str nor data_source is called positionally in verl's order.
"""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Literal

from megatron_grpo.errors import ConfigError

Signature = Literal["auto", "verl", "native"]
SIGNATURES = ("auto", "verl", "native")
VERL_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_BATCHED_NAMES = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
NATIVE_NAMES = ("prompt", "response", "ground_truth", "extra")
NATIVE_BATCHED_NAMES = ("prompts", "responses", "ground_truths", "extras")


@dataclass(frozen=True)
class Convention:
    style: Literal["native", "verl"]
    batched: bool
    # verl only: the verl parameter names passed by keyword (those the function declares, or all
    # with **kwargs); empty: positionally, in verl's order
    keywords: tuple[str, ...] = ()


def takes_var_keywords(fn: Callable) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def parameter_names(fn: Callable) -> list[str] | None:
    """The names of fn's named parameters, or None when its signature cannot be read (C builtins)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def convention_of(fn: Callable, signature: str = "auto") -> Convention:
    """Which convention `fn` follows: by its parameter names, unless `signature` forces one."""
    if signature not in SIGNATURES:
        raise ConfigError(f"reward.signature={signature!r} must be one of {', '.join(SIGNATURES)}")
    names = set(parameter_names(fn) or ())
    verl_batched = bool(names & {"solution_strs", "data_sources"})
    verl_single = bool(names & {"solution_str", "data_source"}) and "prompt" not in names
    native_batched = bool(names & {"responses", "prompts"})
    if signature == "native" or (signature == "auto" and not (verl_batched or verl_single)):
        return Convention("native", batched=native_batched)
    verl_names = VERL_BATCHED_NAMES if verl_batched else VERL_NAMES
    if takes_var_keywords(fn):
        return Convention("verl", batched=verl_batched, keywords=verl_names)
    # By keyword only when the function names verl's arguments (solution_str / data_source); a
    # forced verl function with its own names (ground_truth alone is both conventions') is called
    # positionally, in verl's order.
    distinctive = {"solution_strs", "data_sources"} if verl_batched else {"solution_str", "data_source"}
    declared = tuple(n for n in verl_names if n in names) if names & distinctive else ()
    return Convention("verl", batched=verl_batched, keywords=declared)


class VerlCall:
    """A verl compute_score behind this project's call: (prompt, response, ground_truth, extra)."""

    batched = False

    names = VERL_NAMES

    def __init__(self, fn: Callable, keywords: tuple[str, ...]):
        self.fn, self.keywords = fn, keywords

    def __call__(self, prompt: str, response: str, ground_truth: Any, extra: dict | None, **kwargs: Any) -> Any:
        extra = extra if extra is not None else {}
        return self._call((extra.get("data_source"), response, ground_truth, extra), kwargs)

    def _call(self, values: tuple, kwargs: dict) -> Any:
        if self.keywords:
            by_name = dict(zip(self.names, values))
            result = self.fn(**{name: by_name[name] for name in self.keywords}, **kwargs)
        else:
            result = self.fn(*values, **kwargs)
        return asyncio.run(result) if inspect.isawaitable(result) else result


class VerlBatchedCall(VerlCall):
    """verl's batched compute_score behind this project's batched call (lists in, list out)."""

    batched = True
    names = VERL_BATCHED_NAMES

    def __call__(self, prompts: list, responses: list, ground_truths: list, extras: list, **kwargs: Any) -> Any:
        extras = [e if e is not None else {} for e in extras]
        return self._call(([e.get("data_source") for e in extras], list(responses), list(ground_truths), extras),
                          kwargs)


def adapt(fn: Callable, convention: Convention) -> Callable:
    """A callable with this project's convention: `fn` itself when native, else a verl adapter."""
    if convention.style == "native":
        return fn
    return (VerlBatchedCall if convention.batched else VerlCall)(fn, convention.keywords)


def check_callable(fn: Callable, convention: Convention, kwargs: dict, name: str) -> None:
    """ConfigError now, instead of a TypeError on every call, when `fn` cannot take the arguments
    its convention passes (wrong arity, missing extra_info, a reward.kwargs name it lacks)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # unreadable signature (a C builtin): the calls will tell
    if convention.style == "verl" and convention.keywords:
        arguments: tuple = ()
        keywords = {**dict.fromkeys(convention.keywords), **kwargs}
    else:
        arguments, keywords = (None,) * 4, dict(kwargs)
    try:
        signature.bind(*arguments, **keywords)
    except TypeError as exc:
        passed = ", ".join([*((VERL_BATCHED_NAMES if convention.batched else VERL_NAMES)
                              if convention.style == "verl" else
                              (NATIVE_BATCHED_NAMES if convention.batched else NATIVE_NAMES)), *kwargs])
        raise ConfigError(f"reward function {name} takes {signature}, but is called as {convention.style}"
                          f"{' batched' if convention.batched else ''} ({passed}): {exc}; set reward.signature "
                          f"(auto|verl|native) or fix the function") from None
