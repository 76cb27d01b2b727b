"""`megatron-grpo config from-verl`: a verl command line or YAML -> a recipe here, through the one
table in verl_keys.py; and that table as markdown (`config verl-keys`, the table in docs/verl.md).

Command lines are read as verl's examples write them: the arguments alone, or the whole line
(`python3 -m verl.trainer.main_ppo --config-name=... key=value ...`, also as one quoted string with
backslash line breaks). A launch script (verl's examples/*.sh) is read without running it: the
arguments of the `python3 -m verl.trainer.main_ppo` it runs, as bash would pass them
(config/shell_script.py). Values follow Hydra's override syntax as far as recipes need it (YAML
scalars, quoted strings, [a, b] lists, {a: 1} mappings; `+key=` and `++key=` add, `~key` deletes).
Nothing is dropped silently: every key given is translated, or listed in the recipe's header with
the reason it has no equivalent here.
"""
from __future__ import annotations

import os
import re
import shlex
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence, get_args, get_origin

import yaml

from megatron_grpo.config.coerce import all_keys, strip_optional
from megatron_grpo.config.derived import INERT_WITHOUT_KL_IN_REWARD
from megatron_grpo.config.overrides import field_type_at
from megatron_grpo.config.schema import Config
from megatron_grpo.config.shell_script import looks_like_a_script, read_launches
from megatron_grpo.config.verl_keys import TABLE, VERL_VERSION, lookup, verl_default_values
from megatron_grpo.errors import ConfigError

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
# What a launch script runs: verl's trainer, or a verl recipe's (recipe.dapo.main_dapo)
_LAUNCH_MODULE = re.compile(r"verl\.trainer\.main_ppo|recipe\.\w+\.main_\w+")
_SCRIPT_SUFFIXES = (".sh", ".bash")


@dataclass
class VerlInput:
    items: list[tuple[str, Any]] = field(default_factory=list)  # (verl key, value), in order
    ignored: list[str] = field(default_factory=list)            # what was not a key=value override, and why


@dataclass
class VerlTranslation:
    values: dict[str, Any]                 # our dotted key -> value
    origin: dict[str, str]                 # our dotted key -> the verl key it came from
    changed: list[str]                     # "verl key=value: what changed"
    defaults: list[str]                    # verl defaults written out, with why
    unmapped: dict[str, list[str]]         # reason -> ["verl key=value", ...]
    no_effect: list[str]                   # keys that set nothing here, with the row's note
    unknown: list[str]                     # keys that are not verl 0.9 keys
    ignored: list[str]


def parse_value(text: str) -> Any:
    """A Hydra override value as Python: YAML scalars / lists / mappings; numbers also in the forms
    YAML 1.1 leaves as strings (1e-6)."""
    if text == "":
        return ""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and _NUMBER.match(value) and text[:1] not in "'\"":
        return float(value)
    return value


def parse_command_line(args: Sequence[str]) -> VerlInput:
    """verl's `key=value` overrides from a command line (whole or the arguments alone)."""
    if len(args) == 1 and any(c.isspace() for c in args[0]):
        args = shlex.split(os.path.expandvars(args[0].replace("\\\n", " ")))  # one pasted, unexpanded line
    return _parse_arguments(args)


def _parse_arguments(args: Sequence[str]) -> VerlInput:
    parsed = VerlInput()
    started = False
    for token in args:
        if token.startswith("~"):  # Hydra deletion of a default: nothing to translate
            parsed.ignored.append(f"{token}: deletes a verl default")
            continue
        key, sep, text = token.partition("=")
        if not sep or token.startswith("-") or not re.match(r"^\+{0,2}[A-Za-z_][\w.\-@/]*$", key):
            reason = "a Hydra flag" if token.startswith("--") else "not a key=value override"
            if started or token.startswith("--"):
                parsed.ignored.append(f"{token}: {reason}")
            continue  # the program part of the line: python3 -m verl.trainer.main_ppo
        started = True
        parsed.items.append((key.lstrip("+"), parse_value(text)))
    return parsed


