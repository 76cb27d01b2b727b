"""train() in a test process, with what resume tests compare: the policy weights after every step
(as the rollout engine holds them: weight_sync's gather of every TP / PP shard), the weights right
after the resume, and the metrics. Run it through megatron_grpo.testing.distributed.run_distributed."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path


def train_capturing(rank, world_size, overrides, stop_after=None, resave_dir=None, signal_rank=0):
    """Runs the tiny_cpu recipe with `overrides`. Rank 0 returns {"steps": {step: weights},
    "at_resume": weights or None, "metrics": {step: record}}; other ranks None. With stop_after,
    SIGUSR1 (sent to signal_rank only: the ranks must agree) stops the run after that step
    (checkpoint, clean exit). With resave_dir, the state just resumed is saved there again, at
    this layout, by megatron dist_checkpointing."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer import loop
    from megatron_grpo.trainer.state import checkpoint

    captured = {"steps": {}, "at_resume": None}
    build_run, grpo_step, resume = loop.build_run, loop.grpo_step, loop.resume

    def engine_weights(run):
        return {k: v.detach().clone() for k, v in run.engine.model.state_dict().items()}

    def capture_run(cfg):
        captured["run"] = build_run(cfg)
        return captured["run"]

    def step_and_capture(run, step, pipeline=None, **kwargs):
        metrics = grpo_step(run, step, pipeline, **kwargs)
        if run.is_main:
            captured["steps"][step] = engine_weights(run)
        if step == stop_after and rank == signal_rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        return metrics

    def resume_and_capture(run, checkpointer):  # the engine holds the restored weights from here on
        step = resume(run, checkpointer)
        if run.is_main:
            captured["at_resume"] = engine_weights(run)
        if resave_dir is not None:
            if rank == 0:
                Path(resave_dir).mkdir(parents=True)
            dist.barrier()
            dist_checkpointing.save(checkpoint.training_sharded_state_dict(run, is_loading=False), str(resave_dir))
        return step

    loop.build_run, loop.grpo_step, loop.resume = capture_run, step_and_capture, resume_and_capture
    cfg = load_config("tiny_cpu", overrides)
    validate(cfg, world_size=world_size)
    loop.train(cfg)
    if rank != 0:
        return None
    return {"steps": captured["steps"], "at_resume": captured["at_resume"],
            "metrics": metrics_by_step(cfg.logging.output_dir)}


def metrics_by_step(out_dir) -> dict:
    """metrics.jsonl records by step (the last record of a step wins)."""
    by_step = {}
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    return by_step
