"""Builds what a run needs from the recipe: process groups, policy (+ optimizer), optional reference
model, rollout engine, reward runner, prompts. The recipe -> argument mapping lives here, so the
modules below take plain typed arguments."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError, DataError, MegatronGRPOError
from megatron_grpo.launch.distributed import broadcast_from_rank0

log = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything the loop touches. Engine, rewards and prompts exist on global rank 0 only."""

    config: Config
    device: torch.device
    dtype: torch.dtype
    model_config: Any            # models.ModelConfig
    model_dir: Path              # HF folder the policy started from (also the engine's)
    policy: list                 # DDP-wrapped model chunks
    optimizer: Any
    scheduler: Any
    reference: list | None       # frozen chunks, or None when no KL term needs them
    tokenizer: Any
    engine: Any = None
    rewards: Any = None
    sampler: Any = None
    eval_prompts: list | None = None
    total_steps: int = 0
    record: dict | None = None   # what defines the run (run_folder.run_record), saved with each checkpoint
    resume_plan: list = field(default_factory=list)  # checked checkpoints, best first (resume_plan.py)

    @property
    def is_main(self) -> bool:
        return dist.get_rank() == 0

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
        if self.engine is not None:
            self.engine.close()


# Recipe keys the schema knows but the trainer does not act on yet. Setting one away from its
# default stops the run (exit 2) instead of being silently ignored.
NOT_YET_WIRED = (
    "model.transformer_impl", "model.trust_remote_code", "data.prompt_key", "data.apply_chat_template",
    "algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef",
    "algorithm.filter_groups.metric", "actor.shuffle", "ref.max_tokens_per_micro_batch",
    "reward.format_score", "checkpoint.async_save", "logging.log_interval", "logging.wandb_entity",
    "logging.wandb_mode", "eval.val_batch_size",
)


def reject_unwired_settings(cfg: Config) -> None:
    defaults = Config()
    changed = []
    for key in NOT_YET_WIRED:
        value, default = cfg, defaults
        for part in key.split("."):
            value, default = getattr(value, part), getattr(default, part)
        if value != default:
            changed.append(f"{key}={value!r} (default {default!r})")
    if changed:
        raise ConfigError("not implemented in the trainer yet, set back to the default: " + "; ".join(changed))


def kl_reference_needed(cfg: Config) -> bool:
    """The reference model is built and run only when a KL term can be non-zero."""
    kl_loss = cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef != 0
    kl_reward = cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_ctrl.kl_coef != 0
    return kl_loss or kl_reward


def old_logprobs_needed(cfg: Config) -> bool:
    """With exactly one on-policy update per rollout (one epoch, one mini-batch) old == current."""
    return cfg.actor.ppo_epochs > 1 or cfg.actor.ppo_mini_batch_size < cfg.data.train_batch_size


def resolve_device(cfg: Config) -> tuple[torch.device, torch.dtype]:
    want = cfg.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but torch.cuda.is_available() is False")
    cuda = torch.cuda.is_available() and want != "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype_name = cfg.model.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if cuda else "float32"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype_name)
    if dtype is None:
        raise ConfigError(f"model.dtype={dtype_name}: expected float32 or bfloat16")
    return device, dtype


