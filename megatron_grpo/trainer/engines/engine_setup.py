"""The recipe's rollout engine: the in-process HF engine (rollout.engine=local), or SGLang servers
(rollout.engine=sglang, trainer/engines/sglang_setup.py). Built on global rank 0 only."""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.rollout.engine import RolloutEngine


def build_engine(cfg: Config, model_dir: Path, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> RolloutEngine:
    """Engines serve in the trainer's dtype (bf16 on a GPU): the local one, and SGLang servers launched here."""
    if cfg.rollout.engine == "local":  # in the trainer's process or its own (trainer/engines/local_engine.py)
        from megatron_grpo.trainer.engines.local_engine import build_local_engine

        return build_local_engine(cfg, model_dir, device, dtype)
    from megatron_grpo.trainer.engines.sglang_setup import build_sglang_engine

    return build_sglang_engine(cfg, model_dir, Path(cfg.logging.output_dir), dtype)