def read_yaml(path: Path) -> VerlInput:
    """The leaves of a verl YAML config as (dotted key, value); Hydra's defaults: / hydra: are skipped."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read verl config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"verl config {path} is not a mapping")
    parsed = VerlInput()
    for skipped in ("defaults", "hydra"):
        if data.pop(skipped, None) is not None:
            parsed.ignored.append(f"{skipped}: Hydra's composition, not a setting")

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            full = f"{prefix}{key}"
            row = lookup(full)
            if isinstance(value, dict) and value and not (row is not None and not row.is_pattern and row.ours):
                walk(value, full + ".")
            else:
                parsed.items.append((full, value))

    walk(data, "")
    return parsed


def read_script(path: Path, positional: Sequence[str] = (),
                environ: Optional[Mapping[str, str]] = None) -> VerlInput:
    """The overrides of the verl launch in a shell script, read without running it. `positional`
    are the script's own arguments ("$@"); `environ` (default: this process's, with $PWD as bash
    sets it) fills the names the script does not set."""
    if environ is None:
        environ = {**os.environ, "PWD": os.getcwd()}
    reading = read_launches(path, positional, environ, lambda module: _LAUNCH_MODULE.fullmatch(module) is not None)
    if not reading.launches:
        raise ConfigError(f"{path}: no verl launch found (python3 -m verl.trainer.main_ppo ..., or a recipe's "
                          "python3 -m recipe.NAME.main_NAME ...)")
    if len(reading.launches) > 1:
        lines = ", ".join(str(launch.line) for launch in reading.launches)
        raise ConfigError(f"{path}: runs verl {len(reading.launches)} times (lines {lines}): give the launch to "
                          "translate as a command line")
    launch = reading.launches[0]
    parsed = _parse_arguments([argument for argument, _ in launch.arguments])
    parsed.ignored.extend(reading.not_read)
    if not parsed.items:
        raise ConfigError(f"{path}:{launch.line}: the launch of {launch.module} passes no key=value override")
    return parsed


def read_verl(args: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> VerlInput:
    """A verl YAML file (one argument ending in .yaml / .yml), a launch script (a file ending in
    .sh / .bash, or one that reads as a script; the arguments after it are its "$@") or a command
    line. Refused (ConfigError) when it holds no verl key at all."""
    first = Path(args[0]) if args else None
    if first is not None and _names_file(args[0], (".yaml", ".yml")):
        if len(args) > 1:
            raise ConfigError(f"a verl YAML file takes no other arguments (given: {' '.join(args[1:])})")
        parsed = read_yaml(first)
    elif first is not None and (_names_file(args[0], _SCRIPT_SUFFIXES) or _is_script(first)):
        return read_script(first, args[1:], environ)
    elif len(args) == 1 and first is not None and first.is_file():
        parsed = read_yaml(first)  # a verl YAML file by another name
    else:
        parsed = parse_command_line(args)
    if not parsed.items:
        shown = " ".join(args) if len(" ".join(args)) <= 80 else " ".join(args)[:77] + "..."
        raise ConfigError(f"no verl setting in {shown!r}: expected verl's key=value overrides (python3 -m "
                          "verl.trainer.main_ppo key=value ...), a verl YAML file or a launch script (.sh)")
    return parsed


def _names_file(token: str, suffixes: tuple[str, ...]) -> bool:
    """A file by its suffix, unless it is a key=value override whose value has that suffix."""
    return Path(token).suffix in suffixes and ("=" not in token or Path(token).is_file())


def _is_script(path: Path) -> bool:
    try:
        return path.is_file() and looks_like_a_script(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return False


def translate(parsed: VerlInput) -> VerlTranslation:
    given = dict(parsed.items)  # later wins, as in Hydra
    out = VerlTranslation({}, {}, [], [], defaultdict(list), [], [], list(parsed.ignored))
    for key, value in given.items():
        shown = f"{key}={_show(value)}"
        row = lookup(key)
        if row is None:
            out.unknown.append(shown)
            continue
        if isinstance(value, str) and "${" in value:
            out.unmapped["an interpolation of other verl keys: not translated"].append(shown)
            continue
        if not row.ours and row.convert is None:
            out.unmapped[row.note].append(shown)
            continue
        result = row.translate(value, given, key)
        for ours, ours_value in result.values.items():
            out.values[ours] = _merge(out.values.get(ours), ours_value)
            out.origin[ours] = f"from verl's {key}"
        if result.note:
            out.changed.append(f"{shown}: {result.note}")
        elif not result.values:
            out.no_effect.append(f"{shown} ({row.note})" if row.note else shown)
    for ours, value, why in verl_default_values(given):
        if ours not in out.values:
            out.values[ours] = value
            out.origin[ours] = why
            out.defaults.append(f"{ours}: {_show(value)} ({why})")
    if not out.values.get("algorithm.use_kl_in_reward"):
        out.no_effect.extend(f"{key}={_show(out.values[key])}: kept; inert while algorithm.use_kl_in_reward=false, "
                             "as in verl" for key in INERT_WITHOUT_KL_IN_REWARD if key in out.values)
    out.values = {key: _typed(key, value) for key, value in out.values.items()}
    return out


def to_nested(values: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys -> nested sections, in the schema's key order."""
    order = {key: i for i, key in enumerate(all_keys(Config))}
    nested: dict[str, Any] = {}
    for key in sorted(values, key=lambda k: (order.get(_section_key(k), len(order)), k)):
        *parents, last = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = values[key]
    return nested


