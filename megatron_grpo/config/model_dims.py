"""The few HF config.json numbers the cross-field checks need, read without transformers."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_grpo.config.schema import ModelConfig
from megatron_grpo.errors import ConfigError


@dataclass(frozen=True)
class ModelDims:
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None  # HF num_key_value_heads (defaults to the head count)
    num_layers: Optional[int] = None


def hf_config_file(model: ModelConfig) -> Optional[Path]:
    """The local config.json the model is built from, or None (hub id / nothing given)."""
    for candidate in (model.config_path, model.path):
        if candidate is None:
            continue
        path = Path(candidate)
        if path.is_dir() and (path / "config.json").is_file():
            return path / "config.json"
        if path.is_file():
            return path
    return None


def model_dims(model: ModelConfig) -> ModelDims:
    """Dims from the local config.json (if any) with model.override_config on top; unknown = None."""
    fields: dict[str, Any] = {}
    file = hf_config_file(model)
    if file is not None:
        try:
            fields = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the model config {file}: {exc}") from None
        if not isinstance(fields, dict):
            raise ConfigError(f"model config {file} is not a JSON object")
    fields = {**fields, **model.override_config}
    heads = _int(fields.get("num_attention_heads"))
    groups = _int(fields.get("num_key_value_heads")) or heads
    return ModelDims(heads, groups, _int(fields.get("num_hidden_layers")))


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