def build_run(cfg: Config) -> Run:
    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.launch import ParallelLayout, init_distributed, initialize_model_parallel
    from megatron_grpo.models import ModelConfig, build_model, build_reference_model
    from megatron_grpo.models.builder import Recompute
    from megatron_grpo.trainer.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.run_folder import run_record
    from megatron_grpo.trainer.signals import NonFiniteUpdateGuard

    reject_unwired_settings(cfg)
    init_distributed()
    layout = ParallelLayout(tensor=cfg.parallel.tensor, pipeline=cfg.parallel.pipeline,
                            virtual_pipeline=cfg.parallel.virtual_pipeline, context=cfg.parallel.context,
                            sequence_parallel=cfg.parallel.sequence_parallel)
    initialize_model_parallel(layout, seed=cfg.trainer.seed)
    device, dtype = resolve_device(cfg)
    output_dir = Path(cfg.logging.output_dir)
    # The folder's rules and the definitions of the checkpoints a resume may load, before
    # initial_model/ is (re)built; every check of a resume happens before the policy is built.
    candidates = on_rank0(check_run_folder, cfg)

    model_dir = prepare_model_folder(cfg, output_dir)
    model_config = ModelConfig.from_hf(model_dir, tensor_parallel=layout.tensor,
                                       vocab_multiple=cfg.model.make_vocab_size_divisible_by)
    check_context_length(cfg, model_config, model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_dir)
    prompts = _load_prompts_checked(cfg, tokenizer)  # data errors stop every rank before any model is built
    record = run_record(cfg, model_config)
    resume_plan = on_rank0(check_resume, cfg, candidates, record, prompts)
    recompute = Recompute(granularity=None if cfg.model.recompute_granularity == "none" else cfg.model.recompute_granularity,
                          method=cfg.model.recompute_method, num_layers=cfg.model.recompute_num_layers)
    chunks = build_model(model_config, layout, dtype=dtype, recompute=recompute)
    load_hf_weights(chunks, model_config, model_dir)
    for chunk in chunks:
        chunk.to(device)
    policy = wrap_with_ddp(chunks, cfg.parallel.use_distributed_optimizer)
    total_steps = cfg.trainer.total_steps or 1
    optim = cfg.actor.optim
    optimizer, scheduler = build_optimizer(policy, OptimizerSettings(
        lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
        eps=optim.eps, grad_clip=cfg.actor.grad_clip or 0.0, warmup_steps=optim.lr_warmup_steps,
        scheduler=optim.lr_scheduler, total_steps=total_steps,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer, bf16=dtype == torch.bfloat16))
    # Skips updates whose gradient norm is NaN / Inf; stops after max_consecutive_nan_steps in a row.
    optimizer = NonFiniteUpdateGuard(optimizer, limit=cfg.trainer.max_consecutive_nan_steps)

    reference = None
    if kl_reference_needed(cfg):
        reference = build_reference_model(model_config, layout, dtype=dtype)
        load_hf_weights(reference, model_config, cfg.ref.model_path or model_dir)
        if not cfg.ref.param_offload:  # offloaded: stays on the CPU, moved in only for its pass
            for chunk in reference:
                chunk.to(device)

    run = Run(config=cfg, device=device, dtype=dtype, model_config=model_config, model_dir=model_dir,
              policy=policy, optimizer=optimizer, scheduler=scheduler, reference=reference, tokenizer=tokenizer,
              record=record, resume_plan=resume_plan)
    if run.is_main:
        _build_rank0_parts(run, prompts)
    run.total_steps = int(broadcast_from_rank0(run.total_steps))
    return run


def on_rank0(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on global rank 0; every rank returns its result, or raises its project error."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn(*args)
        except MegatronGRPOError as exc:
            error = exc
    result, error = broadcast_from_rank0((result, error))
    if error is not None:
        raise error
    return result


def check_run_folder(cfg: Config) -> list:
    """Rank 0: run_folder's rules for logging.output_dir, then the checkpoints a resume may load,
    each from a run with this run's definition (resume_plan.check_definitions)."""
    from megatron_grpo.trainer.resume_plan import check_definitions
    from megatron_grpo.trainer.run_folder import prepare_output_dir

    prepare_output_dir(cfg)
    return check_definitions(cfg)


def check_resume(cfg: Config, candidates: list, record: dict, prompts) -> list:
    """Rank 0: the candidates checked against the model and prompts this run built; then this
    run's record is written to <output_dir>/run.json."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.trainer.resume_plan import check_restorable
    from megatron_grpo.trainer.run_folder import write_run_record

    layout = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size()}
    plan = check_restorable(cfg, candidates, record["shapes"], num_prompts=len(prompts[0]), layout=layout)
    write_run_record(Path(cfg.logging.output_dir), record)
    return plan


def check_context_length(cfg: Config, model_config, model_dir: Path) -> None:
    """A prompt plus its response must fit the model's context, checked before any weights are
    loaded (the model was not built for positions beyond it)."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if longest > model_config.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length + data.max_response_length = {cfg.data.max_prompt_length} + "
                          f"{cfg.data.max_response_length} = {longest} tokens exceed the model's context of "
                          f"{model_config.max_position_embeddings} (max_position_embeddings in {model_dir})")


