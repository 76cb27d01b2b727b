"""HF config -> megatron-core GPTModel (see builder.py)."""
from megatron_grpo.models.architectures import ARCHITECTURES, ArchitectureSpec
from megatron_grpo.models.builder import (build_model, build_reference_model, current_layout, transformer_config,
                                          unwrap)
from megatron_grpo.models.hf_config import MODEL_CONFIG_FILE, Llama3RopeScaling, ModelArchitecture, load_hf_config_dict

__all__ = ["ARCHITECTURES", "ArchitectureSpec", "ModelArchitecture", "Llama3RopeScaling", "MODEL_CONFIG_FILE",
           "build_model", "build_reference_model", "current_layout", "transformer_config", "unwrap",
           "load_hf_config_dict"]
