"""Turning raw YAML / override values into the schema's typed dataclasses, with one-line errors.

Supported field types: bool, int, float, str, Literal[...], Optional[X], list[X], dict[str, X],
Any and nested dataclasses. Ints are accepted where a float is expected; strings are accepted for
floats when float() parses them, because YAML 1.1 (pyyaml) reads `1e-6` (no dot) as a string.
Nothing else is converted: `ppo_epochs: "2"` is an error, not a silent 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
from typing import Any, Literal, Mapping, Union, get_args, get_origin, get_type_hints

from megatron_grpo.errors import ConfigError

Sources = Mapping[str, str]  # dotted key -> where it was set, e.g. "recipes/x.yaml:12"


def locate(sources: Sources, key: str) -> str:
    """' (where)' for `key` or its nearest parent that has a recorded source, else ''."""
    key = key.split("[", 1)[0]
    while key:
        if key in sources:
            return f" ({sources[key]})"
        key = key.rpartition(".")[0]
    return ""


# dataclasses.field metadata: a list field that also takes one string as a one-item list (verl's
# data.train_files: `train_files: a.parquet` or a list).
ONE_OR_MORE = "one_or_more"


def one_or_more_fields(cls: type) -> set[str]:
    """The names of cls's list fields that also take one string."""
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get(ONE_OR_MORE)}


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass's fields, in declaration order."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def is_optional(tp: Any) -> bool:
    return _is_union(tp) and type(None) in get_args(tp)


def strip_optional(tp: Any) -> Any:
    """X for Optional[X]; anything else unchanged."""
    if is_optional(tp):
        rest = [a for a in get_args(tp) if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported union {tp}")  # a schema bug, not a user error
        return rest[0]
    return tp


def describe(tp: Any) -> str:
    """Human-readable type, as used in error messages."""
    if tp is Any:
        return "any value"
    if is_optional(tp):
        return f"{describe(strip_optional(tp))} or null"
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {describe(get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return getattr(tp, "__name__", str(tp))


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included."""
    keys = []
    for name, tp in field_types(cls).items():
        full = prefix + name
        keys.append(full)
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, full + "."))
    return keys


def suggest(key: str, section: type, root: type) -> str | None:
    """The closest valid key to an unknown `key`: a sibling first, then a same-named key elsewhere."""
    prefix, _, name = key.rpartition(".")
    siblings = list(field_types(section))
    match = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    if match:
        return f"{prefix}.{match[0]}" if prefix else match[0]
    everything = all_keys(root)
    by_name = [k for k in everything if difflib.SequenceMatcher(None, name, k.rpartition(".")[2]).ratio() >= 0.8]
    if by_name:
        return max(by_name, key=lambda k: difflib.SequenceMatcher(None, key, k).ratio())
    ancestors = {key.rsplit(".", i)[0] for i in range(1, key.count(".") + 1)}
    match = difflib.get_close_matches(key, [k for k in everything if k not in ancestors], n=1, cutoff=0.6)
    return match[0] if match else None


# Keys this project had and replaced: the error says what took their place.
RETIRED_KEYS = {
    "model.transformer_impl": "replaced by model.attention_backend: auto | te | torch_varlen | local "
                              "(transformer_engine -> te, local -> local)",
}


def unknown_key_error(key: str, section: type, root: type, where: str, full_key: str | None = None) -> ConfigError:
    """`key` is the first unknown part of `full_key` (an override's whole key, when there is one)."""
    from megatron_grpo.config import verl_keys

    if key in RETIRED_KEYS:
        return ConfigError(f"unknown key '{key}'{where}: {RETIRED_KEYS[key]}")
    # a verl key gets its meaning here, not a spelling guess
    for candidate in dict.fromkeys(k for k in (full_key, key) if k):
        verl = verl_keys.hint(candidate)
        if verl:
            return ConfigError(f"unknown key '{candidate}'{where}: {verl}")
    hint = suggest(key, section, root)
    tail = f"; did you mean '{hint}'?" if hint else ""
    return ConfigError(f"unknown key '{key}'{where}{tail}")


def build(cls: type, data: Any, key: str, sources: Sources, root: type) -> Any:
    """A `cls` instance from a (partial) mapping; missing fields keep their defaults."""
    if data is None:  # an empty section (`rollout:` with everything commented out)
        data = {}
    if not isinstance(data, Mapping):
        raise type_error(key or "<recipe>", cls, data, sources)
    hints = field_types(cls)
    one_or_more = one_or_more_fields(cls)
    kwargs = {}
    for name, value in data.items():
        full = f"{key}.{name}" if key else str(name)
        if name not in hints:
            raise unknown_key_error(full, cls, root, locate(sources, full))
        if name in one_or_more and isinstance(value, str):
            value = [value]
        kwargs[name] = coerce(value, hints[name], full, sources, root)
    return cls(**kwargs)


def coerce(value: Any, tp: Any, key: str, sources: Sources, root: type) -> Any:
    """`value` checked (and minimally converted) against `tp`; ConfigError naming `key` otherwise."""
    if tp is Any:
        return value
    if is_optional(tp):
        if value is None:
            return None
        inner = strip_optional(tp)
        if _is_scalar(inner):  # report "int or null", not just "int"
            return _scalar(value, inner, key, tp, sources)
        return coerce(value, inner, key, sources, root)
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key, sources, root)
    if origin is list:
        if not isinstance(value, list):
            raise type_error(key, tp, value, sources)
        (item,) = get_args(tp)
        return [coerce(v, item, f"{key}[{i}]", sources, root) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise type_error(key, tp, value, sources)
        _, item = get_args(tp)
        return {k: coerce(v, item, f"{key}.{k}", sources, root) for k, v in value.items()}
    if _is_scalar(tp):
        return _scalar(value, tp, key, tp, sources)
    raise TypeError(f"unsupported schema type {tp!r} for {key}")  # a schema bug, not a user error


def _is_scalar(tp: Any) -> bool:
    return tp in (bool, int, float, str) or get_origin(tp) is Literal


def _scalar(value: Any, tp: Any, key: str, declared: Any, sources: Sources) -> Any:
    """A bool / int / float / str / Literal value; errors describe the `declared` field type."""
    if get_origin(tp) is Literal:
        # `type(a) is type(value)` keeps True from matching 1
        if any(value == a and type(a) is type(value) for a in get_args(tp)):
            return value
    elif isinstance(value, bool):
        if tp is bool:
            return value
    elif tp is int:
        if isinstance(value, int):
            return value
    elif tp is float:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise type_error(key, declared, value, sources)


def type_error(key: str, tp: Any, value: Any, sources: Sources) -> ConfigError:
    got = "null" if value is None else f"{value!r} ({type(value).__name__})"
    choices = [a for a in get_args(strip_optional(tp)) if isinstance(a, str)]
    match = difflib.get_close_matches(value, choices, n=1, cutoff=0.6) if isinstance(value, str) else []
    hint = f"; did you mean {match[0]!r}?" if match else ""
    return ConfigError(f"{key}: expected {describe(tp)}, got {got}{locate(sources, key)}{hint}")


def _is_union(tp: Any) -> bool:
    return get_origin(tp) is Union or isinstance(tp, types.UnionType)