def _load_prompts_checked(cfg: Config, tokenizer) -> tuple[list, list | None] | None:
    """Rank 0 loads and encodes the prompts; its DataError / ConfigError is raised on every rank."""
    prompts, error = None, None
    if dist.get_rank() == 0:
        try:
            prompts = load_prompts(cfg, tokenizer)
        except (DataError, ConfigError) as exc:
            error = exc
    error = broadcast_from_rank0(error)
    if error is not None:
        raise error
    return prompts


def _build_rank0_parts(run: Run, prompts: tuple[list, list | None]) -> None:
    from megatron_grpo.data.sampler import PromptSampler
    from megatron_grpo.rewards.runner import RewardRunner

    cfg = run.config
    train_prompts, eval_prompts = prompts
    run.sampler = PromptSampler(train_prompts, batch_size=cfg.data.train_batch_size,
                                seed=cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed,
                                shuffle=cfg.data.shuffle)
    run.eval_prompts = eval_prompts
    run.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * run.sampler.batches_per_epoch
    run.rewards = RewardRunner(cfg.reward.function, num_workers=cfg.reward.num_workers,
                               timeout_s=cfg.reward.timeout_s if cfg.reward.num_workers else None,
                               kwargs=dict(cfg.reward.kwargs), signature=cfg.reward.signature,
                               max_error_frac=cfg.reward.max_error_frac)
    run.engine = build_engine(cfg, run.model_dir, run.device, run.dtype)


def build_engine(cfg: Config, model_dir: Path, device: torch.device, dtype: torch.dtype = torch.float32):
    """The rollout engine; the local one serves in the trainer's dtype (bf16 on a GPU), as SGLang would."""
    if cfg.rollout.engine == "local":
        from megatron_grpo.rollout.local import LocalEngine

        rows = cfg.rollout.local.max_batch_size or 256
        return LocalEngine.from_pretrained(model_dir, device=device, dtype=dtype, seed=cfg.trainer.seed,
                                           max_batch_rows=rows, tokenizer_path=cfg.model.tokenizer_path)
    from megatron_grpo.trainer.sglang_setup import build_sglang_engine

    return build_sglang_engine(cfg, model_dir, Path(cfg.logging.output_dir))


def prepare_model_folder(cfg: Config, output_dir: Path) -> Path:
    """The HF folder the policy starts from. With model.path it is that folder. Otherwise a model
    is initialised from trainer.seed by `transformers` (config from model.config_path and/or
    model.override_config, tokenizer from model.tokenizer_path or the synthetic task) and saved
    under <output_dir>/initial_model, so every later step (Megatron loading, the rollout engine,
    conversion) works on real HF files."""
    if cfg.model.path:  # an HF folder, or a `convert hf-to-megatron` checkpoint (exported to initial_model/)
        from megatron_grpo.convert.model_folder import hf_model_folder
        return hf_model_folder(_local_model_folder(cfg.model.path), output_dir)
    target = output_dir / "initial_model"
    on_rank0(_ensure_initial_model, cfg, target)
    return target


def _local_model_folder(value: str) -> Path:
    """Rank 0 resolves model.path first (one hub download, its error on every rank); the others
    then find it in the cache (or download to their node's)."""
    from megatron_grpo.trainer.model_path import local_model_folder

    path = on_rank0(local_model_folder, value)
    return path if dist.get_rank() == 0 else local_model_folder(value)