def render_recipe(translation: VerlTranslation) -> str:
    lines = [f"# Translated from verl (the keys of verl {VERL_VERSION}) by `megatron-grpo config from-verl`.",
             "# Nothing given was dropped: what has no equivalent here is listed below, with why."]

    def block(title: str, entries: Sequence[str]) -> None:
        if entries:
            lines.append(f"# {title}:")
            lines.extend(f"#   {entry}" for entry in entries)

    block("Translated with a change", translation.changed)
    block("verl defaults that differ here, written out", translation.defaults)
    block("No equivalent here (not translated)",
          [f"{', '.join(keys)}: {why}" for why, keys in translation.unmapped.items()])
    block("No effect here", translation.no_effect)
    block("Not keys of verl's ppo_trainer / ppo_megatron_trainer config (not translated)", translation.unknown)
    block("Ignored", translation.ignored)
    body = yaml.safe_dump(to_nested(translation.values), sort_keys=False, default_flow_style=False,
                          allow_unicode=True)
    return "\n".join(lines) + "\n" + body


# ---------------------------------------------------------------- the table as markdown

def markdown_table() -> str:
    """docs/verl.md's tables: every verl key that translates, then the keys with no
    equivalent grouped by reason."""
    lines = [f"verl {VERL_VERSION} key | here | notes", "--- | --- | ---"]
    for row in TABLE:
        if row.ours:
            lines.append(f"`{row.verl}` | {', '.join(f'`{k}`' for k in row.ours)} | {_cell(row.note)}")
    lines += ["", "No equivalent here | why", "--- | ---"]
    by_reason: dict[str, list[str]] = defaultdict(list)
    for row in TABLE:
        if not row.ours:
            by_reason[row.note].append(row.verl)
    for why, keys in by_reason.items():
        lines.append(f"{', '.join(f'`{k}`' for k in keys)} | {_cell(why)}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _merge(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **new}
    if isinstance(old, list) and isinstance(new, list) and old is not new:
        return [*old, *new]  # e.g. SGLang flags from several engine_kwargs entries
    return new


def _typed(key: str, value: Any) -> Any:
    """Numbers given for a text field (experiment_name=12) become text, as verl's strings would."""
    try:
        tp = strip_optional(field_type_at(Config, key, ""))
    except ConfigError:
        return value  # under a free-form mapping (model.override_config.x)
    text = tp is str or (get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp)))
    if text and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def _section_key(key: str) -> str:
    while key and key not in _KEY_ORDER_CACHE:
        key = key.rpartition(".")[0]
    return key


_KEY_ORDER_CACHE = frozenset(all_keys(Config))


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
    text = text.removesuffix("\n...").strip()
    return text if len(text) <= 80 else text[:80] + "..."


def config_of(translation: VerlTranslation) -> Config:
    """The typed Config of a translation (ConfigError naming the key when a value does not fit)."""
    from megatron_grpo.config.loader import config_from_dict

    return config_from_dict(to_nested(translation.values), translation.origin)


__all__ = ["VerlInput", "VerlTranslation", "config_of", "markdown_table", "parse_command_line", "parse_value",
           "read_script", "read_verl", "read_yaml", "render_recipe", "to_nested", "translate"]
