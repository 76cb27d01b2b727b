"""Eval on the validation prompts: pass@1 (greedy or sampled) and pass@k (unbiased estimator)."""
from __future__ import annotations

import math

from megatron_grpo.launch.cpu import cuda_redirect_paused
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.trainer.rollout_phase import _reward_request


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples include a correct one."""
    if k > num_samples:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(run) -> dict[str, float]:
    """Rank 0: generates for every eval prompt and scores; a response is correct when its
    reward is >= 1 (full credit)."""
    cfg = run.config
    if not run.eval_prompts:
        return {}
    e = cfg.eval
    sampling = SamplingParams(n=e.n_samples, temperature=0.0 if e.greedy else e.temperature,
                              max_new_tokens=cfg.rollout.max_new_tokens or cfg.data.max_response_length,
                              stop=tuple(cfg.rollout.stop), stop_token_ids=tuple(cfg.rollout.stop_token_ids),
                              seed=cfg.trainer.seed)
    prompts = run.eval_prompts
    requests = [GenerationRequest(prompt_ids=p.input_ids, sampling=sampling, group_id=str(i))
                for i, p in enumerate(prompts)]
    with cuda_redirect_paused():
        samples = run.engine.generate(requests)
    # the same request as in training (data_source in `extra`), so a reward scores eval rows alike
    result = run.rewards.score([_reward_request(s, prompts[int(s.group_id)], run.tokenizer) for s in samples])
    correct: dict[str, int] = {}
    for sample, score in zip(samples, result.scores):
        correct[sample.group_id] = correct.get(sample.group_id, 0) + (score >= 1.0)
    metrics = {"eval/reward_mean": sum(result.scores) / len(result.scores)}
    for k in sorted(set([1, *e.pass_k])):
        if k <= e.n_samples:
            metrics[f"eval/pass@{k}"] = sum(pass_at_k(e.n_samples, c, k) for c in correct.values()) / len(correct)
    return metrics


def main(argv=None) -> int:
    """`megatron-grpo eval RECIPE [overrides]`: loads the run's checkpoint (checkpoint.resume: auto =
    the newest complete one of the run, or a path) and evaluates it on data.val_files (or the
    synthetic task's test split). Writes <output_dir>/eval/step_N.json and prints the metrics."""
    import argparse
    import dataclasses
    import json
    import os
    from pathlib import Path

    from megatron_grpo.config import load_config, validate
    from megatron_grpo.errors import CheckpointError
    from megatron_grpo.launch.env import discover_ranks

    parser = argparse.ArgumentParser(prog="megatron-grpo eval", description=main.__doc__)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    validate(cfg, world_size=discover_ranks(os.environ).world_size)
    if cfg.checkpoint.resume.strip() == "never":
        raise CheckpointError("megatron-grpo eval needs a checkpoint: checkpoint.resume=auto or a path")

    import torch.distributed as dist

    from megatron_grpo.trainer.checkpoint import Checkpointer, checkpoint_root
    from megatron_grpo.trainer.loop import evaluate_policy
    from megatron_grpo.trainer.setup import build_run

    out = Path(cfg.logging.output_dir) / "eval"
    # Evaluate in a folder of its own: resuming must not touch the training run's metrics.
    cfg = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save_dir=str(checkpoint_root(cfg))),
        logging=dataclasses.replace(cfg.logging, output_dir=str(out)))
    run = build_run(cfg)
    try:
        step = Checkpointer(run).resume()
        if step == 0:
            raise CheckpointError(f"no complete checkpoint under {cfg.checkpoint.save_dir}")
        metrics = evaluate_policy(run)
    finally:
        run.close()
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"step_{step}.json").write_text(json.dumps({"step": step, **metrics}, indent=2) + "\n")
        print(json.dumps({"step": step, **metrics}), flush=True)
    return 0
