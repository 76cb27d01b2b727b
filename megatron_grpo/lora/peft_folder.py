"""PEFT adapter folders (adapter_config.json + adapter_model.safetensors) in and out of the adapters.

read_adapter_config(folder)          the LoRA settings of a PEFT folder; what we cannot reproduce refused
load_adapter_folder(chunks, folder)  every adapter's shard of this rank read from the folder
adapter_state(chunks)                {PEFT name: full tensor} of this pipeline stage (a collective over TP)
write_adapter_folder(...)            the folder peft.PeftModel.from_pretrained loads onto the HF base
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from megatron_grpo.errors import CheckpointError, ConfigError
from megatron_grpo.lora.adapters import LoraAdapter, adapters_of
from megatron_grpo.lora.targets import expand_targets, unknown_targets

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT keys that change the computation away from plain LoRA: refused unless at their default.
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None,
                "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False}


@dataclass(frozen=True)
class PeftAdapterConfig:
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]


def read_adapter_config(folder: str | Path) -> PeftAdapterConfig:
    path = Path(folder) / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found; a PEFT adapter folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}") \
            from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: line {exc.lineno}: not JSON ({exc.msg})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{path}: peft_type {raw['peft_type']!r}; only LORA adapters are supported")
    for key, default in _UNSUPPORTED.items():
        if raw.get(key) and raw[key] != default:
            raise ConfigError(f"{path}: {key}={raw[key]!r} is not supported (expected {default!r})")
    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = unknown_targets(targets)
    if unknown:
        raise ConfigError(f"{path}: target_modules {unknown} are not linear layers this trainer adapts "
                          f"(expected names among {list(expand_targets('all-linear'))} or 'all-linear')")
    return PeftAdapterConfig(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]),
                             dropout=float(raw.get("lora_dropout", 0.0)), target_modules=expand_targets(targets))


def _tp(adapter: LoraAdapter) -> tuple[int, int]:
    return torch.distributed.get_rank(adapter.tp_group), torch.distributed.get_world_size(adapter.tp_group)


def _names(adapter: LoraAdapter, projection: str) -> tuple[str, str]:
    return (f"{adapter.peft_prefix}{projection}.lora_A.weight", f"{adapter.peft_prefix}{projection}.lora_B.weight")


def load_adapter_folder(model_chunks: Sequence[torch.nn.Module], folder: str | Path) -> None:
    """Copies this rank's part of every adapter tensor from the folder's safetensors."""
    from safetensors import safe_open

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path}: not found")
    with safe_open(str(path), framework="pt") as f:
        present = set(f.keys())
        for adapter in adapters_of(model_chunks):
            rank, size = _tp(adapter)
            for projection in adapter.shape.trained:
                for key, name in zip(("A", "B"), _names(adapter, projection)):
                    if name not in present:
                        raise CheckpointError(f"{path}: no tensor {name}; the recipe's target_modules adapt "
                                              f"{projection}")
                    param = (adapter.lora_A if key == "A" else adapter.lora_B)[projection]
                    full = f.get_slice(name)
                    shape = tuple(full.get_shape())
                    split = (key == "B") == (adapter.shape.parallel == "column")  # column: B split, row: A
                    want = list(param.shape)
                    if split:
                        want[adapter.tp_split_axis()] *= size
                    if list(shape) != want:
                        raise CheckpointError(f"{path}: {name} has shape {list(shape)}; the base model and "
                                              f"rank {adapter.rank} expect {want}")
                    tensor = f.get_tensor(name)
                    if split:
                        tensor = tensor.chunk(size, dim=adapter.tp_split_axis())[rank]
                    with torch.no_grad():
                        param.copy_(tensor)


def adapter_state(model_chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """{PEFT name: full tensor} of this rank's pipeline stage, the TP-split tensors gathered over TP.
    A collective over the TP group: every TP rank of the stage calls it."""
    out = {}
    for adapter in adapters_of(model_chunks):
        rank, size = _tp(adapter)
        for projection in adapter.shape.trained:
            a_name, b_name = _names(adapter, projection)
            for name, param, split in ((a_name, adapter.lora_A[projection], adapter.shape.parallel == "row"),
                                       (b_name, adapter.lora_B[projection], adapter.shape.parallel == "column")):
                tensor = param.detach().contiguous()
                if split and size > 1:
                    parts = [torch.empty_like(tensor) for _ in range(size)]
                    torch.distributed.all_gather(parts, tensor, group=adapter.tp_group)
                    tensor = torch.cat(parts, dim=adapter.tp_split_axis())
                out[name] = tensor.cpu()
    return out


def gather_adapter_state(model_chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor] | None:
    """Every stage's adapter_state on global rank 0 (None elsewhere). A collective over the world."""
    from megatron.core import parallel_state as ps

    state = adapter_state(model_chunks)
    mine = state if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 else {}
    world = torch.distributed.get_world_size()
    gathered = [None] * world if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    return {name: tensor for part in gathered for name, tensor in part.items()}


def write_adapter_folder(folder: str | Path, state: dict[str, torch.Tensor], config: PeftAdapterConfig,
                         base_model: str, dtype: torch.dtype | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors, as peft 0.21 writes them for a causal LM."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: (t if dtype is None else t.to(dtype)).contiguous() for name, t in sorted(state.items())}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
        "target_modules": sorted(config.target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
    }, indent=2) + "\n")
    return folder
