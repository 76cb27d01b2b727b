"""rollout.engine=local: the HF engine in the trainer's process (rollout/local.py), or in a process
of its own (rollout/engine_process.py) that generates while the trainer trains; and the torch
thread counts the two processes use."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.config.derived import engine_in_own_process
from megatron_grpo.rollout.engine import RolloutEngine


def build_local_engine(cfg: Config, model_dir: Path, device: torch.device, dtype: torch.dtype) -> RolloutEngine:
    """The local engine serves in the trainer's dtype (bf16 on a GPU), as SGLang would. It records a
    MoE model's routes only when the trainer replays them (no hooks and no copies otherwise)."""
    rows = cfg.rollout.local.max_batch_size or 256
    record_routes = cfg.actor.moe_routing_replay
    if not engine_in_own_process(cfg):
        from megatron_grpo.rollout.local import LocalEngine

        return LocalEngine.from_pretrained(model_dir, device=device, dtype=dtype, seed=cfg.trainer.seed,
                                           max_batch_rows=rows, tokenizer_path=cfg.model.tokenizer_path,
                                           record_routed_experts=record_routes, fp32_lm_head=cfg.model.fp32_lm_head)
    from megatron_grpo.rollout.engine_process import EngineSpec, ProcessEngine

    output_dir = Path(cfg.logging.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    spec = EngineSpec(model_dir=str(model_dir), device=str(device), dtype=str(dtype).removeprefix("torch."),
                      seed=cfg.trainer.seed, max_batch_rows=rows, tokenizer_path=cfg.model.tokenizer_path,
                      threads=cfg.rollout.local.threads, log_path=str(output_dir / "local_engine.log"),
                      record_routed_experts=record_routes, fp32_lm_head=cfg.model.fp32_lm_head)
    return ProcessEngine(spec, bucket_bytes=cfg.rollout.weight_bucket_mb * 2**20)


def trainer_threads(cfg: Config) -> int | None:
    """trainer.num_threads, or with the local engine in its own process on CPU the cores it leaves."""
    if cfg.trainer.num_threads is not None:
        return cfg.trainer.num_threads
    if cfg.rollout.engine == "local" and engine_in_own_process(cfg) and not torch.cuda.is_available():
        return max(1, (os.cpu_count() or 1) - cfg.rollout.local.threads)
    return None