def _ensure_initial_model(cfg: Config, target: Path) -> None:
    """Rank 0: builds initial_model/ unless it exists and was built from what this config asks
    for (run_folder.initial_model_record: config, override_config, tokenizer, trainer.seed)."""
    from megatron_grpo.trainer.run_folder import differences, initial_model_record, read_initial_model_record

    wanted, found = initial_model_record(cfg), read_initial_model_record(target)
    if found == wanted and (target / "config.json").is_file():
        return
    if target.exists():
        changed = "; ".join(differences(found, wanted)) if found else "it records nothing"
        log.info("initial model: rebuilding %s (%s)", target, changed)
    _write_initial_model(cfg, target, wanted)


def _write_initial_model(cfg: Config, target: Path, record: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megatron_grpo.trainer.run_folder import INIT_RECORD

    tokenizer_dir = target.with_name("synthetic_tokenizer")
    if cfg.model.tokenizer_path:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path)
    elif cfg.data.task:
        from megatron_grpo.data.synthetic import build_tokenizer

        tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tokenizer_dir))
    else:
        raise ConfigError("model.path is not set: set model.path (an HF folder), or model.tokenizer_path / "
                          "data.task to initialise a model from model.config_path / model.override_config")
    overrides = dict(cfg.model.override_config)
    if cfg.model.config_path:
        hf_config = AutoConfig.from_pretrained(cfg.model.config_path, **overrides)
    else:
        model_type = overrides.pop("model_type", None)
        if model_type is None:
            raise ConfigError("model.override_config.model_type is required when neither model.path nor "
                              "model.config_path is set")
        hf_config = AutoConfig.for_model(model_type, **overrides)
    # The architecture's default vocabulary (151,936 for Qwen3) would dwarf a tiny model: size the
    # embedding to the tokenizer unless the recipe sets vocab_size itself.
    if "vocab_size" not in cfg.model.override_config:
        hf_config.vocab_size = len(tokenizer)
    elif hf_config.vocab_size < len(tokenizer):
        raise ConfigError(f"model.override_config.vocab_size={hf_config.vocab_size} is smaller than the "
                          f"tokenizer's {len(tokenizer)} tokens")
    hf_config.pad_token_id = tokenizer.pad_token_id
    hf_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(cfg.trainer.seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tmp = target.with_name(target.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted earlier run
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / INIT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)  # left by an interrupted earlier rebuild
    if target.exists():
        target.rename(old)  # derived from the config alone: rebuilt, so the old copy can go
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def load_prompts(cfg: Config, tokenizer) -> tuple[list, list | None]:
    """Encoded train and eval prompts (rank 0)."""
    from megatron_grpo.data.io import load_records
    from megatron_grpo.data.prompts import encode_prompts

    if cfg.data.task:
        from megatron_grpo.data.synthetic import SyntheticTaskConfig, generate_records

        task = SyntheticTaskConfig(**_synthetic_kwargs(cfg))
        train_records = generate_records(task, count=4096, seed=cfg.trainer.seed, split="train")
        eval_records = generate_records(task, count=128, seed=cfg.trainer.seed + 1, split="test")
    else:
        if not cfg.data.train_files:
            raise ConfigError("data.train_files is empty and data.task is not set: nothing to train on")
        train_records = [r for path in cfg.data.train_files for r in load_records(path)]
        eval_records = [r for path in cfg.data.val_files for r in load_records(path)] or None
    overlong = {"error": "error", "left": "truncate_left", "right": "truncate_right", "filter": "filter"}[
        cfg.data.truncation]
    train, _ = encode_prompts(train_records, tokenizer, cfg.data.max_prompt_length, overlong,
                              cfg.data.chat_template, source="train")
    evals = None
    if eval_records:
        evals, _ = encode_prompts(eval_records, tokenizer, cfg.data.max_prompt_length, overlong,
                                  cfg.data.chat_template, source="eval")
    return train, evals


def _synthetic_kwargs(cfg: Config) -> dict:
    from megatron_grpo.data.synthetic import SyntheticTaskConfig

    names = {f.name for f in dataclasses.fields(SyntheticTaskConfig)}
    kwargs = dict(cfg.data.task_kwargs)
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ConfigError(f"data.task_kwargs: unknown keys {unknown}; valid: {sorted(names - {'task'})}")
    return {"task": cfg.data.task, **kwargs}


