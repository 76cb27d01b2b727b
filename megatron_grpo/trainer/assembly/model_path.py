"""The HF folder the policy starts from: model.path (a local HF folder (config.json), a `convert
hf-to-megatron` checkpoint, or a Hugging Face hub id, fetched into (or found in) the hub cache
before anything reads it), else <output_dir>/initial_model (trainer/assembly/initial_model.py); one clear
error otherwise."""
from __future__ import annotations

import logging
from pathlib import Path

from megatron_grpo.checkpointing.layout import COMPLETE_MARKER, INITIAL_MODEL_DIR, MODEL_OPTIM_DIR
from megatron_grpo.config.model_paths import local_path_reason
from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError

log = logging.getLogger(__name__)

# What the trainer, its tokenizer and the rollout engine read from a hub snapshot (not *.bin /
# *.pth duplicates of the weights, which some repositories also carry).
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_EXPECTED = ("expected an HF model folder (config.json + *.safetensors), a `megatron-grpo convert "
             "hf-to-megatron` checkpoint, or a Hugging Face hub id")


def prepare_model_folder(cfg: Config, output_dir: Path) -> Path:
    """Collective: the HF folder the policy starts from (model.path, or initial_model/ built on
    rank 0 if it is missing or stale)."""
    from megatron_grpo.launch.collectives import on_rank0

    if cfg.model.path:  # an HF folder, or a `convert hf-to-megatron` checkpoint (exported to initial_model/)
        from megatron_grpo.convert.model_folder import hf_model_folder

        folder = hf_model_folder(_resolved_model_path(cfg.model.path), output_dir)
        _warn_unapplied_overrides(cfg.model.override_config, folder)
        return folder
    from megatron_grpo.trainer.assembly.initial_model import (ensure_initial_model, initial_config_source,
                                                              initial_hf_config)

    # Before the model is written (it takes a while for a large one): its context is known now.
    check_context_length(cfg, initial_hf_config(cfg).max_position_embeddings,
                         f"max_position_embeddings of {initial_config_source(cfg)}")
    target = output_dir / INITIAL_MODEL_DIR
    on_rank0(ensure_initial_model, cfg, target)
    return target


def _warn_unapplied_overrides(overrides: dict, folder: Path) -> None:
    """model.override_config shapes a model built from scratch only; a folder's config.json is what
    its weights were trained with, so the overrides are not applied: say which ones differ."""
    import json

    import torch.distributed as dist

    if not overrides or (dist.is_initialized() and dist.get_rank() != 0):
        return
    hf_config = json.loads((folder / "config.json").read_text())
    differing = sorted(k for k, v in overrides.items() if hf_config.get(k, object()) != v)
    if differing:
        log.warning("model.override_config is not applied to model.path (%s/config.json is used as it is); "
                    "these keys differ from it: %s", folder, ", ".join(differing))


def _resolved_model_path(value: str) -> Path:
    """Rank 0 resolves model.path first (one hub download, its error on every rank); the others
    then find it in the cache (or download to their node's)."""
    import torch.distributed as dist

    from megatron_grpo.launch.collectives import on_rank0

    path = on_rank0(local_model_folder, value)
    return path if dist.get_rank() == 0 else local_model_folder(value)


def check_context_length(cfg: Config, max_positions: int, source: str) -> None:
    """A prompt plus its response must fit the model's context, checked before any weights are
    loaded (the model was not built for positions beyond it); `source` says where the context is set."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if longest > max_positions:
        raise ConfigError(f"data.max_prompt_length + data.max_response_length = {cfg.data.max_prompt_length} + "
                          f"{cfg.data.max_response_length} = {longest} tokens exceed the model's context of "
                          f"{max_positions} ({source})")
    multi_turn = cfg.rollout.multi_turn  # a trajectory (the prompt, every turn and observation) is one sequence
    if multi_turn.environment is not None and (multi_turn.max_length or 0) > max_positions:
        raise ConfigError(f"rollout.multi_turn.max_length={multi_turn.max_length} tokens (the prompt and every turn) "
                          f"exceed the model's context of {max_positions} ({source})")


def local_model_folder(value: str) -> Path:
    """The local folder model.path names; a hub id is downloaded (or found in the cache)."""
    from megatron_grpo.convert.sources import is_convert_checkpoint

    path = Path(value).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file() or is_convert_checkpoint(path):
            return path
        if (path / COMPLETE_MARKER).is_file() and (path / MODEL_OPTIM_DIR).is_dir():
            raise ConfigError(f"model.path={value} is a training checkpoint: continue it with "
                              f"checkpoint.resume={value}, or make an HF folder of it with "
                              f"`megatron-grpo export {value} --out HF_DIR`")
        what = "is empty" if not any(path.iterdir()) else "has no config.json"
        raise ConfigError(f"model.path={value}: the folder {what}; {_EXPECTED}")
    if path.exists():
        raise ConfigError(f"model.path={value} is a file; {_EXPECTED}")
    if not _is_repo_id(value):
        raise ConfigError(f"model.path={value}: no such folder; {_EXPECTED}")
    return _hub_snapshot(value)


def _is_repo_id(value: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if local_path_reason(value) is not None:  # config/model_paths.py: the one rule for every model path key
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub raises many kinds; one line for all
        raise ConfigError(f"model.path={repo_id}: no such local folder, and the Hugging Face hub could not "
                          f"provide it ({_hub_reason(exc)})") from None


def _hub_reason(exc: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return f"HF_HUB_OFFLINE=1 and it is not in the cache {constants.HF_HUB_CACHE}"
    if isinstance(exc, GatedRepoError):
        return "a gated model: accept its license on the hub and log in (`hf auth login`)"
    if isinstance(exc, RepositoryNotFoundError):
        return "no such model on the hub, or a private one (log in with `hf auth login`)"
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}"
