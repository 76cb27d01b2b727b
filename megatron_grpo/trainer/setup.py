"""Assembles a run from the recipe: process groups, the policy (+ optimizer), the optional reference
model, and on global rank 0 the rollout engine, reward runner and prompts. The recipe -> argument
mapping lives here, so the modules below take plain typed arguments; each part is built by its own
module (model_path / initial_model, prompt_data, engine_setup, optimizer, update_guard)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_grpo.algo.kl_in_reward import KLController, make_kl_controller
from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError, MegatronGRPOError
from megatron_grpo.launch.collectives import broadcast_from_rank0, on_rank0, rank0_only

if TYPE_CHECKING:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from transformers import PreTrainedTokenizerBase

    from megatron_grpo.data.prompts import EncodedPrompt
    from megatron_grpo.data.sampler import PromptSampler
    from megatron_grpo.models.hf_config import ModelArchitecture
    from megatron_grpo.rewards.combined import CombinedRewards
    from megatron_grpo.rewards.runner import RewardRunner
    from megatron_grpo.rollout.engine import RolloutEngine
    from megatron_grpo.trainer.rollouts.long_tail import CarryOver
    from megatron_grpo.trainer.state.resume_plan import Candidate
    from megatron_grpo.trainer.state.run_lock import HeldFolders
    from megatron_grpo.trainer.step_settings import StepSettings
    from megatron_grpo.trainer.sync.stage_sync import StageSync
    from megatron_grpo.trainer.assembly.update_guard import NonFiniteUpdateGuard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rank0Parts:
    """What exists on global rank 0 only: the rollout engine, the reward workers, the prompts."""

    engine: RolloutEngine
    rewards: RewardRunner | CombinedRewards  # CombinedRewards with reward.models
    sampler: PromptSampler[EncodedPrompt]
    eval_prompts: list[EncodedPrompt] | None
    # rollout.long_tail: prompts drawn but not started and carried groups (trainer/rollouts/long_tail.py);
    # None when the long tail is not cut
    carry_over: CarryOver | None = None

    def close(self) -> None:
        try:
            if self.carry_over is not None:
                self.carry_over.close()  # carried episodes' environments (tool sandboxes)
            self.rewards.close()
        finally:
            self.engine.close()


class NotOnRank0(MegatronGRPOError):
    """A rank-0-only part (engine, rewards, prompts) was asked for on another rank: a bug."""


@dataclass
class Run:
    """Everything the loop touches, complete when build_run returns (nothing is filled in later)."""

    config: Config
    device: torch.device
    dtype: torch.dtype
    model_config: ModelArchitecture
    model_dir: Path                           # HF folder the policy started from (also the engine's)
    policy: list[torch.nn.Module]             # DDP-wrapped model chunks
    optimizer: NonFiniteUpdateGuard           # over megatron's (distributed) optimizer
    scheduler: OptimizerParamScheduler
    # frozen chunks, or None when no KL term needs them; a LoRA run's policy (run with its adapters off)
    reference: list[torch.nn.Module] | None
    tokenizer: PreTrainedTokenizerBase
    total_steps: int
    record: dict                              # what defines the run (run_folder.run_record)
    settings: StepSettings                    # the recipe as the step's parts take it, built once
    resume_plan: list[Candidate] = field(default_factory=list)  # checked checkpoints, best first
    rank0: Rank0Parts | None = None           # global rank 0 only
    stage_sync: StageSync | None = None       # per-stage weight sync (trainer/sync/stage_sync.py), or rank 0's route
    kl_controller: KLController | None = None  # algorithm.use_kl_in_reward (its beta is checkpointed)
    folder_lock: HeldFolders | None = None    # rank 0 of a training run: its folders' locks (run_lock.py)

    @property
    def is_main(self) -> bool:
        return dist.get_rank() == 0

    def _rank0(self) -> Rank0Parts:
        if self.rank0 is None:
            raise NotOnRank0(f"the rollout engine, rewards and prompts exist on global rank 0 only "
                             f"(asked on rank {dist.get_rank()})")
        return self.rank0

    @property
    def engine(self) -> RolloutEngine:
        return self._rank0().engine

    @property
    def rewards(self) -> RewardRunner | CombinedRewards:
        return self._rank0().rewards

    @property
    def sampler(self) -> PromptSampler[EncodedPrompt]:
        return self._rank0().sampler

    @property
    def eval_prompts(self) -> list[EncodedPrompt] | None:
        return self._rank0().eval_prompts

    @property
    def carry_over(self) -> CarryOver | None:
        return self._rank0().carry_over

    @carry_over.setter
    def carry_over(self, value: CarryOver | None) -> None:
        self._rank0().carry_over = value

    def close(self) -> None:
        if self.rank0 is not None:
            self.rank0.close()

    def release_folder(self) -> None:
        """Lets another run use the run folder (after the run's last write there)."""
        if self.folder_lock is not None:
            self.folder_lock.release()


def kl_reference_needed(cfg: Config) -> bool:
    """The reference model is built and run only when a KL term can be non-zero: the KL loss, or
    the KL in the reward (whose controllers only ever scale a zero beta to zero)."""
    return (cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef != 0) or kl_in_reward_active(cfg)


def kl_in_reward_active(cfg: Config) -> bool:
    return cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_ctrl.kl_coef != 0


def build_kl_controller(cfg: Config) -> KLController | None:
    k = cfg.algorithm.kl_ctrl
    return make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon) if kl_in_reward_active(cfg) else None


