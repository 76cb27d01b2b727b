"""The run's prompts, encoded: data.train_files / data.val_files, or the synthetic task's splits."""
from __future__ import annotations

import dataclasses
import functools

from megatron_grpo.config.reward_models import RULE
from megatron_grpo.config.schema import Config
from megatron_grpo.config.validate import training_data_problem
from megatron_grpo.data.prompts import EncodedPrompt
from megatron_grpo.data.records import RecordFormat
from megatron_grpo.errors import ConfigError

SYNTHETIC_TRAIN_RECORDS, SYNTHETIC_EVAL_RECORDS = 4096, 128
# data.truncation -> data.prompts.encode_prompts' policy for over-long prompts
OVERLONG = {"error": "error", "left": "truncate_left", "right": "truncate_right", "filter": "filter"}
# Built-in reward functions that compare one answer (a list or object ground truth would score 0).
SCALAR_ANSWER_SCORERS = frozenset({"gsm8k", "math", "by_data_source"})


def load_prompts(cfg: Config, tokenizer) -> tuple[list[EncodedPrompt], list[EncodedPrompt] | None]:
    """Encoded train and eval prompts (eval: None without validation data)."""
    from megatron_grpo.data.io import load_records
    from megatron_grpo.data.prompts import encode_prompts
    from megatron_grpo.rewards.answers import ground_truth_problem

    problem = training_data_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.data.task:
        from megatron_grpo.data.synthetic import SyntheticTaskConfig, generate_records

        task = SyntheticTaskConfig(**_synthetic_kwargs(cfg))
        train_records = generate_records(task, count=SYNTHETIC_TRAIN_RECORDS, seed=cfg.trainer.seed, split="train")
        eval_records = generate_records(task, count=SYNTHETIC_EVAL_RECORDS, seed=cfg.trainer.seed + 1, split="test")
    else:
        scorer = one_answer_scorer(cfg)
        fmt = RecordFormat(prompt_key=cfg.data.prompt_key, reward_fn_key=cfg.data.reward_fn_key,
                           scalar_ground_truth_for=scorer,
                           ground_truth_problem=functools.partial(ground_truth_problem, scorer) if scorer else None)
        train_records = [r for path in cfg.data.train_files for r in load_records(path, fmt)]
        eval_records = [r for path in cfg.data.val_files for r in load_records(path, fmt)] or None
    overlong = OVERLONG[cfg.data.truncation]
    train, _ = encode_prompts(train_records, tokenizer, cfg.data.max_prompt_length, overlong,
                              cfg.data.chat_template, source="train")
    evals = None
    if eval_records:
        evals, _ = encode_prompts(eval_records, tokenizer, cfg.data.max_prompt_length, overlong,
                                  cfg.data.chat_template, source="eval")
    return train, evals


def one_answer_scorer(cfg: Config) -> str | None:
    """reward.function when it is a built-in scorer of one answer and scores the rows: with an
    environment (rollout.multi_turn) the environment scores them, and reward.combine may give the
    rule weight 0 everywhere (then it is not built). None: the rows' ground truths are not checked."""
    r = cfg.reward
    if r.function not in SCALAR_ANSWER_SCORERS or cfg.rollout.multi_turn.environment is not None:
        return None
    return r.function if not r.models or r.combine.active(RULE) else None


def _synthetic_kwargs(cfg: Config) -> dict:
    from megatron_grpo.data.synthetic import SyntheticTaskConfig

    names = {f.name for f in dataclasses.fields(SyntheticTaskConfig)}
    kwargs = dict(cfg.data.task_kwargs)
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ConfigError(f"data.task_kwargs: unknown keys {unknown}; valid: {sorted(names - {'task'})}")
    return {"task": cfg.data.task, **kwargs}
