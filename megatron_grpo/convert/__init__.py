"""Megatron <-> HF weights: mapping tables, HF safetensors I/O, streaming export, checkpoints.

The only package that knows HF parameter names."""
from megatron_grpo.convert.export import export_hf_weights, gather_hf_weights_on_rank0
from megatron_grpo.convert.hf_io import HFCheckpoint
from megatron_grpo.convert.loader import check_hf_config_matches, load_hf_weights
from megatron_grpo.convert.mappings import MAPPINGS, expected_hf_tensors
from megatron_grpo.convert.megatron_checkpoint import (load_megatron_checkpoint, load_model_weights,
                                                       save_megatron_checkpoint)
from megatron_grpo.convert.sources import MegatronSource, resolve_source
from megatron_grpo.convert.to_hf import export_checkpoint_to_hf, write_hf_export
from megatron_grpo.convert.writer import HFWriter, copy_hf_assets

__all__ = ["export_hf_weights", "gather_hf_weights_on_rank0", "HFCheckpoint", "check_hf_config_matches",
           "load_hf_weights", "MAPPINGS", "expected_hf_tensors", "load_megatron_checkpoint",
           "save_megatron_checkpoint", "load_model_weights", "MegatronSource", "resolve_source",
           "export_checkpoint_to_hf", "write_hf_export", "HFWriter", "copy_hf_assets"]
