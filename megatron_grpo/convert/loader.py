"""Load an HF safetensors folder into this rank's model chunks (its TP shard of its PP stage).

Collective-free: every rank reads only the slices of the tensors it owns."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from megatron_grpo.convert.hf_io import HFCheckpoint
from megatron_grpo.convert.mappings import IGNORED_WHEN_TIED, bind, expected_hf_tensors, ignored_hf_tensors
from megatron_grpo.errors import CheckpointError
from megatron_grpo.models.builder import unwrap
from megatron_grpo.models.hf_config import ModelArchitecture, load_hf_config_dict

log = logging.getLogger(__name__)


def check_hf_config_matches(cfg: ModelArchitecture, hf_dir: str | Path) -> None:
    """The folder's config.json builds the same network as `cfg` (else CheckpointError)."""
    other = ModelArchitecture.from_hf(load_hf_config_dict(hf_dir)[0])
    other = ModelArchitecture.from_dict({"hf_config": other.hf_config, "padded_vocab_size": cfg.padded_vocab_size})
    diff = cfg.same_math_as(other)
    if diff:
        raise CheckpointError(f"{Path(hf_dir) / 'config.json'} does not match the model config: differs in {diff}")


def load_hf_weights(model_chunks: Sequence[torch.nn.Module], cfg: ModelArchitecture, hf_dir: str | Path,
                    progress: bool = False) -> int:
    """Copies the HF weights into every parameter of `model_chunks` (this rank's shards).
    Validates the whole folder (names, shapes, file sizes, config) first. Returns the number of
    parameters filled."""
    from megatron.core import parallel_state as ps

    check_hf_config_matches(cfg, hf_dir)
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with HFCheckpoint(hf_dir) as ckpt:
        ignored = ignored_hf_tensors(cfg, ckpt.names())
        ckpt.validate(expected_hf_tensors(cfg), ignored=ignored)
        mtp = [name for name in ignored if name not in IGNORED_WHEN_TIED]
        if mtp:
            log.info("%s: %d tensors of %d multi-token-prediction layer(s) (model.layers.%d+) not loaded: MTP is "
                     "not trained here, and export does not write them", hf_dir, len(mtp), cfg.mtp_layers,
                     cfg.num_layers)
        bound = [b for chunk in model_chunks for b in bind(unwrap(chunk), cfg)]
        iterator = bound
        if progress:
            from tqdm import tqdm
            iterator = tqdm(bound, desc="load HF weights", unit="tensor")
        with torch.no_grad():
            for item in iterator:
                shard = item.rule.transform.load_shard(ckpt, item.hf_names, cfg, tp_rank, tp_size)
                if tuple(shard.shape) != tuple(item.param.shape):
                    raise CheckpointError(f"{hf_dir}: {item.hf_names} give a shard of shape {tuple(shard.shape)} "
                                          f"for {item.megatron_name} of shape {tuple(item.param.shape)}")
                item.param.copy_(shard)
    return len(bound)
