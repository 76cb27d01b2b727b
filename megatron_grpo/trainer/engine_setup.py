"""The recipe's rollout engine: the in-process HF engine (rollout.engine=local), or SGLang servers
(rollout.engine=sglang, trainer/sglang_setup.py). Built on global rank 0 only."""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.rollout.engine import RolloutEngine


def build_engine(cfg: Config, model_dir: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> RolloutEngine:
    """The local engine serves in the trainer's dtype (bf16 on a GPU), as SGLang would."""
    if cfg.rollout.engine == "local":
        from megatron_grpo.rollout.local import LocalEngine

        rows = cfg.rollout.local.max_batch_size or 256
        return LocalEngine.from_pretrained(model_dir, device=device, dtype=dtype, seed=cfg.trainer.seed,
                                           max_batch_rows=rows, tokenizer_path=cfg.model.tokenizer_path)
    from megatron_grpo.trainer.sglang_setup import build_sglang_engine

    return build_sglang_engine(cfg, model_dir, Path(cfg.logging.output_dir))
