"""Eval on the validation prompts: pass@1 (greedy or sampled) and pass@k (unbiased estimator)."""
from __future__ import annotations

import math

from megatron_grpo.launch.cpu import cuda_redirect_paused
from megatron_grpo.rollout.types import GenerationRequest, SamplingParams
from megatron_grpo.trainer.rollout_phase import reward_request


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
    result = run.rewards.score([reward_request(s, prompts[int(s.group_id)], run.tokenizer) for s in samples])
    correct: dict[str, int] = {}
    for sample, score in zip(samples, result.scores):
        correct[sample.group_id] = correct.get(sample.group_id, 0) + (score >= 1.0)
    metrics = {"eval/reward_mean": sum(result.scores) / len(result.scores)}
    for k in sorted(set([1, *e.pass_k])):
        if k <= e.n_samples:
            metrics[f"eval/pass@{k}"] = sum(pass_at_k(e.n_samples, c, k) for c in correct.values()) / len(correct)
    return metrics
