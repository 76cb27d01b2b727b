"""model.lora: adapters on the loaded policy (lora/attach.py), from a PEFT folder when the recipe names one."""
from __future__ import annotations

import logging

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.models.hf_config import ModelArchitecture

log = logging.getLogger(__name__)


def add_policy_adapters(chunks: list[torch.nn.Module], cfg: Config, model_config: ModelArchitecture) -> None:
    """Before the chunks are wrapped for DDP: the adapters become the only trainable parameters."""
    from megatron_grpo.lora.attach import LoraSettings, attach_adapters, trainable_parameter_count
    from megatron_grpo.lora.peft_folder import load_adapter_folder
    from megatron_grpo.lora.targets import expand_targets

    lora = cfg.model.lora
    attach_adapters(chunks, model_config, LoraSettings(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                                       target_modules=expand_targets(lora.target_modules),
                                                       seed=cfg.trainer.seed))
    if lora.adapter_path is not None:
        load_adapter_folder(chunks, lora.adapter_path)
    if torch.distributed.get_rank() == 0:
        frozen = sum(p.numel() for c in chunks for p in c.parameters() if not p.requires_grad)
        log.info("LoRA rank %d on %s: %d trainable parameters on rank 0, %d frozen%s", lora.rank,
                 ", ".join(expand_targets(lora.target_modules)), trainable_parameter_count(chunks), frozen,
                 f"; adapters from {lora.adapter_path}" if lora.adapter_path else "")
