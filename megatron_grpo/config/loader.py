"""Recipe + overrides -> typed Config, and Config -> YAML (the round trip `config show` relies on)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from megatron_grpo.config.coerce import build
from megatron_grpo.config.overrides import apply_override
from megatron_grpo.config.recipe_file import RECIPE_DIR, RawRecipe, load_recipe
from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError

# Bare recipe names (`tiny_cpu`) are looked up in RECIPE_DIR (recipe_file.py), as `defaults:` entries are.


def resolve_recipe(name: str | Path) -> Path:
    """A recipe file path: `name` itself if it is a file, else `<name>[.yaml]` in RECIPE_DIR."""
    path = Path(name)
    if path.is_file():
        return path
    if path.parent == Path("."):
        shipped = RECIPE_DIR / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
        if shipped.is_file():
            return shipped
    known = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
    raise ConfigError(f"recipe '{name}' not found: no such file, and no {path.stem}.yaml in {RECIPE_DIR}"
                      f" (available: {', '.join(known) or 'none'})")


def load_raw(recipe: str | Path | None, overrides: Sequence[str] = ()) -> RawRecipe:
    """The merged recipe dict (defaults, file, overrides) before typing."""
    raw = RawRecipe({}, {}) if recipe is None else load_recipe(resolve_recipe(recipe))
    for text in overrides:
        apply_override(raw, text, Config)
    return raw


def load_config(recipe: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The typed config of `recipe` (a path or a bare name; None = all defaults) with `a.b=c`
    overrides applied in order. Raises ConfigError on any unknown key or wrong type. Cross-field
    checks are separate: call validate(config, world_size)."""
    raw = load_raw(recipe, overrides)
    return build(Config, raw.data, "", raw.sources, Config)


def config_from_dict(data: Mapping[str, Any], sources: Mapping[str, str] | None = None) -> Config:
    """A typed Config from nested mappings (e.g. a checkpoint's saved config)."""
    return build(Config, data, "", sources or {}, Config)


def to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dicts / lists / scalars (deep copies)."""
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    """YAML that load_config / config_from_dict turn back into an equal Config."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False, allow_unicode=True)
