"""Which Megatron weights a user-given path names, and the HF side (config, tokenizer) that goes
with them. File reading only: no torch.distributed, so every rank resolves the same thing.

Accepted paths (`export` and `convert megatron-to-hf --ckpt`):

    <convert_ckpt>                 written by `convert hf-to-megatron` (megatron_grpo_model.json)
    <convert_ckpt>/model           its torch_dist folder
    <run>                          a training run folder (logging.output_dir, holding checkpoints/)
    <run>/checkpoints              the checkpoint root (step_N/ folders, `latest`)
    <run>/checkpoints/step_N       one training checkpoint (complete.json, model_optim/, config.yaml)
    <run>/checkpoints/step_N/model_optim   its torch_dist folder

With a run or checkpoint root, `step` picks step_N; without it the newest complete checkpoint
is used (the one automatic resume would take). A training checkpoint holds no HF config: it comes
from the run's model folder (<output_dir>/initial_model, or model.path of the recorded config), and
the padded vocabulary size from the stored embedding's shape, so the checkpoint's TP size does not
matter.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_grpo.checkpointing.layout import (COMPLETE_MARKER, CONFIG_FILE, INITIAL_MODEL_DIR, MODEL_OPTIM_DIR,
                                                STEP_DIR, validate_checkpoint)
from megatron_grpo.convert.torch_dist_files import ASSETS_DIR, WEIGHTS_DIR, require_torch_dist, stored_tensor_shapes
from megatron_grpo.errors import CheckpointError
from megatron_grpo.lora.attach import LoraSettings
from megatron_grpo.models.hf_config import MODEL_CONFIG_FILE, ModelArchitecture

EMBEDDING_KEY = "embedding.word_embeddings.weight"
_EXPECTED = ("expected a run folder (with checkpoints/), a checkpoints folder (step_N/), a step_N folder, "
             "its model_optim/, or a `convert hf-to-megatron` checkpoint (megatron_grpo_model.json)")


@dataclass(frozen=True)
class MegatronSource:
    """Megatron weights to export: a torch_dist folder and what describes them."""

    weights_dir: Path            # torch_dist folder (model only, or model + optimizer)
    model_config: ModelArchitecture    # padded vocab = the stored one
    assets_dir: Path | None      # tokenizer files / generation_config.json to copy
    label: str                   # for messages: the step_N or convert checkpoint folder
    step: int | None = None      # training step, None for a convert checkpoint
    lora: LoraSettings | None = None  # a LoRA run's adapters (model.lora of its recorded config)


def is_convert_checkpoint(path: str | Path) -> bool:
    """A folder written by `convert hf-to-megatron` (or save_megatron_checkpoint)."""
    return (Path(path) / MODEL_CONFIG_FILE).is_file()


def resolve_source(path: str | Path, step: int | None = None,
                   hf_reference: str | Path | None = None) -> MegatronSource:
    """The MegatronSource `path` names (see the module doc); CheckpointError naming the path
    and what was expected otherwise. For a training checkpoint, `hf_reference` (an HF folder)
    replaces the run's model folder as the source of config.json and the tokenizer."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder; {_EXPECTED}")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder; {_EXPECTED}")
    if is_convert_checkpoint(path):
        return _convert_source(path, step)
    if path.name == WEIGHTS_DIR and is_convert_checkpoint(path.parent):
        return _convert_source(path.parent, step)
    if path.name == MODEL_OPTIM_DIR and STEP_DIR.match(path.parent.name):
        return _step_source(path.parent, step, hf_reference)
    if STEP_DIR.match(path.name) and ((path / MODEL_OPTIM_DIR).exists() or (path / COMPLETE_MARKER).exists()):
        return _step_source(path, step, hf_reference)
    for root in (path, path / "checkpoints"):
        if _step_folders(root):
            return _step_source(_pick_step(root, step), step, hf_reference)
    raise CheckpointError(f"{path}: not a checkpoint; {_EXPECTED}")


def _convert_source(ckpt: Path, step: int | None) -> MegatronSource:
    if step is not None:
        raise CheckpointError(f"{ckpt}: --step {step} applies to training checkpoints; this is a "
                              f"`convert hf-to-megatron` checkpoint (it has no steps)")
    weights = ckpt / WEIGHTS_DIR
    require_torch_dist(weights)
    assets = ckpt / ASSETS_DIR
    return MegatronSource(weights, ModelArchitecture.load(ckpt), assets if assets.is_dir() else None, str(ckpt))


