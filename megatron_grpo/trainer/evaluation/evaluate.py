"""Eval on the validation prompts: pass@1 (greedy or sampled) and pass@k (unbiased estimator).
With an environment (rollout.multi_turn) every sample is an episode, as in training."""
from __future__ import annotations

import dataclasses
import math

from megatron_grpo.launch.cpu import cuda_redirect_paused
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.trainer.rollouts.multi_turn import multi_turn_settings, multi_turn_stats, run_multi_turn
from megatron_grpo.trainer.rollouts.rollout_phase import reward_request


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples include a correct one."""
    if k > num_samples:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(run) -> dict[str, float]:
    """Rank 0: generates for every eval prompt and scores; a response (or trajectory) is correct
    when its reward is >= 1 (full credit)."""
    cfg = run.config
    if not run.eval_prompts:
        return {}
    e = cfg.eval
    sampling = SamplingParams(n=e.n_samples, temperature=0.0 if e.greedy else e.temperature,
                              max_new_tokens=cfg.rollout.max_new_tokens or cfg.data.max_response_length,
                              stop=tuple(cfg.rollout.stop), stop_token_ids=tuple(cfg.rollout.stop_token_ids),
                              seed=cfg.trainer.seed)
    prompts = run.eval_prompts
    multi_turn = multi_turn_settings(cfg)
    if multi_turn is not None:  # episodes, as in training; a trajectory's reward is its environment's
        trajectories, samples = run_multi_turn(run.engine, prompts, run.tokenizer, multi_turn,
                                               dataclasses.replace(sampling, n=1), e.n_samples, "eval",
                                               seed_of=lambda group: cfg.trainer.seed * 1_000_003 + group)
        scores = [t.reward(multi_turn.limits) for t in trajectories]
        metrics = {f"eval/{name}": value for name, value in multi_turn_stats(trajectories).items()}
    else:
        requests = [GenerationRequest(prompt_ids=p.input_ids, sampling=sampling, group_id=str(i))
                    for i, p in enumerate(prompts)]
        with cuda_redirect_paused():
            samples = run.engine.generate(requests)
        # the same request as in training (data_source in `extra`), so a reward scores eval rows alike
        scores = run.rewards.score([reward_request(s, prompts[int(s.group_id)], run.tokenizer)
                                    for s in samples]).scores
        metrics = {}
    correct: dict[str, int] = {}
    for sample, score in zip(samples, scores):
        correct[sample.group_id] = correct.get(sample.group_id, 0) + (score >= 1.0)
    metrics["eval/reward_mean"] = sum(scores) / len(scores)
    for k in sorted(set([1, *e.pass_k])):
        if k <= e.n_samples:
            metrics[f"eval/pass@{k}"] = sum(pass_at_k(e.n_samples, c, k) for c in correct.values()) / len(correct)
    return metrics