def old_logprobs_needed(cfg: Config) -> bool:
    """With exactly one on-policy update per rollout (one epoch, one mini-batch) old == current."""
    return cfg.actor.ppo_epochs > 1 or cfg.actor.ppo_mini_batch_size < cfg.data.train_batch_size


def first_mini_batch_has_old_pass(cfg: Config, step: int) -> bool:
    """Whether the first mini-batch's old log-probs come from the forward-only pass at `step`
    (then its ratio is a measurement, not 1 by construction): always with several epochs, else
    every actor.old_logprob_check_interval steps."""
    interval = cfg.actor.old_logprob_check_interval
    return cfg.actor.ppo_epochs > 1 or (interval > 0 and step % interval == 0)


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


def build_run(cfg: Config, *, hold_folder: bool = True) -> Run:
    """Collective. Every rank-0 step the others wait on reports its failure on every rank.
    hold_folder (a training run; not `eval` or `doctor --mismatch`, which only read the run's
    checkpoints): rank 0 holds logging.output_dir and checkpoint.save_dir until Run.release_folder()
    (run_lock.py), refusing them when another live run holds them."""
    from megatron_grpo.launch import ParallelLayout, init_distributed, initialize_model_parallel
    from megatron_grpo.launch.watchdog import collective_timeout_s
    from megatron_grpo.trainer.state.run_folder import prepare_output_dir

    # below the hang watchdog's timeout, so that a collective with a stopped peer raises first (gloo)
    timeout_minutes = collective_timeout_s(cfg.trainer.hang_timeout_s) / 60
    init_distributed(timeout_minutes=timeout_minutes)
    layout = ParallelLayout(tensor=cfg.parallel.tensor, pipeline=cfg.parallel.pipeline,
                            virtual_pipeline=cfg.parallel.virtual_pipeline, context=cfg.parallel.context,
                            sequence_parallel=cfg.parallel.sequence_parallel, expert=cfg.parallel.expert,
                            expert_tensor=cfg.parallel.expert_tensor)
    initialize_model_parallel(layout, seed=cfg.trainer.seed, timeout_minutes=timeout_minutes)
    device, dtype = resolve_device(cfg)
    if device.type == "cuda" and cfg.trainer.memory_plan:  # refuse a layout that cannot fit, before any GPU work
        from megatron_grpo.trainer.assembly.memory_check import check_memory_plan

        gpu_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        on_rank0(check_memory_plan, cfg, dist.get_world_size(), gpu_gib)
    # The folder's rules (and its lock), before anything is written there.
    folder_lock = rank0_only(prepare_output_dir, cfg, hold_folder)
    try:
        return _build_in_folder(cfg, layout, device, dtype, folder_lock)
    except BaseException:
        if folder_lock is not None:
            folder_lock.release()
        raise


