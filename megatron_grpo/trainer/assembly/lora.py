"""model.lora: the adapter folder a recipe starts from, checked before any model is built, and the adapters on
the loaded policy (lora/attach.py)."""
from __future__ import annotations

import logging

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError
from megatron_grpo.models.hf_config import ModelArchitecture

log = logging.getLogger(__name__)


def check_adapter_folder(cfg: Config) -> None:
    """model.lora.adapter_path is a PEFT LoRA folder with the recipe's rank, alpha and target modules (one
    ConfigError naming the folder and the key otherwise)."""
    from megatron_grpo.lora.peft_folder import ADAPTER_CONFIG, read_adapter_config
    from megatron_grpo.lora.targets import expand_targets

    lora = cfg.model.lora
    try:
        folder = read_adapter_config(lora.adapter_path)
    except ConfigError as exc:
        raise ConfigError(f"model.lora.adapter_path: {exc}") from None
    where = f"model.lora.adapter_path={lora.adapter_path} ({ADAPTER_CONFIG})"
    wanted = expand_targets(lora.target_modules)
    for what, theirs, ours in (("r", folder.rank, lora.rank), ("lora_alpha", folder.alpha, lora.alpha),
                               ("target_modules", list(folder.target_modules), list(wanted))):
        if theirs != ours:
            raise ConfigError(f"{where}: {what}={theirs} but the recipe's model.lora says {ours}")


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