def _step_folders(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    return {int(m.group(1)): child for child in root.iterdir()
            if (m := STEP_DIR.match(child.name)) and child.is_dir()}


def _pick_step(root: Path, step: int | None) -> Path:
    steps = _step_folders(root)
    if step is not None:
        if step not in steps:
            found = ", ".join(f"step_{s}" for s in sorted(steps))
            raise CheckpointError(f"{root}: no step_{step} (found {found})")
        return steps[step]
    problems = []
    for number in sorted(steps, reverse=True):
        problem = validate_checkpoint(steps[number])
        if problem is None:
            return steps[number]
        problems.append(f"step_{number}: {problem}")
    raise CheckpointError(f"{root}: no complete checkpoint ({'; '.join(problems)})")


def _step_source(step_dir: Path, step: int | None, hf_reference: str | Path | None) -> MegatronSource:
    number = int(STEP_DIR.match(step_dir.name).group(1))
    if step is not None and step != number:
        raise CheckpointError(f"{step_dir}: --step {step} contradicts the folder (step {number}); pass the run "
                              f"or checkpoints folder to choose a step")
    problem = validate_checkpoint(step_dir)
    if problem:
        raise CheckpointError(f"{step_dir}: not a complete checkpoint: {problem}")
    weights = step_dir / MODEL_OPTIM_DIR
    require_torch_dist(weights)
    recorded = _read_recorded_config(step_dir / CONFIG_FILE)
    model_dir = Path(hf_reference) if hf_reference is not None else _run_model_folder(step_dir, recorded)
    padded = stored_tensor_shapes(weights).get(EMBEDDING_KEY)
    if padded is None:
        raise CheckpointError(f"{weights}: no {EMBEDDING_KEY} among the stored tensors; not a model checkpoint")
    if is_convert_checkpoint(model_dir):
        hf_config, assets = ModelArchitecture.load(model_dir).hf_config, model_dir / ASSETS_DIR
    else:
        from megatron_grpo.models.hf_config import load_hf_config_dict

        hf_config, assets = load_hf_config_dict(model_dir)[0], model_dir
    cfg = ModelArchitecture.from_dict({"hf_config": hf_config, "padded_vocab_size": padded[0]},
                                where=f"{model_dir} (model of {step_dir / COMPLETE_MARKER})")
    return MegatronSource(weights, cfg, assets if assets.is_dir() else None, str(step_dir), number,
                          lora=recorded["model.lora"])


def _read_recorded_config(path: Path) -> dict:
    """The few keys of the run's resolved config we need, read as plain YAML (an older or newer
    schema must not stop an export)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{path}: cannot read the run's config ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a YAML mapping")
    section = lambda name: data.get(name) if isinstance(data.get(name), dict) else {}  # noqa: E731
    return {"model.path": section("model").get("path"), "output_dir": section("logging").get("output_dir"),
            "save_dir": section("checkpoint").get("save_dir"), "model.lora": _recorded_lora(section("model"), path)}


def _recorded_lora(model: dict, path: Path) -> LoraSettings | None:
    lora = model.get("lora") if isinstance(model.get("lora"), dict) else {}
    if not lora.get("rank"):
        return None
    from megatron_grpo.lora.targets import expand_targets

    try:
        return LoraSettings(rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=float(lora.get("dropout", 0)),
                            target_modules=expand_targets(lora["target_modules"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: model.lora is incomplete ({type(exc).__name__}: {exc})") from None


def _run_model_folder(step_dir: Path, recorded: dict) -> Path:
    """The HF folder (or convert checkpoint) the run's policy was built from: model.path when it
    is an HF folder; else the run's initial_model/ (random init, or exported from the convert
    checkpoint model.path names), else that convert checkpoint itself."""
    model_path = Path(recorded["model.path"]) if recorded["model.path"] else None
    if model_path is not None and (model_path / "config.json").is_file():
        return model_path
    candidates = []
    if recorded["save_dir"] is None and step_dir.parent.name == "checkpoints":
        candidates.append(step_dir.parent.parent / INITIAL_MODEL_DIR)  # the run folder, even if it was moved
    if recorded["output_dir"]:
        candidates.append(Path(recorded["output_dir"]) / INITIAL_MODEL_DIR)
    if model_path is not None:
        candidates.append(model_path)
    for candidate in candidates:
        if (candidate / "config.json").is_file() or is_convert_checkpoint(candidate):
            return candidate
    tried = ", ".join(str(c) for c in candidates) or "nothing recorded"
    raise CheckpointError(f"{step_dir}: cannot find the run's HF model folder for config.json and the tokenizer "
                          f"(tried {tried}); pass --hf-reference HF_DIR")