def _build_in_folder(cfg: Config, layout, device: torch.device, dtype: torch.dtype,
                     folder_lock: HeldFolders | None) -> Run:
    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.data.sampler import batches_per_epoch
    from megatron_grpo.models import ModelArchitecture, build_model, build_reference_model
    from megatron_grpo.models.builder import Recompute
    from megatron_grpo.trainer.assembly.model_path import check_context_length, prepare_model_folder
    from megatron_grpo.trainer.assembly.tokenizer import check_tokenizer_fits, load_tokenizer
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.assembly.prompt_data import load_prompts
    from megatron_grpo.trainer.state.resume_plan import check_definitions
    from megatron_grpo.trainer.state.run_folder import run_record
    from megatron_grpo.trainer.sync.stage_sync import connect_stage_sync
    from megatron_grpo.trainer.assembly.update_guard import NonFiniteUpdateGuard

    output_dir = Path(cfg.logging.output_dir)
    # The definitions of the checkpoints a resume may load, before initial_model/ is (re)built;
    # every check of a resume happens before the policy is built.
    candidates = on_rank0(check_definitions, cfg)

    model_dir = prepare_model_folder(cfg, output_dir)
    model_config = ModelArchitecture.from_hf(model_dir, tensor_parallel=layout.tensor,
                                       vocab_multiple=cfg.model.make_vocab_size_divisible_by)
    check_context_length(cfg, model_config.max_position_embeddings, f"max_position_embeddings in {model_dir}")
    check_moe_keys(cfg, model_config)
    tokenizer_source = f"model.tokenizer_path={cfg.model.tokenizer_path}" if cfg.model.tokenizer_path else "model.path"
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or model_dir, tokenizer_source)
    check_tokenizer_fits(model_config.vocab_size, tokenizer, model_dir, tokenizer_source)
    prompts = rank0_only(load_prompts, cfg, tokenizer)  # data errors stop every rank before any model is built
    if cfg.rollout.multi_turn.environment:
        on_rank0(check_multi_turn_environment, cfg)
    if cfg.model.lora.rank and cfg.model.lora.adapter_path:
        from megatron_grpo.trainer.assembly.lora import check_adapter_folder

        on_rank0(check_adapter_folder, cfg)
    record = run_record(cfg, model_config)
    resume_plan = on_rank0(check_resume, cfg, candidates, record, prompts)
    num_prompts = int(broadcast_from_rank0(len(prompts[0]) if prompts is not None else None))
    total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * batches_per_epoch(num_prompts,
                                                                                          cfg.data.train_batch_size)
    if dist.get_rank() == 0:  # the run's length is known now (with trainer.total_epochs: from the prompts)
        from megatron_grpo.config.validate import config_warnings

        for line in config_warnings(cfg, total_steps):
            log.warning(line)

    recompute = Recompute(granularity=None if cfg.model.recompute_granularity == "none"
                          else cfg.model.recompute_granularity,
                          method=cfg.model.recompute_method, num_layers=cfg.model.recompute_num_layers)
    chunks = build_model(model_config, layout, dtype=dtype, recompute=recompute, fp32_lm_head=cfg.model.fp32_lm_head,
                         backend=cfg.model.attention_backend)
    load_hf_weights(chunks, model_config, model_dir)
    for chunk in chunks:
        chunk.to(device)
    if cfg.model.lora.rank:
        from megatron_grpo.trainer.assembly.lora import add_policy_adapters

        add_policy_adapters(chunks, cfg, model_config)
    policy = wrap_with_ddp(chunks, cfg.parallel.use_distributed_optimizer)
    optim = cfg.actor.optim
    optimizer, scheduler = build_optimizer(policy, OptimizerSettings(
        lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
        eps=optim.eps, grad_clip=cfg.actor.grad_clip or 0.0, warmup_steps=optim.lr_warmup_steps,
        scheduler=optim.lr_scheduler, total_steps=total_steps,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer, bf16=dtype == torch.bfloat16))

    reference = None
    if kl_reference_needed(cfg) and cfg.model.lora.rank:
        reference = policy  # its base: the loop runs the reference pass with the adapters off
    elif kl_reference_needed(cfg):
        reference = build_reference_model(model_config, layout, dtype=dtype, fp32_lm_head=cfg.model.fp32_lm_head,
                                          backend=cfg.model.attention_backend)
        load_hf_weights(reference, model_config, cfg.ref.model_path or model_dir)
        if not cfg.ref.param_offload:  # offloaded: stays on the CPU, moved in only for its pass
            for chunk in reference:
                chunk.to(device)

    from megatron_grpo.trainer.step_settings import step_settings

    rank0 = rank0_only(build_rank0_parts, cfg, prompts, model_dir, device, dtype)
    return Run(config=cfg, settings=step_settings(cfg), device=device, dtype=dtype, model_config=model_config,
               model_dir=model_dir, policy=policy,
               # Skips updates whose gradient norm is NaN / Inf; stops after max_consecutive_nan_steps in a row.
               optimizer=NonFiniteUpdateGuard(optimizer, limit=cfg.trainer.max_consecutive_nan_steps),
               scheduler=scheduler, reference=reference, tokenizer=tokenizer, total_steps=total_steps,
               record=record, resume_plan=resume_plan, rank0=rank0, stage_sync=connect_stage_sync(cfg, rank0),
               kl_controller=build_kl_controller(cfg), folder_lock=folder_lock)


