"""`megatron-grpo eval RECIPE [overrides]`: a run's checkpoint evaluated on its validation prompts
(the metrics: trainer/evaluation/evaluate.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path


def main(argv=None) -> int:
    """`megatron-grpo eval RECIPE [overrides]`: loads the run's checkpoint (checkpoint.resume: auto =
    the newest complete one of the run, or a path) and evaluates it on data.val_files (or the
    synthetic task's test split). Writes <output_dir>/eval/step_N.json and prints the metrics."""
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.errors import CheckpointError
    from megatron_grpo.launch.env import discover_ranks
    from megatron_grpo.launch.mcore_compat import quiet_known_notices

    parser = argparse.ArgumentParser(prog="megatron-grpo eval", description=main.__doc__)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    validate(cfg, world_size=discover_ranks(os.environ).world_size)
    if cfg.checkpoint.resume.strip() == "never":
        raise CheckpointError("megatron-grpo eval needs a checkpoint: checkpoint.resume=auto or a path")
    from megatron_grpo.checkpointing.layout import checkpoint_root, complete_checkpoints

    if not complete_checkpoints(cfg):  # before any model is built
        raise CheckpointError(f"no complete checkpoint under {checkpoint_root(cfg)} to evaluate: train with "
                              "checkpoint.save_interval=N (at -1, a recipe's default, a run saves only when a "
                              "signal stops it), or set checkpoint.resume=PATH")
    quiet_known_notices()

    from megatron_grpo.launch.distributed import shutdown

    try:  # as in training: no gloo worker may still be releasing a collective at exit
        step, metrics, is_main = _evaluate_checkpoint(cfg)
    except BaseException:
        shutdown(failed=True)
        raise
    shutdown()
    if is_main:
        out = Path(cfg.logging.output_dir) / "eval"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"step_{step}.json").write_text(json.dumps({"step": step, **metrics}, indent=2) + "\n")
        print(json.dumps({"step": step, **metrics}), flush=True)
    return 0


def _evaluate_checkpoint(cfg) -> tuple[int, dict[str, float], bool]:
    from megatron_grpo.checkpointing.layout import checkpoint_root
    from megatron_grpo.errors import CheckpointError
    from megatron_grpo.trainer.state.checkpoint import Checkpointer
    from megatron_grpo.trainer.loop import evaluate_policy
    from megatron_grpo.trainer.state.resume import resume
    from megatron_grpo.trainer.setup import build_run

    # Evaluate in a folder of its own: resuming must not touch the training run's metrics.
    cfg = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save_dir=str(checkpoint_root(cfg))),
        logging=dataclasses.replace(cfg.logging, output_dir=str(Path(cfg.logging.output_dir) / "eval")))
    run = build_run(cfg, hold_folder=False)  # reads the run's checkpoints, also while it trains
    try:
        step = resume(run, Checkpointer(run))
        if step == 0:
            raise CheckpointError(f"no complete checkpoint under {cfg.checkpoint.save_dir}")
        return step, evaluate_policy(run), run.is_main
    finally:
        run.close()
