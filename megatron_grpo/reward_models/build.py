"""The run's reward from the recipe: reward.function alone (a RewardRunner, as before reward.models
existed), or CombinedRewards of it and the model scorers of reward.models, each with its backend:
in-process transformers, SGLang servers by URL, or SGLang servers launched here on its GPUs."""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from megatron_grpo.config.model_paths import missing_local_path
from megatron_grpo.config.reward_models import RULE, ModelScorerConfig
from megatron_grpo.errors import ConfigError
from megatron_grpo.reward_models.render import ChatRenderer
from megatron_grpo.reward_models.scorers import JudgeScorer, RewardModelScorer
from megatron_grpo.rewards.combined import CombinedRewards
from megatron_grpo.rewards.runner import RewardRunner

log = logging.getLogger(__name__)

RM_SERVER_SEED = 0  # --random-seed of every reward-model server launched here (launch_servers)
BUILD_RECORD = "built_by.json"  # in a folder build_if_missing made: what made it and how well it scores


def build_rewards(reward, log_dir: str | Path):
    """`reward`: the recipe's reward section. Launched servers log under log_dir/<name>."""
    rule = None
    if not reward.models or reward.combine.active(RULE):
        rule = RewardRunner(reward.function, num_workers=reward.num_workers,
                            timeout_s=reward.timeout_s,  # in-process calls too (rewards/runner.py)
                            kwargs=dict(reward.kwargs), signature=reward.signature,
                            max_error_frac=reward.max_error_frac)
    if not reward.models:
        return rule
    scorers = []
    try:
        for name, cfg in reward.models.items():
            if reward.combine.active(name):
                scorers.append(build_scorer(name, cfg, Path(log_dir) / name))
    except BaseException:
        for scorer in scorers:
            scorer.close()
        if rule is not None:
            rule.close()
        raise
    return CombinedRewards(rule, scorers, reward.combine.weight, reward.max_error_frac)


def build_scorer(name: str, cfg: ModelScorerConfig, log_dir: Path):
    from transformers import AutoTokenizer

    key = f"reward.models.{name}"
    build_if_missing(key, cfg)
    missing = missing_local_path(f"{key}.path", cfg.path)
    if missing:  # not sent to the hub: its retries take a minute before they fail
        raise ConfigError(missing)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.path)
    except (OSError, ValueError) as exc:  # not a folder here, and not a hub id this machine can fetch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{key}.path={cfg.path!r}: cannot load the model's tokenizer ({first})") from None
    renderer = ChatRenderer(tokenizer, cfg.chat_template, key)
    if cfg.backend == "hf":
        from megatron_grpo.reward_models.hf_backend import HFBackend

        backend = HFBackend(cfg.path, cfg.kind, cfg.device, cfg.dtype, key, tokenizer=tokenizer)
    else:
        backend = sglang_backend(key, cfg, log_dir)
    try:
        scorer_class = RewardModelScorer if cfg.kind == "reward_model" else JudgeScorer
        return scorer_class(name, cfg, backend, renderer)
    except BaseException:
        backend.close()
        raise


def build_if_missing(key: str, cfg: ModelScorerConfig) -> None:
    """`build_if_missing`: makes the folder `cfg.path` when it does not exist. Written beside it and
    renamed into place, so an interrupted build leaves no half folder that would pass for the model."""
    from megatron_grpo.reward_models.tiny_rm import train_tiny_reward_model

    target = Path(cfg.path).expanduser()
    if cfg.build_if_missing is None or target.exists():
        return
    log.info("%s.path=%s does not exist: building it (%s.build_if_missing=%s, deterministic, ~10 s)", key, cfg.path,
             key, cfg.build_if_missing)
    started = time.perf_counter()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted earlier build
    partial.parent.mkdir(parents=True, exist_ok=True)
    rm = train_tiny_reward_model(partial)
    record = {"build_if_missing": cfg.build_if_missing, "heldout_accuracy": rm.heldout_accuracy, "margin": rm.margin}
    (partial / BUILD_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    partial.rename(target)
    log.info("%s: built %s in %.1f s (held-out pairs ordered right: %.3f)", key, target, time.perf_counter() - started,
             rm.heldout_accuracy)


def sglang_backend(key: str, cfg: ModelScorerConfig, log_dir: Path):
    from megatron_grpo.reward_models.sglang_backend import SGLangBackend

    s = cfg.sglang
    api_key = None
    if s.api_key_env:
        api_key = os.environ.get(s.api_key_env)
        if not api_key:
            raise ConfigError(f"{key}.sglang.api_key_env={s.api_key_env}: that environment variable is not set")
    launcher = launch_servers(key, cfg, api_key, log_dir) if not s.urls else None
    urls = s.urls or [server.url for server in launcher.servers]
    backend = SGLangBackend(urls, key=key, timeout_s=cfg.timeout_s, max_retries=s.max_retries,
                            max_concurrency=s.max_concurrency, api_key=api_key, launcher=launcher)
    try:
        backend.check(want_generation=cfg.kind == "judge")
    except BaseException:
        backend.close()
        raise
    return backend


def launch_servers(key: str, cfg: ModelScorerConfig, api_key: str | None, log_dir: Path):
    """One server per tp_size GPUs of sglang.gpus (on device=cpu: per tp_size entries), on this node,
    waited on until each serves."""
    from megatron_grpo.config.reward_models import CPU_SCORER_KV_TOKENS
    from megatron_grpo.rollout.sglang.launcher import ServerSettings, SGLangLauncher

    s = cfg.sglang
    command = tuple(s.launch_command) or (sys.executable, "-m", "sglang.launch_server")
    # SGLang's classification path; one seed for every server: a head tensor the checkpoint lacks (Qwen2 /
    # Qwen3's score bias) keeps its random initialisation, drawn from --random-seed (random when unset)
    flags = ("--is-embedding", "--random-seed", str(RM_SERVER_SEED)) if cfg.kind == "reward_model" else ()
    on_cpu = s.device == "cpu"
    kv_tokens = s.max_total_tokens or (CPU_SCORER_KV_TOKENS if on_cpu else None)
    servers = [ServerSettings(model_path=str(cfg.path), tp_size=s.tp_size, mem_fraction_static=s.mem_fraction,
                              port=s.port + i, api_key=api_key, base_gpu_id=None if on_cpu else s.gpus[i * s.tp_size],
                              device=s.device, cpu_threads=s.cpu_threads, max_total_tokens=kv_tokens,
                              extra_args=(*flags, *s.extra_args), command=command)
               for i in range(len(s.gpus) // s.tp_size)]
    launcher = SGLangLauncher(servers=servers, log_dir=log_dir)
    launcher.start()
    try:
        launcher.wait_healthy(timeout_s=s.startup_timeout_s)
    except BaseException:
        launcher.shutdown(grace_s=5)
        raise
    return launcher