def check_multi_turn_environment(cfg: Config) -> None:
    """rollout.multi_turn.environment loads and takes environment_kwargs (ConfigError otherwise)."""
    from megatron_grpo.environments.loader import check_environment

    check_environment(cfg.rollout.multi_turn.environment, cfg.rollout.multi_turn.environment_kwargs)


def check_moe_keys(cfg: Config, model_config) -> None:
    """The MoE keys need a model with experts (config validation catches it earlier when
    model.override_config names the model type; a model folder is only read here)."""
    if model_config.is_moe:
        return
    if cfg.parallel.expert > 1:
        raise ConfigError(f"parallel.expert={cfg.parallel.expert}: model_type {model_config.architecture!r} has no "
                          f"experts (expert parallelism needs a mixture-of-experts model); set parallel.expert=1")
    if cfg.actor.moe_routing_replay:
        raise ConfigError(f"actor.moe_routing_replay=true: model_type {model_config.architecture!r} has no experts "
                          f"(routing replay needs a mixture-of-experts model); set it to false")


def check_resume(cfg: Config, candidates: list[Candidate], record: dict, prompts) -> list[Candidate]:
    """Rank 0: the candidates checked against the model and prompts this run built; then this
    run's record is written to <output_dir>/run.json."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.trainer.state.resume_plan import check_restorable
    from megatron_grpo.trainer.state.run_folder import write_run_record

    layout = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size()}
    plan = check_restorable(cfg, candidates, record["shapes"], num_prompts=len(prompts[0]), layout=layout)
    write_run_record(Path(cfg.logging.output_dir), record)
    return plan


def build_rank0_parts(cfg: Config, prompts: tuple[list[EncodedPrompt], list[EncodedPrompt] | None],
                      model_dir: Path, device: torch.device, dtype: torch.dtype) -> Rank0Parts:
    """Rank 0: the prompt sampler, the reward runner and the rollout engine."""
    from megatron_grpo.data.sampler import PromptSampler
    from megatron_grpo.reward_models.build import build_rewards
    from megatron_grpo.trainer.engines.engine_setup import build_engine

    train_prompts, eval_prompts = prompts
    sampler = PromptSampler(train_prompts, batch_size=cfg.data.train_batch_size,
                            seed=cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed,
                            shuffle=cfg.data.shuffle)
    # reward.function alone, or combined with reward.models (their launched servers log here)
    rewards = build_rewards(cfg.reward, Path(cfg.logging.output_dir) / "reward_models")
    try:
        engine = build_engine(cfg, model_dir, device, dtype)
    except BaseException:
        rewards.close()  # its worker processes would outlive the failed start
        raise
    from megatron_grpo.config.derived import long_tail_enabled
    from megatron_grpo.trainer.rollouts.long_tail import CarryOver

    carry_over = CarryOver() if long_tail_enabled(cfg) else None
    return Rank0Parts(engine=engine, rewards=rewards, sampler=sampler, eval_prompts=eval_prompts,
                      carry_over=carry_over)
