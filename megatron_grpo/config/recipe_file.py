"""Reading YAML recipes: line numbers for every key, and `defaults:` inheritance.

A recipe may start with `defaults: [base.yaml, ...]`: each path is looked up next to the recipe
file, then in the shipped recipes (RECIPE_DIR), so a recipe anywhere can build on
`base.yaml` or `tiny_cpu.yaml`. The bases are merged in order, then the recipe itself; mappings
merge key by key, every other value (lists included) is replaced whole by the later layer.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_grpo.errors import ConfigError

DEFAULTS_KEY = "defaults"

# The shipped recipes, package data (the source tree's top-level recipes/ is a link to it), so an
# installed wheel finds them as a checkout does.
RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"


@dataclass
class RawRecipe:
    """A merged, not yet typed recipe: nested dicts plus where each dotted key was set."""

    data: dict[str, Any]
    sources: dict[str, str]


def deep_merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """Merges `src` into `dst` in place: mappings key by key, other values replaced (copied)."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            deep_merge(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)


def read_yaml(path: Path) -> RawRecipe:
    """One YAML file as a mapping, with "file:line" for every key; ConfigError on bad YAML."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read recipe {path}: {exc.strerror or exc}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        sources: dict[str, str] = {}
        if node is not None:
            _record_keys(node, "", path, sources)
        data = {} if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: a recipe must be a mapping of sections, got {type(data).__name__}")
    return RawRecipe(data, sources)


def _record_keys(node: yaml.Node, prefix: str, path: Path, sources: dict[str, str]) -> None:
    """Fills `sources` from the composed node tree; pyyaml keeps the last of duplicate keys
    silently, so duplicates are reported here."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        full = prefix + str(key_node.value)
        where = f"{path}:{key_node.start_mark.line + 1}"
        if full in seen:
            raise ConfigError(f"{where}: duplicate key '{full}'")
        seen.add(full)
        sources[full] = where
        _record_keys(value_node, full + ".", path, sources)


def load_recipe(path: Path, _chain: tuple[Path, ...] = ()) -> RawRecipe:
    """The recipe at `path` with its `defaults:` bases merged underneath it."""
    here = path.resolve()
    if here in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, here))
        raise ConfigError(f"recipe defaults form a cycle: {cycle}")
    own = read_yaml(path)
    bases = own.data.pop(DEFAULTS_KEY, [])
    where = own.sources.pop(DEFAULTS_KEY, str(path))
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{where}: defaults must be a list of recipe paths, got {bases!r}")
    merged = RawRecipe({}, {})
    for base in bases:
        candidates = [path.parent / base, RECIPE_DIR / base]
        base_path = next((c for c in candidates if c.is_file()), None)
        if base_path is None:
            looked = ", ".join(str(c) for c in dict.fromkeys(candidates))  # a recipe in RECIPE_DIR: one path
            raise ConfigError(f"{where}: defaults entry '{base}' not found (looked for {looked})")
        layer = load_recipe(base_path, (*_chain, here))
        deep_merge(merged.data, layer.data)
        merged.sources.update(layer.sources)
    deep_merge(merged.data, own.data)
    merged.sources.update(own.sources)
    return merged
