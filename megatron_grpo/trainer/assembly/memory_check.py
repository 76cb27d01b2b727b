"""Refuse a layout that cannot fit before any GPU work: the trainer runs `megatron-grpo plan` for
its own recipe, world size and GPU memory (trainer.memory_plan), once per recipe and layout.

The plan runs in a child process: it needs a process without torch.distributed (its fake process
group stands for this job). Its figures are cached under $MEGATRON_GRPO_CACHE (default
~/.cache/megatron-grpo)/plans/<hash of the resolved recipe, world size, GPU memory and versions>.json,
so a restart or a second run of the same layout does not simulate again."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_grpo.config import to_yaml
from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError, LaunchError


def cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_GRPO_CACHE", Path.home() / ".cache" / "megatron-grpo")) / "plans"


def plan_key(cfg: Config, world_size: int, gpu_memory_gib: float) -> str:
    import megatron.core
    import torch

    from megatron_grpo import __version__

    text = "\n".join([to_yaml(cfg), str(world_size), f"{gpu_memory_gib:.3f}", __version__, torch.__version__,
                      getattr(megatron.core, "__version__", "?")])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def check_memory_plan(cfg: Config, world_size: int, gpu_memory_gib: float) -> dict:
    """The plan's summary for this job (cached); ConfigError with its one line when it does not fit."""
    cache = cache_dir() / f"{plan_key(cfg, world_size, gpu_memory_gib)}.json"
    if not cache.is_file():
        _run_plan(cfg, world_size, gpu_memory_gib, cache)
    summary = json.loads(cache.read_text(encoding="utf-8"))
    if not summary["fits"]:
        raise ConfigError(f"memory plan ({world_size} GPUs of {gpu_memory_gib:.1f} GiB; trainer.memory_plan=false "
                          f"skips it): {summary['verdict']}")
    return summary


def _run_plan(cfg: Config, world_size: int, gpu_memory_gib: float, cache: Path) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    out = cache.parent / f".{cache.name}.{os.getpid()}.tmp"
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "recipe.yaml"
        recipe.write_text(to_yaml(cfg), encoding="utf-8")
        command = [sys.executable, "-m", "megatron_grpo.cli", "plan", str(recipe), "--trainer-gpus", str(world_size),
                   "--gpu-memory-gb", f"{gpu_memory_gib:.3f}", "--json", str(out)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode not in (0, 2) or not out.is_file():
            raise LaunchError(f"the memory plan failed (exit {done.returncode}); set trainer.memory_plan=false to "
                              f"train without it. Its output ends:\n{done.stderr[-2000:]}")
        os.replace(out, cache)  # atomic: a half-written plan is never read
