"""Dotted command-line overrides `a.b.c=value`, parsed by the type of the field they set.

Value syntax, by field type:
- str / choice fields: the text as is (`logging.experiment_name=1e3` stays the string "1e3");
  quote it YAML-style to keep a literal `null`: `key='null'`.
- int, float, bool, mappings: a YAML scalar / flow value (`true`, `3`, `1e-6`, `{a: 1}`).
- lists: YAML flow syntax `[1,2]` / `["a","b"]`, or comma-separated `a,b`; `[]` is empty.
- any Optional field: `null` (or `~`) sets None.
- an empty value (`key=`) is refused: it is usually an unset shell variable.
A section given as a mapping (`actor.optim={lr: 1e-5}`) merges into what the recipe set; a
free-form mapping field (`model.override_config={...}`) is replaced whole.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args, get_origin

import yaml

from megatron_grpo.config.coerce import field_types, is_optional, strip_optional, unknown_key_error
from megatron_grpo.config.recipe_file import RawRecipe, deep_merge
from megatron_grpo.errors import ConfigError

NULLS = ("null", "~", "Null", "NULL")


def split_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' is not of the form key=value (e.g. actor.optim.lr=1e-6)")
    if not value.strip():
        # `trainer.total_steps=$STEPS` with STEPS unset would otherwise mean "no limit" (None).
        raise ConfigError(f"override '{text}' has no value (an unset shell variable?): write {key}=null for "
                          f"none, {key}=[] for an empty list, {key}='' for an empty string")
    return key, value


def field_type_at(root: type, key: str, where: str) -> Any:
    """The schema type of dotted `key`; unknown keys raise with a suggestion."""
    tp: Any = root
    section: type = root
    walked: list[str] = []
    for part in key.split("."):
        walked.append(part)
        tp = strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            section = tp
            fields = field_types(tp)
            if part not in fields:
                raise unknown_key_error(".".join(walked), section, root, where, full_key=key)
            tp = fields[part]
        elif get_origin(tp) is dict:  # free-form mapping: any key, the mapping's value type
            tp = get_args(tp)[1]
        elif tp is Any:
            continue
        else:
            raise ConfigError(f"'{'.'.join(walked[:-1])}' is a single value, not a section: cannot set "
                              f"'{key}'{where}")
    return tp


def parse_value(text: str, tp: Any, where: str) -> Any:
    """The raw Python value of override text for a field of type `tp` (checked later by coerce)."""
    if is_optional(tp) and text.strip() in NULLS:
        return None
    tp = strip_optional(tp)
    if tp is str or (get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp))):
        return _yaml(text, where) if text[:1] in ("'", '"') else text
    if get_origin(tp) is list:
        stripped = text.strip()
        if stripped.startswith("["):
            return _yaml(stripped, where)
        if not stripped:
            return []
        (item,) = get_args(tp)
        return [parse_value(part.strip(), item, where) for part in stripped.split(",")]
    return _yaml(text, where)


def apply_override(recipe: RawRecipe, text: str, root: type) -> None:
    """Sets one `key=value` override into the raw recipe, recording it as the key's source."""
    key, raw = split_override(text)
    where = f" (override '{text}')"
    tp = field_type_at(root, key, where)
    value = parse_value(raw, tp, where)
    *parents, last = key.split(".")
    node = recipe.data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    # a section merges with what the recipe set; a free-form mapping field is replaced whole
    if dataclasses.is_dataclass(strip_optional(tp)) and isinstance(value, dict) and isinstance(node.get(last), dict):
        deep_merge(node[last], value)
    else:
        node[last] = value
    recipe.sources[key] = f"override '{text}'"


def _yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"value is not valid YAML: {problem}{where}") from None
