"""The typed recipe schema: one frozen dataclass per section, a plain data description.

Defaults equal verl's (`ppo_trainer.yaml`, 0.8/0.9) wherever both projects have the concept, under
the same name, so that verl users read our recipes without a dictionary. Where a default differs
from verl, or verl has no such setting, the comment says so. No behaviour lives here: loading is in
loader.py, cross-field checks in validate.py.

Batch-size units follow verl: `data.train_batch_size` and `actor.ppo_mini_batch_size` count
*prompts*; each prompt yields `rollout.n` responses, so a mini-batch holds
`ppo_mini_batch_size * rollout.n` sequences, split over the data-parallel ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megatron_grpo.config.coerce import ONE_OR_MORE
from megatron_grpo.config.off_policy import OffPolicySection
from megatron_grpo.config.reward_models import CombineConfig, ModelScorerConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
# "<name>+": the value of <name>, the gradient of k2 (straight-through, algo/kl.py)
KlEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                      "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (megatron_grpo/lora/): only low-rank adapters on the linear layers train; the base stays frozen
    in the model dtype (no gradients, master copy or optimizer state) and is the KL reference. verl:
    actor_rollout_ref.model.lora_rank / lora_alpha / target_modules."""
    rank: int = 0  # 0 = no LoRA (verl's lora_rank: 0); else the adapters' rank
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # on the adapters' input, training only (PEFT's lora_dropout)
    # PEFT's names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear.
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start from; its r,
    # lora_alpha and target_modules must equal the keys above. None = PEFT's init (B = 0: the base's outputs).
    adapter_path: Optional[str] = None
    # How engines get the policy: merged = W + alpha/rank * B A folded in as the weights are exported
    # (every engine and transport). Adapter-only sync to SGLang (--enable-lora) is not built yet.
    sync: Literal["merged"] = "merged"


@dataclass(frozen=True)
class ModelConfig:
    # HF model folder (or hub id) with config.json + safetensors; the policy starts from its weights.
    path: Optional[str] = None
    # HF config.json (file or folder) for a model initialised from scratch (no weights loaded).
    config_path: Optional[str] = None
    # Tokenizer folder; None = `path` (or the synthetic task's tokenizer when data.task is set).
    tokenizer_path: Optional[str] = None
    # HF config fields of a model built from scratch (verl: model.override_config); with model.path
    # its config.json is used as it is, and a warning names the keys set here that differ from it.
    override_config: dict[str, Any] = field(default_factory=dict)
    dtype: Dtype = "auto"  # auto = bfloat16 on GPU, float32 on CPU; float16 is refused (validate.py)
    make_vocab_size_divisible_by: int = 128  # megatron pads the vocab to a multiple of this x TP
    # Attention (models/spec.py): te = Transformer Engine's layer spec; torch_varlen = megatron's local
    # modules, packed micro-batches through torch's FlashAttention varlen kernel (CUDA, bf16); local =
    # megatron's local modules with our attention (runs anywhere); auto = te if it imports, else
    # torch_varlen on CUDA with a bf16 model, else local (the choice is logged at start). Replaces
    # model.transformer_impl (transformer_engine -> te).
    attention_backend: Literal["auto", "te", "torch_varlen", "local"] = "auto"
    # The LM head's matmul in fp32 on both sides (trainer, local engine, SGLang's --enable-fp32-lm-head):
    # bf16 logits are the largest source of engine-vs-trainer mismatch; nothing changes in an fp32 model.
    fp32_lm_head: bool = False
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    recompute_method: Literal["uniform", "block"] = "uniform"  # only read for granularity=full
    recompute_num_layers: int = 1
    trust_remote_code: bool = False  # never run code shipped with a checkpoint unless asked
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(frozen=True)
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: Optional[int] = None  # interleaved schedule: model chunks per pipeline rank
    context: int = 1
    sequence_parallel: bool = False  # needs tensor > 1
    use_distributed_optimizer: bool = True  # verl's megatron default
    # MoE models: ranks each layer's experts are spread over (EP, carved out of TP x DP x CP), and
    # the tensor parallelism inside an expert (ETP; null = parallel.tensor). world = PP x EP x ETP x expert-DP.
    expert: int = 1
    expert_tensor: Optional[int] = None


