"""The few HF config.json numbers the cross-field checks need, read without transformers."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_grpo.config.schema import ModelConfig
from megatron_grpo.errors import ConfigError


# The mixture-of-experts sizes of the HF configs models/hf_config.py reads (each architecture names
# its expert count one of these ways); a 0 would end in a division by zero when the model is built.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelDims:
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None  # HF num_key_value_heads (defaults to the head count)
    num_layers: Optional[int] = None
    model_type: Optional[str] = None
    moe: dict[str, int] = field(default_factory=dict)  # the MOE_KEYS given (integers)
    source: dict[str, str] = field(default_factory=dict)  # key -> where it is set (config.json / override_config)


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
    source = {key: str(file) for key in fields}
    source.update({key: "model.override_config" for key in model.override_config})
    fields = {**fields, **model.override_config}
    heads = _int(fields.get("num_attention_heads"))
    groups = _int(fields.get("num_key_value_heads")) or heads
    model_type = fields.get("model_type")
    moe = {key: value for key in MOE_KEYS if (value := _int(fields.get(key))) is not None}
    return ModelDims(heads, groups, _int(fields.get("num_hidden_layers")),
                     model_type if isinstance(model_type, str) else None, moe, source)


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
