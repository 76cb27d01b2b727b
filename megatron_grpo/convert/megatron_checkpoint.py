"""Our Megatron weights checkpoint: megatron dist_checkpointing (torch_dist) + the model config.

    <dir>/megatron_grpo_model.json   ModelConfig.to_dict(): the HF config and the padded vocab
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

from megatron_grpo.convert.writer import copy_hf_assets
from megatron_grpo.errors import CheckpointError
from megatron_grpo.models.builder import unwrap
from megatron_grpo.models.hf_config import MODEL_CONFIG_FILE, ModelConfig

WEIGHTS_DIR = "model"
ASSETS_DIR = "hf_assets"


def _sharded_state_dict(model_chunks: Sequence[torch.nn.Module]) -> dict:
    chunks = [unwrap(c) for c in model_chunks]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}  # megatron-LM's VPP keys


def save_megatron_checkpoint(model_chunks: Sequence[torch.nn.Module], cfg: ModelConfig, out_dir: str | Path,
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
    dist_checkpointing.save(_sharded_state_dict(model_chunks), str(staging / WEIGHTS_DIR))
    dist.barrier()
    if rank == 0:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    dist.barrier()
    return out_dir


def load_megatron_checkpoint(model_chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path,
                             cfg: ModelConfig | None = None) -> ModelConfig:
    """Loads weights saved by save_megatron_checkpoint into this rank's chunks. When `cfg` is given
    (the config the chunks were built from) it must describe the same network as the stored one."""
    ckpt_dir = Path(ckpt_dir)
    stored = ModelConfig.load(ckpt_dir)
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

    from megatron_grpo.convert.sources import DIST_METADATA, check_shard_sizes, dcp_errors

    weights = Path(weights_dir)
    if not (weights / DIST_METADATA).is_file():
        raise CheckpointError(f"{weights}: no dist_checkpointing {DIST_METADATA}; incomplete checkpoint?")
    check_shard_sizes(weights)
    sharded = _sharded_state_dict(model_chunks)
    try:
        loaded = dist_checkpointing.load(sharded, str(weights))
    except dcp_errors() as exc:  # megatron / torch DCP raise assorted errors for bad or mismatched shards
        raise CheckpointError(f"{weights}: cannot load into this model ({type(exc).__name__}: {_first_line(exc)}); "
                              f"a shard file is missing, damaged or from another model") from None
    for key, chunk in zip(list(sharded), model_chunks):
        unwrap(chunk).load_state_dict(loaded[key])


def _first_line(exc: BaseException) -> str:
    """One line for an error whose text may hold whole tracebacks: DCP's CheckpointException
    carries each failing rank's exception; the first one says what went wrong."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _trace) = next(iter(sorted(failures.items())))
        return f"rank {rank}: {type(inner).__name__}: {_first_line(inner)}"
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip() if lines else repr(exc)
