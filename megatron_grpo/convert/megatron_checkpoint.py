"""Our Megatron weights checkpoint: megatron dist_checkpointing (torch_dist) + the model config.

    <dir>/megatron_grpo_model.json   ModelArchitecture.to_dict(): the HF config and the padded vocab
    <dir>/hf_assets/                 generation config and tokenizer files of the source HF model
    <dir>/model/                     torch_dist checkpoint of the model chunks (layout-free: loads
                                     at any TP/PP/VPP whose TP divides heads, groups, ffn, vocab)

Both functions are collectives over all ranks. The folder is written under <dir>.incomplete and
renamed when every rank has finished, so a crash never leaves a loadable-looking half checkpoint.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_grpo.checkpointing.sharded import READ_ERRORS, load_model_state, model_sharded_state_dict, short_error
from megatron_grpo.convert.torch_dist_files import ASSETS_DIR, DIST_METADATA, WEIGHTS_DIR, check_shard_sizes
from megatron_grpo.convert.writer import copy_hf_assets
from megatron_grpo.errors import CheckpointError
from megatron_grpo.models.hf_config import MODEL_CONFIG_FILE, ModelArchitecture



def save_megatron_checkpoint(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture, out_dir: str | Path,
                             assets_from: str | Path | None = None, overwrite: bool = False) -> Path:
    """Saves the (sharded) model; rank 0 writes the config and copies assets from `assets_from`."""
    from megatron.core import dist_checkpointing

    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".incomplete")
    rank = dist.get_rank()
    if rank == 0:
        if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
            raise CheckpointError(f"{out_dir}: output folder is not empty (use --force to overwrite)")
        shutil.rmtree(staging, ignore_errors=True)
        (staging / WEIGHTS_DIR).mkdir(parents=True)
        cfg.save(staging)
        if assets_from is not None:
            copy_hf_assets(assets_from, staging / ASSETS_DIR)
    dist.barrier()
    dist_checkpointing.save(model_sharded_state_dict(model_chunks), str(staging / WEIGHTS_DIR))
    dist.barrier()
    if rank == 0:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    dist.barrier()
    return out_dir


def load_megatron_checkpoint(model_chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path,
                             cfg: ModelArchitecture | None = None) -> ModelArchitecture:
    """Loads weights saved by save_megatron_checkpoint into this rank's chunks. When `cfg` is given
    (the config the chunks were built from) it must describe the same network as the stored one."""
    ckpt_dir = Path(ckpt_dir)
    stored = ModelArchitecture.load(ckpt_dir)
    if cfg is not None:
        diff = cfg.same_math_as(stored)
        if diff:
            raise CheckpointError(f"{ckpt_dir / MODEL_CONFIG_FILE}: the checkpoint's model differs from the "
                                  f"requested one in {diff}")
    load_model_weights(model_chunks, ckpt_dir / WEIGHTS_DIR)
    return stored


def load_model_weights(model_chunks: Sequence[torch.nn.Module], weights_dir: str | Path) -> None:
    """Loads the model tensors of a torch_dist folder into this rank's chunks, resharding from
    whatever layout saved them. Reads only the model: the optimizer state of a training
    checkpoint (model_optim/) stays on disk. Any failure, on any rank, is one CheckpointError."""
    from megatron.core import dist_checkpointing

    from megatron_grpo.launch.safe_dcp import dcp_bytes_weights_only

    weights = Path(weights_dir)
    if not (weights / DIST_METADATA).is_file():
        raise CheckpointError(f"{weights}: no dist_checkpointing {DIST_METADATA}; incomplete checkpoint?")
    check_shard_sizes(weights)
    try:
        with dcp_bytes_weights_only():
            loaded = dist_checkpointing.load(model_sharded_state_dict(model_chunks), str(weights))
    except READ_ERRORS as exc:  # megatron / torch DCP raise assorted errors for bad or mismatched shards
        raise CheckpointError(f"{weights}: cannot load into this model ({short_error(exc)}); "
                              f"a shard file is missing, damaged or from another model") from None
    load_model_state(model_chunks, loaded)