@dataclass(frozen=True)
class DataConfig:
    # jsonl / parquet files in verl's column layout
    train_files: list[str] = field(default_factory=list, metadata={ONE_OR_MORE: True})
    val_files: list[str] = field(default_factory=list, metadata={ONE_OR_MORE: True})
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"  # the column naming each row's scorer (the reward function's data_source)
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per step
    shuffle: bool = True
    seed: Optional[int] = None  # sampler seed; None = trainer.seed
    # over-long prompts: error (verl default), truncate on the left / right, or filter them out (counted)
    truncation: Literal["error", "left", "right", "filter"] = "error"
    apply_chat_template: bool = True
    chat_template: Optional[str] = None  # a Jinja template string; None = the tokenizer's own
    # A synthetic task (data/synthetic.py) instead of files, e.g. "reverse_digits"; not in verl.
    task: Optional[str] = None
    task_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalEngineConfig:
    max_batch_size: Optional[int] = None  # sequences generated at once; None = the whole step
    # The engine in a process of its own (rollout/engine_process.py): it generates while the
    # trainer trains and takes weights through shared memory. None = when rollout.max_staleness > 0.
    process: Optional[bool] = None
    threads: int = 1  # torch threads of the engine's own process


@dataclass(frozen=True)
class SGLangConfig:
    # Existing servers (or one router) to use; empty = launch `num_engines` servers ourselves.
    urls: list[str] = field(default_factory=list)
    # A router already serving `urls` (e.g. started by the sbatch scripts): /generate goes there,
    # weight updates still go to every engine directly.
    router_url: Optional[str] = None
    num_engines: int = 1
    tp_size: int = 1  # GPUs per engine
    mem_fraction: float = 0.8  # --mem-fraction-static
    # Where launched engines run: cuda, or cpu (SGLang's CPU backend: SGLANG_USE_CPU_ENGINE=1 and --device cpu;
    # its CPU kernel package, or tools/sglang_cpu's stand-in, must be importable). No memory saver, no
    # deterministic inference there (SGLang 0.5.23 refuses both on a CPU). URL-given engines are what they are.
    device: Literal["cuda", "cpu"] = "cuda"
    # device=cpu: OpenMP threads of each engine process (OMP_NUM_THREADS). SGLang's default takes every core,
    # and beside a trainer or other work on the same cores its rollouts ran 10-15x slower (docs/rollout.md).
    cpu_threads: int = 1
    # KV cache of a launched engine, in tokens (--max-total-tokens). None: SGLang sizes it from mem_fraction
    # on a GPU; on cpu (where SGLang would size it from the machine's RAM) max_concurrency x the longest
    # sequence (data.max_prompt_length + data.max_response_length).
    max_total_tokens: Optional[int] = None
    host: str = "127.0.0.1"  # bind address of launched servers; loopback by default
    port: int = 30000  # first port; engine i listens on port + i
    router: bool = False  # put sglang_router in front of the engines
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = "cache_aware"
    router_port: int = 30080
    # distributed = NCCL broadcast (disaggregated), tensor = CUDA IPC (colocated), disk = safetensors files
    weight_sync: Literal["distributed", "tensor", "disk"] = "distributed"
    disk_sync_dir: Optional[str] = None  # shared folder for weight_sync=disk; None = <output_dir>/weight_sync
    extra_args: list[str] = field(default_factory=list)  # passed to sglang.launch_server untouched
    # Name of the environment variable holding the API key (the key itself stays out of recipes,
    # logs and checkpoints).
    api_key_env: Optional[str] = None
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    weight_update_timeout_s: float = 600.0
    max_retries: int = 3
    # Sequences (samples) in flight per engine: a request of n samples takes n; behind a router the
    # client holds this x the live engines. Each engine's batch is at most this full: size it to
    # what its KV cache holds (`megatron-grpo plan` prints that, in tokens). slime's default: 512.
    max_concurrency: int = 256
    # Reproducible rollouts: SGLang honours sampling_seed only with --enable-deterministic-inference
    # (passed to launched servers; URL-given ones are checked). It costs throughput (SGLang measured
    # 34% with CUDA graphs) and restricts the attention backend; the cluster recipes turn it off
    # (unseeded: a group is one request of n samples sharing its prompt's prefix cache).
    deterministic_inference: bool = True
    verify_interval: int = 50  # check the engines' weights after the first sync and every N-th; 0 = never
    min_engines: int = 1  # fewer live engines than this stops the run (after a checkpoint)
    health_check_interval_s: float = 30.0  # background /health_generate probe of every engine; 0 = off
    health_check_timeout_s: float = 60.0
    # The command that starts one server (its flags are appended); empty = this Python's
    # `-m sglang.launch_server`. E.g. a container or numactl wrapper.
    launch_command: list[str] = field(default_factory=list)
    router_command: list[str] = field(default_factory=list)  # empty = `-m sglang_router.launch_router`


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn, tool-calling rollouts (agentic): the policy talks to an environment, token in /
    token out. Not in verl under these names (verl: actor_rollout_ref.rollout.multi_turn.*)."""

    # The environment: a built-in name, `module:Class` or `path/to/file.py:Class`; None = single-turn.
    environment: Optional[str] = None
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4  # assistant turns per trajectory
    max_new_tokens_per_turn: Optional[int] = None  # None = rollout.max_new_tokens
    max_length: Optional[int] = None  # prompt + every turn, in tokens; None = max_prompt_length + max_response_length
    step_timeout_s: float = 30.0  # one environment step (a tool call)
    # How per-turn rewards become the trajectory's: sum, or discounted (sum of gamma^t r_t)
    turn_reward: Literal["sum", "discounted"] = "sum"
    discount: float = 1.0


@dataclass(frozen=True)
class LongTailConfig:
    """Cutting the long tail of generation (trainer/rollouts/long_tail.py, docs/long-tail.md)."""

    # Prompt groups submitted per round beyond the ones the batch needs; once those are complete (every sample
    # finished) the rest are aborted. slime's --over-sampling-batch-size is data.train_batch_size + this. 0 = off.
    over_sampling_groups: int = 0
    # Keep what the abort left (partial responses, their log-probs and each token's weight version) and continue it
    # first next round, under the newer weights (slime's --partial-rollout, APRIL); off = discard it. A carried
    # sequence's oldest token counts for rollout.max_staleness (at max_staleness 0: one version, with allow_off_policy).
    partial_rollout: bool = False
    # partial_rollout with max_staleness 0: the steps then train tokens of the previous weights (off-policy by one
    # version); refused unless set.
    allow_off_policy: bool = False


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["local", "sglang"] = "local"
    n: int = 1  # responses per prompt; verl's default, GRPO needs >= 2 (verl's GRPO examples use 5)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0  # 0 = off: drop tokens below min_p x the most likely token's probability
    # Sampling-support replay: with top-p / top-k / min-p the engine samples from a truncated
    # distribution; `on` trains on the log-probs of that same distribution (each token's support
    # comes back from the engine: SGLang's return_sampling_mask, which needs a finite top_k <= its
    # --sampling-mask-max-tokens), `off` on the full one; auto = on whenever sampling is truncated, except
    # top_k=1 (one-token supports) and multi-turn rollouts.
    sampling_replay: Literal["auto", "on", "off"] = "auto"
    max_new_tokens: Optional[int] = None  # None = data.max_response_length (as verl)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    weight_bucket_mb: int = 512  # size of one weight-sync bucket
    # Asynchronous GRPO (trainer/rollouts/rollout_pipeline.py): generation for the next steps runs while the
    # current step trains; no sample is trained more than K weight versions after the one that
    # generated it (older ones are dropped and counted). 0 = the on-policy loop (generate, train, sync).
    max_staleness: int = 0
    # Who sends the weights: per_stage = each pipeline stage's first tensor-parallel rank streams its
    # own layers to the engines (local engine in its own process, SGLang distributed); colocated =
    # every trainer rank feeds the SGLang engine rank on its GPU (weight_sync=tensor); rank0 = every
    # stage through global rank 0; auto = colocated for weight_sync=tensor, else per_stage where the
    # engine takes it (SGLang distributed: at PP > 1), else rank0.
    weight_sync_route: Literal["auto", "per_stage", "colocated", "rank0"] = "auto"
    local: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    long_tail: LongTailConfig = field(default_factory=LongTailConfig)


@dataclass(frozen=True)
class KlCtrlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000  # adaptive only
    target_kl: float = 0.1  # adaptive only


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose rewards all agree and sample more prompts."""

    enable: bool = False
    # the per-sample value whose variance decides: acc | score = the reward function's score;
    # seq_reward | seq_final_reward = the score with reward.overlong_buffer's penalty (verl's names)
    metric: str = "score"
    max_num_gen_batches: int = 0  # generation rounds per step before failing; 0 = no limit (as verl)


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # grpo | rloo | reinforce_plus_plus_baseline | a registered name
    norm_adv_by_std_in_grpo: bool = True  # false = Dr.GRPO
    use_kl_in_reward: bool = False
    kl_penalty: KlEstimator = "kl"  # estimator for the in-reward KL
    kl_ctrl: KlCtrlConfig = field(default_factory=KlCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # vanilla | gspo | a registered policy loss (checked in validate.py)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    lr_warmup_steps: int = 0
    lr_scheduler: Literal["constant", "cosine"] = "constant"  # cosine = warmup then cosine decay
    min_lr: float = 0.0  # cosine floor


@dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n sequences)
    # Micro-batching: fixed sequences per micro-batch, or token-balanced micro-batches of at most
    # this many tokens (verl: use_dynamic_bsz + ppo_max_token_len_per_gpu). Exactly one is set.
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    max_tokens_per_micro_batch: Optional[int] = 16384
    # Sequence packing (verl: use_remove_padding): a micro-batch's sequences in one row, no padding
    # between them (trainer/batches/micro_batches.py); false = one right-padded row per sequence.
    packing: bool = True
    # Token budget of the forward-only old-log-prob pass; None = max_tokens_per_micro_batch
    # (verl: rollout.log_prob_max_token_len_per_gpu).
    logprob_max_tokens_per_micro_batch: Optional[int] = None
    # With one epoch the first mini-batch's "old" log-probs are the update's own (detached), so its
    # ratio is 1 by construction. Every K steps the old-log-prob pass covers it too, and
    # invariant/ratio_dev_first_minibatch measures the update's forward against that pass; 0 = never.
    old_logprob_check_interval: int = 0
    ppo_epochs: int = 1
    shuffle: bool = False  # shuffle sequences between mini-batches
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KlEstimator = "low_var_kl"
    loss_agg_mode: LossAggMode = "token-mean"
    # seq-mean-token-sum-norm divisor; None = data.max_response_length (Dr.GRPO's constant)
    loss_scale_factor: Optional[float] = None
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2  # DAPO clip-higher: 0.28
    clip_ratio_c: float = 3.0  # dual clip for negative advantages
    entropy_coeff: float = 0.0
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tis_cap: Optional[float] = None  # truncated importance sampling vs rollout log-probs; None = off
    # MoE rollout routing replay (R3): the trainer's forward uses the experts the engine routed each
    # token to (gate weights from the trainer's router; models/routing_replay.py). verl: router_replay.mode=R3.
    # Local engine: hooks on its routers; SGLang: return_routed_experts (launched engines get
    # --enable-return-routed-experts, URL-given ones must have it; not behind sglang-router, which drops
    # the field). Refused with model.recompute_granularity=full at parallel.pipeline > 1 (docs/rollout.md).
    moe_routing_replay: bool = False
    # is_level auto (the default): token-level truncated IS when rollout.max_staleness > 0 (config/off_policy.py)
    off_policy: OffPolicySection = field(default_factory=OffPolicySection)
    grad_clip: Optional[float] = 1.0  # None = no clipping
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass(frozen=True)
class RefConfig:
    # None = a frozen copy of the initial policy (model.path / its random init).
    model_path: Optional[str] = None
    max_tokens_per_micro_batch: Optional[int] = None  # reference-log-prob pass; None = the actor's micro-batching
    param_offload: bool = False  # keep reference weights on CPU between uses


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (rewards/overlong.py; verl's reward_manager=dapo with
    reward_kwargs.overlong_buffer_cfg): responses in the last `len` tokens before the cap lose up
    to `penalty_factor` reward, linearly."""

    enable: bool = False
    len: int = 0  # buffer tokens before the cap (DAPO: 4096 of 20480)
    penalty_factor: float = 1.0
    # the cap the buffer ends at (verl's reward_kwargs.max_resp_len); None = data.max_response_length
    max_response_length: Optional[int] = None
    log: bool = False  # verl's overlong_buffer_cfg.log; the penalty metrics are always logged here


@dataclass(frozen=True)
class RewardConfig:
    # gsm8k | math | synthetic | by_data_source (each row's scorer by its data_source, as verl's
    # default) | "pkg.module:fn" | "path/to/file.py:fn"
    function: str = "gsm8k"
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the reward function
    num_workers: int = 4  # process pool size; 0 = in the trainer process
    timeout_s: float = 10.0  # per call; a timeout scores 0 and counts in reward/errors
    # How `function` is called: verl = compute_score(data_source, solution_str, ground_truth,
    # extra_info) (or its batched form), native = fn(prompt, response, ground_truth, extra);
    # auto = decided from the function's parameter names.
    signature: Literal["auto", "verl", "native"] = "auto"
    # A batch in which more than this fraction of the calls fail (raise, time out, return no
    # finite number) stops the run; below it, failures score 0 and count in reward/errors/<kind>.
    max_error_frac: float = 0.5
    # Score each prompt group as soon as its n samples are generated (overlapping the rest of the
    # generation); false: score the whole batch after the last sample. The scores are the same.
    score_while_generating: bool = True
    format_score: float = 0.0
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # Rewards from models beside `function` (config/reward_models.py, docs/rewards.md): reward models
    # and LLM judges by name, each scored in-process (hf) or by SGLang servers as groups finish;
    # empty = the rule reward alone. Not in verl under this name (verl: reward_model.*).
    models: dict[str, ModelScorerConfig] = field(default_factory=dict)
    combine: CombineConfig = field(default_factory=CombineConfig)  # weights of `function` ("rule") and each model


@dataclass(frozen=True)
class CheckpointConfig:
    save_dir: Optional[str] = None  # None = <logging.output_dir>/checkpoints
    save_interval: int = -1  # steps between saves; -1 = only when stopped by a signal (verl save_freq)
    keep_last: Optional[int] = None  # None = keep all (verl max_actor_ckpt_to_keep)
    # auto = the newest complete checkpoint of this run; force = the same, even when the folder
    # was written by a run with another model / data / task / seed (trainer/state/run_folder.py);
    # never = start fresh (refused in a folder that holds a run, unless logging.overwrite);
    # or a checkpoint folder.
    resume: str = "auto"
    async_save: bool = False
    save_hf: bool = False  # also write <step_N>/hf: the policy as an HF folder (convert.to_hf.write_hf_export)


@dataclass(frozen=True)
class LoggingConfig:
    output_dir: str = "outputs/run"  # metrics.jsonl, plots, default checkpoint folder
    project: str = "megatron-grpo"  # verl: trainer.project_name
    experiment_name: Optional[str] = None  # None = the recipe's file name
    console: bool = True  # progress bar with the key figures
    log_interval: int = 1  # steps between console / sink writes (metrics.jsonl gets every step)
    tensorboard: bool = False
    wandb: bool = False
    wandb_entity: Optional[str] = None
    wandb_mode: Literal["online", "offline"] = "online"
    # write a reward-curve PNG beside metrics.jsonl (matplotlib: the `plot` extra; without it, one log line)
    plot: bool = False
    # checkpoint.resume=never into a folder that holds a run: move that run aside to
    # <output_dir>.old-N (renamed, never deleted) instead of refusing.
    overwrite: bool = False


@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = 30  # verl's default
    total_steps: Optional[int] = None  # overrides epochs when set (verl: total_training_steps)
    seed: int = 1234
    device: Device = "auto"  # auto = cuda when available
    max_consecutive_nan_steps: int = 3  # skipped non-finite updates in a row before the run stops
    # torch threads of the trainer process; None = torch's default, or with the local engine in its
    # own process on CPU the cores it leaves (cores - rollout.local.threads, at least 1)
    num_threads: Optional[int] = None
    # Before step 1: is the engine-trainer pair sound? (trainer/preflight.py: rounds at lr 0, a weight
    # round trip, the trainer and the engine against themselves); the run stops (exit 1) on a failure.
    preflight: bool = False
    preflight_rounds: int = 3  # rollouts at learning rate 0
    # On CUDA, before any model is built: simulate every pipeline stage's memory on this job's GPUs
    # (megatron-grpo plan, cached per recipe and layout) and stop (exit 2) when the peak does not fit.
    memory_plan: bool = True
    # Hang watchdog (launch/watchdog.py): a rank with no progress (phase change) for this long, or
    # one silent that long, stops every rank with its stacks and one summary line, exit 3. Collective
    # timeouts are set to 0.9 x this, so gloo's fire first. Fixed default, 30 min: the collective
    # timeout this trainer always had, which the longest legitimate wait (the others waiting in a
    # collective while rank 0 generates a long batch, or the first weight push) must fit anyway; a
    # default from the measured step time would be too short in the first step and wrong when
    # responses grow. Set it to a few times your slowest step to find a hang sooner.
    hang_timeout_s: float = 1800.0


@dataclass(frozen=True)
class EvalConfig:
    interval: int = -1  # steps between evals; -1 = off (verl test_freq)
    before_train: bool = False  # verl's val_before_train defaults to true; here opt-in
    val_batch_size: Optional[int] = None  # prompts per eval batch; None = all at once
    n_samples: int = 1  # responses per prompt
    greedy: bool = True  # verl val_kwargs.do_sample=false
    temperature: float = 1.0  # only with greedy=false
    pass_k: list[int] = field(default_factory=lambda: [1])


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
