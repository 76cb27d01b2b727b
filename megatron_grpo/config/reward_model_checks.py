"""The checks of reward.models and reward.combine (config/reward_models.py): each problem is one
line naming its key, reported with the recipe's other problems (exit 2 before anything starts)."""
from __future__ import annotations

import dataclasses
import re
import string
from pathlib import Path

from megatron_grpo.config.reward_models import RULE, JudgeConfig, ModelScorerConfig, ScorerServerConfig
from megatron_grpo.config.scorer_checkpoint import scorer_folder_problem

NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")  # a metric prefix and a dotted-override key
JUDGE_FIELDS = ("prompt", "response", "ground_truth")


def reward_model_problems(models: dict[str, ModelScorerConfig], combine, environment: str | None = None) -> list[str]:
    """`environment`: rollout.multi_turn.environment, whose trajectories its own rewards score."""
    out: list[str] = []
    if models and environment is not None:
        out.append(f"reward.models with rollout.multi_turn.environment={environment!r} is not supported yet: "
                   "a multi-turn trajectory's reward is its environment's (unset reward.models)")
    for name, scorer in models.items():
        key = f"reward.models.{name}"
        if name == RULE or not NAME.match(name):
            out.append(f"{key}: a scorer's name must start with a letter and hold only letters, digits, _ and -, "
                       f"and not be {RULE!r} (reward.combine's name for reward.function)")
            continue
        out.extend(_scorer(key, scorer))
    known = {RULE, *models}
    for where, weights in (("reward.combine.weights", combine.weights),
                           *((f"reward.combine.by_data_source.{source}", w) for source, w in
                             combine.by_data_source.items())):
        for component in weights:
            if component not in known:
                out.append(f"{where}.{component}: no such component (known: {', '.join(sorted(known))}; "
                           f"{RULE!r} is reward.function)")
    if not any(combine.active(c) for c in known):
        out.append("reward.combine: every component weighs 0 for every data source: nothing would be scored")
    return out


def _scorer(key: str, s: ModelScorerConfig) -> list[str]:
    out = []
    if not s.path:
        out.append(f"{key}.path: set the model's HF folder or hub id (its tokenizer renders the samples)")
    elif (s.backend == "hf" or not s.sglang.urls) and Path(s.path).expanduser().is_dir():
        # the weights load from this folder, here or on servers launched here (a hub id's: hf_backend.py)
        problem = scorer_folder_problem(key, s.path, s.kind)
        if problem:
            out.append(problem)
    if s.build_if_missing is not None and s.kind != "reward_model":
        out.append(f"{key}.build_if_missing={s.build_if_missing} builds a reward model; this scorer is a {s.kind}")
    if s.batch_size < 1:
        out.append(f"{key}.batch_size={s.batch_size} must be >= 1")
    if not s.timeout_s > 0:
        out.append(f"{key}.timeout_s={s.timeout_s} must be > 0")
    if s.normalize != "none" and s.scale == 0:
        out.append(f"{key}.scale must not be 0 (normalize={s.normalize} divides by it)")
    if s.kind == "judge":
        out.extend(_judge(f"{key}.judge", s.judge))
    elif s.judge != JudgeConfig():
        out.append(f"{key}.judge: set only for kind=judge (this scorer is a reward_model): "
                   f"{_changed(s.judge, JudgeConfig())}")
    if s.backend == "sglang":
        out.extend(_server(f"{key}.sglang", s.sglang))
    elif s.sglang != ScorerServerConfig():
        out.append(f"{key}.sglang: set only with backend=sglang (backend is {s.backend}): "
                   f"{_changed(s.sglang, ScorerServerConfig())}")
    if s.backend == "hf" and s.dtype == "bfloat16" and s.device == "cpu":
        out.append(f"{key}.dtype=bfloat16 with device=cpu: use float32 on CPU")
    return out


def _judge(key: str, j: JudgeConfig) -> list[str]:
    out = []
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(j.template) if name is not None}
    except ValueError as exc:
        return [f"{key}.template is not a valid template ({exc}); write literal braces doubled: {{{{ }}}}"]
    if "response" not in fields:
        out.append(f"{key}.template must contain {{response}} (the judged answer)")
    unknown = sorted(fields - set(JUDGE_FIELDS))
    if unknown:
        out.append(f"{key}.template: unknown field(s) {', '.join('{' + f + '}' for f in unknown)}; the fields are "
                   f"{', '.join('{' + f + '}' for f in JUDGE_FIELDS)} (literal braces are written doubled)")
    if j.parse in ("number", "regex") and not j.min_value < j.max_value:
        out.append(f"{key}: min_value={j.min_value} must be below max_value={j.max_value}")
    if j.parse == "regex":
        if not j.regex:
            out.append(f"{key}.regex: set it for parse=regex (its first group, else its match, is the number)")
        else:
            try:
                re.compile(j.regex)
            except re.error as exc:
                out.append(f"{key}.regex={j.regex!r} does not compile: {exc}")
    elif j.regex is not None:
        out.append(f"{key}.regex is read only with parse=regex (parse is {j.parse})")
    if j.parse == "yes_no":
        if not j.yes or not j.no or j.yes == j.no:
            out.append(f"{key}: yes={j.yes!r} and no={j.no!r} must be two different non-empty tokens")
        if not 0 < j.min_yes_no_mass <= 1:
            out.append(f"{key}.min_yes_no_mass={j.min_yes_no_mass} must be in (0, 1]")
    if j.max_new_tokens < 1:
        out.append(f"{key}.max_new_tokens={j.max_new_tokens} must be >= 1")
    return out


def _server(key: str, v: ScorerServerConfig) -> list[str]:
    out = []
    if not v.urls and not v.gpus:
        out.append(f"{key}: give the servers' urls, or the gpus to launch them on")
    if v.urls and v.gpus:
        out.append(f"{key}: urls and gpus both set: servers are either given (urls) or launched (gpus)")
    if v.tp_size < 1:
        out.append(f"{key}.tp_size={v.tp_size} must be >= 1")
    elif v.gpus and len(v.gpus) % v.tp_size:
        out.append(f"{key}.gpus: {len(v.gpus)} GPUs do not split into servers of tp_size={v.tp_size}")
    if len(set(v.gpus)) != len(v.gpus) or any(g < 0 for g in v.gpus):
        out.append(f"{key}.gpus={v.gpus} must be distinct GPU indices >= 0")
    if v.cpu_threads < 1:
        out.append(f"{key}.cpu_threads={v.cpu_threads} must be >= 1 (OpenMP threads of a CPU server)")
    if v.max_total_tokens is not None and v.max_total_tokens < 1:
        out.append(f"{key}.max_total_tokens={v.max_total_tokens} must be >= 1 (tokens of the KV cache)")
    for name in ("max_concurrency", "max_retries"):
        if getattr(v, name) < 1:
            out.append(f"{key}.{name}={getattr(v, name)} must be >= 1")
    if not v.startup_timeout_s > 0:
        out.append(f"{key}.startup_timeout_s={v.startup_timeout_s} must be > 0")
    if not 0 < v.mem_fraction <= 1:
        out.append(f"{key}.mem_fraction={v.mem_fraction} must be in (0, 1]")
    return out


def _changed(value, default) -> str:
    return ", ".join(f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
                     if getattr(value, f.name) != getattr(default, f.name))
