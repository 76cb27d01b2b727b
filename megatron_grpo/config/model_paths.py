"""Local path or Hugging Face hub id? One rule for every model path key (model.path, model.config_path,
model.tokenizer_path, ref.model_path, reward.models.<name>.path), so that a local folder that is
missing is named at once instead of being sent to the hub (whose retries take about a minute
before they fail). Torch-free: the trainer checks its recipe with it before importing torch.

A value is a local path when it starts with /, ./, ../, ~ or ., when it has more than one '/' (a
hub id is `org/name` or `name`), or when its first part is a folder here (`outputs/rm` once
./outputs exists). Anything else (`Qwen/Qwen3-8B`, `gpt2`) is a hub id unless it exists here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_grpo.config.schema import Config

LOCAL_PREFIXES = ("/", "./", "../", "~", ".")  # no hub id starts with one of these (the first that matches is named)


def local_path_reason(value: str) -> Optional[str]:
    """Why `value` is a local path and not a hub id (for messages), or None when it may be a hub id."""
    for prefix in LOCAL_PREFIXES:
        if value.startswith(prefix):
            return f"it starts with {prefix}"
    parts = value.split("/")
    if len(parts) > 2:
        return "it has more than one '/' (a hub id is org/name)"
    if len(parts) == 2 and Path(parts[0]).is_dir():
        return f"./{parts[0]} is a folder here"
    return None


def model_path_keys(cfg: Config) -> list[tuple[str, str]]:
    """(key, value) of every model path the recipe sets; reward models built when missing
    (reward.models.<name>.build_if_missing) are left out: their path is made at the start."""
    m = cfg.model
    keys = [("model.path", m.path), ("model.config_path", m.config_path), ("model.tokenizer_path", m.tokenizer_path),
            ("ref.model_path", cfg.ref.model_path)]
    keys += [(f"reward.models.{name}.path", scorer.path) for name, scorer in cfg.reward.models.items()
             if scorer.build_if_missing is None]
    return [(key, value) for key, value in keys if value]


def missing_local_path(key: str, value: str) -> Optional[str]:
    """One line naming `key` when `value` is a local path (the rule above) that does not exist."""
    reason = local_path_reason(value)
    if reason is None or Path(value).expanduser().exists():
        return None
    return (f"{key}={value}: no such file or folder (a local path: {reason}; a Hugging Face hub id is "
            f"written org/name)")


def check_model_paths(cfg: Config) -> None:
    """Raises one ConfigError naming every model path key whose local path is missing."""
    from megatron_grpo.errors import ConfigError

    problems = [p for key, value in model_path_keys(cfg) if (p := missing_local_path(key, value))]
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} missing model paths: " + "; ".join(problems))
