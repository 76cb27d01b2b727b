"""Cross-field checks of a typed Config; every problem found is reported in one ConfigError.

Called once before anything heavy starts: with world_size=None (e.g. `config show`) the checks
that need the data-parallel size are skipped; the trainer calls it again with the real size and
the ranks per node (where colocated engines are placed).
"""
from __future__ import annotations

import json
from typing import Optional

from megatron_grpo.config.coerce import field_types
from megatron_grpo.config.lora_checks import lora_problems
from megatron_grpo.config.derived import (longest_sequence, overlong_cap, rollouts_run_ahead, sampling_replay_enabled,
                                          values_at)
from megatron_grpo.config.model_dims import ModelDims, hf_config_file, model_dims
from megatron_grpo.config.names import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, REWARD_FUNCTIONS, check_name, unknown_name
from megatron_grpo.config.policy_clip import clip_problems
from megatron_grpo.config.reward_model_checks import reward_model_problems
from megatron_grpo.config.schema import Config, ParallelConfig
from megatron_grpo.errors import ConfigError

GROUP_ESTIMATORS = ("grpo", "rloo")  # need >= 2 samples per prompt to form a baseline
# algorithm.filter_groups.metric: the reward function's own score, or the score with the overlong penalty
PENALISED_FILTER_METRICS = ("seq_reward", "seq_final_reward")
FILTER_METRICS = ("acc", "score", *PENALISED_FILTER_METRICS)

# Keys the schema knows (verl has them) but the trainer does not act on yet. Setting one away from
# its default is a config error instead of being silently ignored; their values are not checked
# otherwise. A key leaves this list in the change that wires it.
NOT_YET_WIRED = (
    "model.trust_remote_code", "data.apply_chat_template",
    "actor.shuffle", "reward.format_score", "checkpoint.async_save", "logging.log_interval",
    "logging.wandb_entity", "logging.wandb_mode", "eval.val_batch_size",
)

def validate(config: Config, world_size: Optional[int] = None, ranks_per_node: Optional[int] = None) -> None:
    """Raises one ConfigError listing every cross-field problem; returns None if there is none.
    `ranks_per_node`: trainer ranks (GPUs) per node, for the colocated placement (with world_size)."""
    problems: list[str] = []
    for check in (_unwired, _model, _parallel, _data, _rollout, _multi_turn, _algorithm, _actor, _reward,
                  _checkpoint, _trainer, _eval):
        check(config, problems)
    if world_size is not None:
        _world(config, world_size, problems)
        _colocated_placement(config, world_size, ranks_per_node, problems)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} config problems: " + "; ".join(problems))


def config_warnings(config: Config, total_steps: Optional[int] = None) -> list[str]:
    """What validates but is likely not what was meant, one line each: `config show` prints them, the
    trainer logs them once the run's length is known (`total_steps`: trainer.total_steps, or the
    steps of trainer.total_epochs over the prompts)."""
    lines = []
    o = config.actor.optim
    total = total_steps if total_steps is not None else config.trainer.total_steps
    # A warning, not an error: a short try of a recipe (trainer.total_steps=3 with its 10-step warmup) is
    # a normal thing to run, and it trains, only at a fraction of the learning rate.
    if o.lr_warmup_steps > 0 and total is not None and o.lr_warmup_steps >= total:
        lines.append(f"actor.optim.lr_warmup_steps={o.lr_warmup_steps} >= the run's {total} steps: the whole run "
                     f"is warmup, the learning rate rises from 0 and never reaches actor.optim.lr={o.lr:g}"
                     + (" (the cosine decay never starts)" if o.lr_scheduler == "cosine" else ""))
    return lines


def _unwired(c: Config, out: list[str]) -> None:
    changed = [f"{key}={value!r} (default {default!r})" for key, value, default in values_at(c, NOT_YET_WIRED)
               if value != default]
    if changed:
        out.append("not implemented in the trainer yet, set back to the default: " + "; ".join(changed))


def training_data_problem(c: Config) -> Optional[str]:
    """The one check that there is something to train on (also asked when prompts are loaded)."""
    if not c.data.train_files and c.data.task is None:
        return "no training data: set data.train_files or data.task"
    return None


def _model(c: Config, out: list[str]) -> None:
    m = c.model
    if m.path is None and m.config_path is None and not m.override_config:
        out.append("no model: set model.path (HF folder or hub id) or model.config_path (random init)")
    if m.dtype == "float16":
        out.append("model.dtype=float16 is not supported: the trainer runs float32 or bfloat16 (fp16 would "
                   "need loss scaling); use bfloat16 on GPU")
    if m.make_vocab_size_divisible_by < 1:
        out.append(f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by} must be >= 1")
    if m.recompute_num_layers < 1:
        out.append(f"model.recompute_num_layers={m.recompute_num_layers} must be >= 1")
    # Whether te / torch_varlen can run on this node (TE imports, CUDA, torch's varlen_attn) is checked
    # when the model is built (models/spec.py resolve_backend); here only what the recipe says.
    if m.attention_backend in ("te", "torch_varlen") and c.trainer.device == "cpu":
        out.append(f"model.attention_backend={m.attention_backend} needs CUDA ("
                   + ("Transformer Engine" if m.attention_backend == "te" else "torch's FlashAttention varlen kernel")
                   + "), but trainer.device=cpu: set model.attention_backend=local (or auto)")
    if m.attention_backend == "torch_varlen" and m.dtype == "float32":
        out.append("model.attention_backend=torch_varlen needs model.dtype=bfloat16 (or auto on GPU): FlashAttention "
                   "has no float32 kernel; use model.attention_backend=local for float32")
    dims = model_dims(m)
    p = c.parallel
    _moe_sizes(dims, p, out)
    out.extend(lora_problems(c))
    if p.tensor < 1 or p.pipeline < 1:
        return  # refused by _parallel; nothing divides by them
    if dims.num_attention_heads is not None and dims.num_attention_heads % p.tensor:
        out.append(f"the model's {dims.num_attention_heads} attention heads are not divisible by "
                   f"parallel.tensor={p.tensor}")
    if dims.num_query_groups is not None and dims.num_query_groups % p.tensor:
        out.append(f"the model's {dims.num_query_groups} query groups (num_key_value_heads) are not "
                   f"divisible by parallel.tensor={p.tensor}")
    stages = p.pipeline * (p.virtual_pipeline or 1)
    if dims.num_layers is not None and dims.num_layers % stages:
        out.append(f"the model's {dims.num_layers} layers are not divisible by parallel.pipeline x "
                   f"virtual_pipeline = {p.pipeline} x {p.virtual_pipeline or 1}")


def _moe_sizes(dims: ModelDims, p: ParallelConfig, out: list[str]) -> None:
    """A mixture-of-experts model's sizes (config.json or model.override_config): each >= 1, top-k
    within the experts, the experts split over parallel.expert."""
    if dims.model_type is None or dims.model_type in DENSE_MODEL_TYPES:
        return  # (a dense model's config may carry num_experts=0)
    bad = [key for key, value in dims.moe.items() if value < 1]
    for key in bad:
        out.append(f"{key}={dims.moe[key]} in {dims.source[key]} must be >= 1 (model_type {dims.model_type!r} is a "
                   f"mixture-of-experts model)")
    experts_key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in dims.moe), None)
    if experts_key is None or experts_key in bad:
        return
    experts, top_k = dims.moe[experts_key], dims.moe.get("num_experts_per_tok")
    if top_k is not None and top_k > experts:
        out.append(f"num_experts_per_tok={top_k} in {dims.source['num_experts_per_tok']} must be <= "
                   f"{experts_key}={experts}")
    if p.expert >= 1 and experts % p.expert:
        out.append(f"parallel.expert={p.expert} does not divide the model's {experts_key}={experts} "
                   f"({dims.source[experts_key]})")


def _parallel(c: Config, out: list[str]) -> None:
    p = c.parallel
    for name in ("tensor", "pipeline", "context"):
        if getattr(p, name) < 1:
            out.append(f"parallel.{name}={getattr(p, name)} must be >= 1")
    if p.virtual_pipeline is not None:
        if p.virtual_pipeline < 1:
            out.append(f"parallel.virtual_pipeline={p.virtual_pipeline} must be >= 1 or null")
        elif p.pipeline < 2:
            out.append("parallel.virtual_pipeline needs parallel.pipeline >= 2")
    if p.expert < 1:
        out.append(f"parallel.expert={p.expert} must be >= 1")
    if p.expert_tensor is not None and p.expert_tensor < 1:
        out.append(f"parallel.expert_tensor={p.expert_tensor} must be >= 1 or null (= parallel.tensor)")
    dense = _dense_model_type(c.model)
    if dense is not None and p.expert > 1:
        out.append(f"parallel.expert={p.expert}: model_type {dense!r} has no experts (expert parallelism needs a "
                   f"mixture-of-experts model); set parallel.expert=1")
    if dense is not None and c.actor.moe_routing_replay:
        out.append(f"actor.moe_routing_replay=true: model_type {dense!r} has no experts (routing replay needs a "
                   f"mixture-of-experts model); set it to false")
    if c.actor.moe_routing_replay and c.rollout.engine == "sglang" and (c.rollout.sglang.router
                                                                         or c.rollout.sglang.router_url):
        # sglang-router 0.3.2 forwards /generate without return_routed_experts (measured,
        # tests/test_sglang_routing_replay.py): no routes would come back
        out.append("actor.moe_routing_replay=true with the sglang-router (rollout.sglang.router / router_url): the "
                   "router drops return_routed_experts, so no routes would come back; set "
                   "rollout.sglang.router=false and no router_url (the trainer spreads requests over the engines "
                   "itself)")
    if p.sequence_parallel and p.tensor < 2:
        out.append("parallel.sequence_parallel=true needs parallel.tensor >= 2")


# models/architectures.py's dense model types (tied by tests/test_config.py; config/ imports no models/).
DENSE_MODEL_TYPES = ("qwen2", "qwen3", "llama")


def _dense_model_type(m) -> Optional[str]:
    """The model_type when it is known here (model.override_config or a local config.json) and dense."""
    model_type = m.override_config.get("model_type")
    if model_type is None:
        file = hf_config_file(m)
        if file is not None:
            try:
                model_type = json.loads(file.read_text(encoding="utf-8")).get("model_type")
            except (OSError, ValueError, AttributeError):
                return None  # model_dims reports an unreadable config.json
    return model_type if model_type in DENSE_MODEL_TYPES else None


def _data(c: Config, out: list[str]) -> None:
    d = c.data
    problem = training_data_problem(c)
    if problem:
        out.append(problem)
    for name in ("max_prompt_length", "max_response_length", "train_batch_size"):
        if getattr(d, name) < 1:
            out.append(f"data.{name}={getattr(d, name)} must be >= 1")
    for name in ("train_files", "val_files"):
        empty = [i for i, path in enumerate(getattr(d, name)) if not str(path).strip()]
        if empty:
            out.append(f"data.{name}: entry {empty[0]} is an empty path (a shell variable that was not set?); "
                       "give a .jsonl or .parquet file, or leave the key out")


def _rollout(c: Config, out: list[str]) -> None:
    r = c.rollout
    if r.n < 1:
        out.append(f"rollout.n={r.n} must be >= 1")
    if r.temperature <= 0:
        out.append(f"rollout.temperature={r.temperature} must be > 0 (log-probs use logits / temperature)")
    if not 0 < r.top_p <= 1:
        out.append(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if r.top_k != -1 and r.top_k < 1:
        out.append(f"rollout.top_k={r.top_k} must be -1 (off) or >= 1")
    if not 0 <= r.min_p < 1:
        out.append(f"rollout.min_p={r.min_p} must be in [0, 1)")
    _sampling_replay(c, out)
    if r.max_new_tokens is not None and not 1 <= r.max_new_tokens <= c.data.max_response_length:
        out.append(f"rollout.max_new_tokens={r.max_new_tokens} must be in [1, data.max_response_length="
                   f"{c.data.max_response_length}]")
    if r.weight_bucket_mb < 1:
        out.append(f"rollout.weight_bucket_mb={r.weight_bucket_mb} must be >= 1")
    if r.local.max_batch_size is not None and r.local.max_batch_size < 1:
        out.append(f"rollout.local.max_batch_size={r.local.max_batch_size} must be >= 1 or null")
    if r.local.threads < 1:
        out.append(f"rollout.local.threads={r.local.threads} must be >= 1")
    _asynchronous(c, out)
    _long_tail(c, out)
    if r.engine == "sglang":
        _sglang(c, out)


def _long_tail(c: Config, out: list[str]) -> None:
    """rollout.long_tail: over-sampling and partial rollouts (trainer/rollouts/long_tail.py)."""
    lt = c.rollout.long_tail
    if lt.over_sampling_groups < 0:
        out.append(f"rollout.long_tail.over_sampling_groups={lt.over_sampling_groups} must be >= 0 (0 = off)")
    if lt.over_sampling_groups == 0 and (lt.partial_rollout or lt.allow_off_policy):
        out.append("rollout.long_tail.partial_rollout / allow_off_policy need rollout.long_tail.over_sampling_groups "
                   "> 0 (partial rollouts are what the over-sampling's abort leaves)")
        return
    if lt.over_sampling_groups == 0:
        return
    if lt.partial_rollout and c.actor.moe_routing_replay:
        out.append("rollout.long_tail.partial_rollout with actor.moe_routing_replay=true: a continued sequence's "
                   "prefix would be routed again under the new weights, not as it was generated; turn one off")
    if lt.partial_rollout and not rollouts_run_ahead(c) and not lt.allow_off_policy:
        out.append("rollout.long_tail.partial_rollout=true with rollout.max_staleness=0: carried tokens come from the "
                   "previous weights, which makes the on-policy step off-policy by one version; set "
                   "rollout.long_tail.allow_off_policy=true to accept that, or use max_staleness >= 1")


# SGLang returns sampling supports only for a finite top_k <= --sampling-mask-max-tokens (default 4096).
SGLANG_SAMPLING_MASK_MAX_TOKENS = 4096


def _sampling_replay(c: Config, out: list[str]) -> None:
    r = c.rollout
    replay = sampling_replay_enabled(c)
    if r.sampling_replay == "on" and not replay:
        out.append("rollout.sampling_replay=on but sampling is not truncated (rollout.top_p=1, rollout.top_k=-1, "
                   "rollout.min_p=0): there is no support to replay; set one of them or sampling_replay=off/auto")
    if replay and r.engine == "sglang" and not 1 < r.top_k <= SGLANG_SAMPLING_MASK_MAX_TOKENS:
        out.append(f"rollout.sampling_replay={r.sampling_replay} (on: sampling is truncated) needs rollout.top_k in "
                   f"[2, {SGLANG_SAMPLING_MASK_MAX_TOKENS}] with SGLang, got {r.top_k}: SGLang returns each token's "
                   f"sampling support only for a finite top_k (return_sampling_mask; raise --sampling-mask-max-tokens "
                   f"for more); set rollout.top_k, or rollout.sampling_replay=off to train on the full distribution")
    if replay and r.multi_turn.environment is not None:
        out.append("rollout.sampling_replay=on is not supported with rollout.multi_turn yet (observation tokens have "
                   "no support); set rollout.sampling_replay=auto or off")
    if replay and r.top_k == 1:
        out.append("rollout.sampling_replay=on with rollout.top_k=1: every support is one token, so every log-prob "
                   "is 0 and nothing trains; set rollout.sampling_replay=auto or off")


def _asynchronous(c: Config, out: list[str]) -> None:
    """rollout.max_staleness and the weight-sync route need an engine that can take them."""
    r = c.rollout
    if r.max_staleness < 0:
        out.append(f"rollout.max_staleness={r.max_staleness} must be >= 0 (0 = on-policy, synchronous)")
    in_process = r.engine == "local" and r.local.process is False
    if rollouts_run_ahead(c) and in_process:
        out.append(f"rollout.max_staleness={r.max_staleness} needs the local engine in its own process to generate "
                   f"while the trainer trains: rollout.local.process=false runs it in the trainer's")
    if rollouts_run_ahead(c) and r.engine == "sglang" and r.sglang.weight_sync == "tensor":
        out.append("rollout.max_staleness > 0 with rollout.sglang.weight_sync=tensor: colocated engines give the GPU "
                   "to training, so they cannot generate during it; use weight_sync=distributed")
    tensor = r.engine == "sglang" and r.sglang.weight_sync == "tensor"
    if r.weight_sync_route == "colocated" and not tensor:
        out.append("rollout.weight_sync_route=colocated feeds SGLang engines on the trainer's GPUs: it needs "
                   "rollout.engine=sglang with rollout.sglang.weight_sync=tensor")
    if r.weight_sync_route == "per_stage":
        if r.engine == "local" and (in_process or (r.local.process is None and not rollouts_run_ahead(c))):
            out.append("rollout.weight_sync_route=per_stage needs the local engine in its own process "
                       "(rollout.local.process=true): in the trainer's process only rank 0 can reach it")
        if r.engine == "sglang" and r.sglang.weight_sync != "distributed":
            out.append(f"rollout.weight_sync_route=per_stage with rollout.sglang.weight_sync={r.sglang.weight_sync}: "
                       "each stage's sender broadcasts to the engines only with weight_sync=distributed "
                       "(use rank0 or auto)")


def _sglang(c: Config, out: list[str]) -> None:
    s = c.rollout.sglang
    bad_urls = [u for u in s.urls if not u.startswith(("http://", "https://"))]
    if bad_urls:
        out.append(f"rollout.sglang.urls: {bad_urls[0]!r} must start with http:// or https://")
    for name in ("num_engines", "tp_size", "max_concurrency"):
        if getattr(s, name) < 1:
            out.append(f"rollout.sglang.{name}={getattr(s, name)} must be >= 1")
    if s.max_retries < 0:
        out.append(f"rollout.sglang.max_retries={s.max_retries} must be >= 0")
    if not 0 < s.mem_fraction <= 1:
        out.append(f"rollout.sglang.mem_fraction={s.mem_fraction} must be in (0, 1]")
    for name in ("port", "router_port"):
        if not 1 <= getattr(s, name) <= 65535:
            out.append(f"rollout.sglang.{name}={getattr(s, name)} is not a TCP port")
    for name in ("startup_timeout_s", "request_timeout_s", "weight_update_timeout_s", "health_check_timeout_s"):
        if getattr(s, name) <= 0:
            out.append(f"rollout.sglang.{name}={getattr(s, name)} must be > 0")
    for name in ("verify_interval", "health_check_interval_s"):
        if getattr(s, name) < 0:
            out.append(f"rollout.sglang.{name}={getattr(s, name)} must be >= 0 (0 = off)")
    if s.router and s.urls and not s.router_url:
        out.append("rollout.sglang.router=true with rollout.sglang.urls: the trainer launches a router only for "
                   "the servers it launches itself; give the running router's rollout.sglang.router_url "
                   "(slurm/ scripts do), or set router=false")
    if c.rollout.min_p > 0 and s.deterministic_inference:
        # deterministic inference forces SGLang's torch sampler, which asserts on a seed with min_p
        # (sglang 0.5.23 layers/sampler.py): the server dies at the first such request
        out.append(f"rollout.min_p={c.rollout.min_p} with rollout.sglang.deterministic_inference=true: SGLang's "
                   f"deterministic sampler cannot apply min_p to a seeded request (the server stops); set "
                   f"rollout.min_p=0 or rollout.sglang.deterministic_inference=false")
    if sampling_replay_enabled(c) and (s.router or s.router_url):
        # sglang-router 0.3.2 forwards /generate without return_sampling_mask (measured): no supports
        out.append(f"rollout.sampling_replay={c.rollout.sampling_replay} (on: sampling is truncated) with the "
                   f"sglang-router: the router drops return_sampling_mask, so no support would come back; "
                   f"set rollout.sglang.router=false (the trainer spreads requests itself) or "
                   f"rollout.sampling_replay=off")
    _cpu_engines(c, out)
    engines = len(s.urls) or s.num_engines
    if not 1 <= s.min_engines <= engines:
        out.append(f"rollout.sglang.min_engines={s.min_engines} must be between 1 and the number of engines "
                   f"({engines})")


def _cpu_engines(c: Config, out: list[str]) -> None:
    """What SGLang 0.5.23 cannot do on a CPU (measured, docs/testing.md: SGLang's runtime on a CPU)."""
    s = c.rollout.sglang
    if s.max_total_tokens is not None and s.max_total_tokens < longest_sequence(c):
        out.append(f"rollout.sglang.max_total_tokens={s.max_total_tokens} is below the longest sequence "
                   f"({longest_sequence(c)} tokens: data.max_prompt_length + data.max_response_length, or "
                   f"rollout.multi_turn.max_length): no such sequence would fit the engine's KV cache")
    if s.cpu_threads < 1:
        out.append(f"rollout.sglang.cpu_threads={s.cpu_threads} must be >= 1 (OpenMP threads of a CPU engine)")
    if s.device != "cpu" or s.urls:
        return
    if s.deterministic_inference:
        out.append("rollout.sglang.device=cpu with rollout.sglang.deterministic_inference=true: SGLang 0.5.23 starts "
                   "deterministic inference only with a GPU attention backend (triton, flashinfer, fa3, ...) and "
                   "refuses torch_native, the CPU's; set rollout.sglang.deterministic_inference=false")
    if c.actor.moe_routing_replay:
        out.append("rollout.sglang.device=cpu with actor.moe_routing_replay=true: SGLang 0.5.23's routed-experts "
                   "capturer registers pinned host memory through CUDA and the engine does not start on a CPU; "
                   "set actor.moe_routing_replay=false")


def _algorithm(c: Config, out: list[str]) -> None:
    a = c.algorithm
    problem = check_name("algorithm.adv_estimator", a.adv_estimator, ADVANTAGE_ESTIMATORS)
    if problem:
        out.append(problem)
    if a.adv_estimator in GROUP_ESTIMATORS and c.rollout.n < 2:
        out.append(f"algorithm.adv_estimator={a.adv_estimator} needs rollout.n >= 2 samples per prompt "
                   f"(got {c.rollout.n}; verl's GRPO examples use 5)")
    if a.filter_groups.metric not in FILTER_METRICS:
        out.append(f"algorithm.filter_groups.metric={a.filter_groups.metric!r} must be one of "
                   f"{', '.join(FILTER_METRICS)} (acc and score: the reward function's score; seq_reward and "
                   f"seq_final_reward: with the overlong penalty)")
    if a.filter_groups.max_num_gen_batches < 0:
        out.append(f"algorithm.filter_groups.max_num_gen_batches={a.filter_groups.max_num_gen_batches} "
                   f"must be >= 0 (0 = no limit)")
    if a.use_kl_in_reward:
        _kl_in_reward(c, out)


def _kl_in_reward(c: Config, out: list[str]) -> None:
    a, k = c.algorithm, c.algorithm.kl_ctrl
    if k.kl_coef < 0:
        out.append(f"algorithm.kl_ctrl.kl_coef={k.kl_coef} must be >= 0 (the penalty's starting weight)")
    if k.type == "adaptive":
        for name in ("target_kl", "horizon"):
            if getattr(k, name) <= 0:
                out.append(f"algorithm.kl_ctrl.{name}={getattr(k, name)} must be > 0 with "
                           f"algorithm.kl_ctrl.type=adaptive (verl's AdaptiveKLController divides by it)")
    if a.filter_groups.enable and a.filter_groups.metric in PENALISED_FILTER_METRICS:
        out.append(f"algorithm.filter_groups.metric={a.filter_groups.metric} with algorithm.use_kl_in_reward=true: "
                   "the group filter runs before the policy's log-probs exist, so it cannot read the "
                   "KL-penalised reward verl's DAPO trainer filters on; use metric acc or score")


def _actor(c: Config, out: list[str]) -> None:
    a = c.actor
    problem = check_name("actor.policy_loss.loss_mode", a.policy_loss.loss_mode, POLICY_LOSSES)
    if problem:
        out.append(problem)
    mini, batch = a.ppo_mini_batch_size, c.data.train_batch_size
    if mini < 1:
        out.append(f"actor.ppo_mini_batch_size={mini} must be >= 1")
    elif batch % mini:
        out.append(f"data.train_batch_size={batch} is not divisible by actor.ppo_mini_batch_size={mini} "
                   f"(both count prompts; x rollout.n={c.rollout.n} sequences)")
    micro, tokens = a.ppo_micro_batch_size_per_gpu, a.max_tokens_per_micro_batch
    if (micro is None) == (tokens is None):
        out.append("set exactly one of actor.ppo_micro_batch_size_per_gpu and "
                   f"actor.max_tokens_per_micro_batch (got {micro} and {tokens}; null the other)")
    if micro is not None and micro < 1:
        out.append(f"actor.ppo_micro_batch_size_per_gpu={micro} must be >= 1")
    longest = c.data.max_prompt_length + c.data.max_response_length
    if tokens is not None and tokens < longest:
        out.append(f"actor.max_tokens_per_micro_batch={tokens} is below the longest sequence "
                   f"(max_prompt_length + max_response_length = {longest})")
    for key, budget in (("ref.max_tokens_per_micro_batch", c.ref.max_tokens_per_micro_batch),
                        ("actor.logprob_max_tokens_per_micro_batch", a.logprob_max_tokens_per_micro_batch)):
        if budget is not None and budget < longest:
            out.append(f"{key}={budget} is below the longest sequence ({longest})")
    if a.ppo_epochs < 1:
        out.append(f"actor.ppo_epochs={a.ppo_epochs} must be >= 1")
    if a.old_logprob_check_interval < 0:
        out.append(f"actor.old_logprob_check_interval={a.old_logprob_check_interval} must be >= 0 (0 = never)")
    out += clip_problems(a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.tis_cap, prefix="actor.")
    if a.kl_loss_coef < 0:
        out.append(f"actor.kl_loss_coef={a.kl_loss_coef} must be >= 0")
    if a.loss_scale_factor is not None and a.loss_scale_factor <= 0:
        out.append(f"actor.loss_scale_factor={a.loss_scale_factor} must be > 0 or null")
    _off_policy(c, out)
    if a.grad_clip is not None and a.grad_clip <= 0:
        out.append(f"actor.grad_clip={a.grad_clip} must be > 0 or null (off)")
    _optim(c, out)


def _off_policy(c: Config, out: list[str]) -> None:
    o = c.actor.off_policy
    out.extend(o.problems("actor.off_policy"))
    if o.is_level not in (None, "auto") and c.actor.tis_cap is not None:
        out.append("actor.tis_cap and actor.off_policy.is_level are both set: actor.tis_cap is token-level "
                   "truncated IS (actor.off_policy.is_level=token, is_cap); set one")
    if c.parallel.context > 1 and (o.is_level == "sequence" or o.rs_level in ("sequence", "geometric")):
        out.append("actor.off_policy: sequence / geometric levels need whole responses on a rank "
                   f"(parallel.context={c.parallel.context} splits them); use the token level")


def _optim(c: Config, out: list[str]) -> None:
    o = c.actor.optim
    if o.lr <= 0:
        out.append(f"actor.optim.lr={o.lr} must be > 0")
    if not 0 <= o.min_lr <= o.lr:
        out.append(f"actor.optim.min_lr={o.min_lr} must be in [0, lr={o.lr}]")
    if o.weight_decay < 0:
        out.append(f"actor.optim.weight_decay={o.weight_decay} must be >= 0")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        out.append(f"actor.optim.betas={o.betas} must be two numbers in [0, 1)")
    if o.eps <= 0:
        out.append(f"actor.optim.eps={o.eps} must be > 0")
    if o.lr_warmup_steps < 0:
        out.append(f"actor.optim.lr_warmup_steps={o.lr_warmup_steps} must be >= 0")


def _multi_turn(c: Config, out: list[str]) -> None:
    m = c.rollout.multi_turn
    key = "rollout.multi_turn"
    if m.environment is None:
        keys = [f"{key}.{name}" for name in field_types(type(m)) if name != "environment"]
        changed = [f"{k}={value!r}" for k, value, default in values_at(c, keys) if value != default]
        if changed:
            out.append(f"{key}.environment is not set (multi-turn is off), but {', '.join(changed)} "
                       f"{'is' if len(changed) == 1 else 'are'} set and would have no effect: set {key}.environment "
                       "or leave them out")
        return
    spec = m.environment.strip()
    target, sep, name = spec.rpartition(":")
    if ":" in spec and (not sep or not target or not name):
        out.append(f"{key}.environment={m.environment!r}: expected a built-in name, 'pkg.module:Class' or "
                   "'path/to/file.py:Class'")
    if m.max_turns < 1:
        out.append(f"{key}.max_turns={m.max_turns} must be >= 1")
    if m.max_new_tokens_per_turn is not None and m.max_new_tokens_per_turn < 1:
        out.append(f"{key}.max_new_tokens_per_turn={m.max_new_tokens_per_turn} must be >= 1 or null")
    max_length = m.max_length or c.data.max_prompt_length + c.data.max_response_length
    if max_length <= c.data.max_prompt_length:
        out.append(f"{key}.max_length={max_length} leaves no room for a turn after a "
                   f"data.max_prompt_length={c.data.max_prompt_length} prompt")
    if m.step_timeout_s <= 0:
        out.append(f"{key}.step_timeout_s={m.step_timeout_s} must be > 0")
    if not 0 < m.discount <= 1:
        out.append(f"{key}.discount={m.discount} must be in (0, 1]")
    if m.turn_reward == "sum" and m.discount != 1.0:
        out.append(f"{key}.discount={m.discount} has no effect with turn_reward=sum; set turn_reward=discounted")
    if c.actor.moe_routing_replay:
        out.append(f"{key}.environment with actor.moe_routing_replay=true is not supported (the routes of "
                   "observation tokens are not recorded)")


def _reward(c: Config, out: list[str]) -> None:
    r = c.reward
    builtin = REWARD_FUNCTIONS.known()
    if r.function not in builtin:
        target, sep, fn = r.function.rpartition(":")
        if not sep:
            out.append(unknown_name("reward.function", r.function, REWARD_FUNCTIONS.kind, builtin)
                       + "; or 'pkg.module:fn' / 'path/to/file.py:fn'")
        elif not target or not fn.isidentifier():
            out.append(f"reward.function={r.function!r} must be one of {', '.join(builtin)}, "
                       f"'pkg.module:fn' or 'path/to/file.py:fn'")
    if not 0 <= r.max_error_frac <= 1:
        out.append(f"reward.max_error_frac={r.max_error_frac} must be in [0, 1] (1 = never stop)")
    if r.num_workers < 0:
        out.append(f"reward.num_workers={r.num_workers} must be >= 0 (0 = in-process)")
    if r.timeout_s <= 0:
        out.append(f"reward.timeout_s={r.timeout_s} must be > 0")
    out.extend(reward_model_problems(r.models, r.combine, c.rollout.multi_turn.environment))
    b = r.overlong_buffer
    if b.enable:
        cap = overlong_cap(c)
        if b.len <= 0:
            out.append(f"reward.overlong_buffer.len={b.len} must be > 0 with reward.overlong_buffer.enable=true")
        elif b.len > cap:
            out.append(f"reward.overlong_buffer.len={b.len} is longer than the response cap {cap} "
                       "(reward.overlong_buffer.max_response_length, else data.max_response_length)")


def _checkpoint(c: Config, out: list[str]) -> None:
    k = c.checkpoint
    if k.save_interval != -1 and k.save_interval < 1:
        out.append(f"checkpoint.save_interval={k.save_interval} must be -1 (off) or >= 1")
    if k.keep_last is not None and k.keep_last < 1:
        out.append(f"checkpoint.keep_last={k.keep_last} must be >= 1 or null (keep all)")
    if not k.resume.strip():
        out.append("checkpoint.resume must be auto, force, never or a checkpoint folder (got an empty string)")


def _trainer(c: Config, out: list[str]) -> None:
    t = c.trainer
    if t.total_epochs < 1:
        out.append(f"trainer.total_epochs={t.total_epochs} must be >= 1")
    if t.total_steps is not None and t.total_steps < 1:
        out.append(f"trainer.total_steps={t.total_steps} must be >= 1 or null")
    if t.max_consecutive_nan_steps < 1:
        out.append(f"trainer.max_consecutive_nan_steps={t.max_consecutive_nan_steps} must be >= 1")
    if t.preflight_rounds < 2:
        out.append(f"trainer.preflight_rounds={t.preflight_rounds} must be >= 2 (the trend compares the first "
                   f"round with the last)")
    if t.num_threads is not None and t.num_threads < 1:
        out.append(f"trainer.num_threads={t.num_threads} must be >= 1 or null")
    if not t.hang_timeout_s >= 10:  # also NaN: the watchdog looks once a second
        out.append(f"trainer.hang_timeout_s={t.hang_timeout_s} must be >= 10 (seconds)")


def _eval(c: Config, out: list[str]) -> None:
    e = c.eval
    if e.interval != -1 and e.interval < 1:
        out.append(f"eval.interval={e.interval} must be -1 (off) or >= 1")
    if (e.interval != -1 or e.before_train) and not c.data.val_files and c.data.task is None:
        out.append("eval is on but there is no validation data: set data.val_files (or data.task)")
    if e.n_samples < 1:
        out.append(f"eval.n_samples={e.n_samples} must be >= 1")
    if e.greedy and e.n_samples > 1:
        out.append(f"eval.greedy=true gives {e.n_samples} identical samples; set eval.n_samples=1 or "
                   "eval.greedy=false")
    if not e.greedy and e.temperature <= 0:
        out.append(f"eval.temperature={e.temperature} must be > 0 when eval.greedy=false")
    bad = [k for k in e.pass_k if not 1 <= k <= e.n_samples]
    if bad:
        out.append(f"eval.pass_k={e.pass_k}: each k must be in [1, eval.n_samples={e.n_samples}]")


def _colocated_placement(c: Config, world_size: int, ranks_per_node: Optional[int], out: list[str]) -> None:
    """weight_sync=tensor: every engine TP rank sits on a trainer GPU (rollout/sglang/colocated.py
    places engine k on GPUs k*tp_size.. of the trainer's nodes, in order)."""
    s = c.rollout.sglang
    if c.rollout.engine != "sglang" or s.weight_sync != "tensor":
        return
    engines = len(s.urls) or s.num_engines
    what = (f"{engines} colocated engine(s) x rollout.sglang.tp_size={s.tp_size} (rollout.sglang.weight_sync=tensor: "
            f"every engine GPU is a trainer GPU)")
    if engines * s.tp_size > world_size:
        out.append(f"{what} need {engines * s.tp_size} GPUs; the trainer has {world_size} ranks")
        return
    if ranks_per_node is None:
        return
    if ranks_per_node < 1 or world_size % ranks_per_node:
        out.append(f"world size {world_size} is not a multiple of {ranks_per_node} ranks per node")
    elif ranks_per_node % s.tp_size:
        out.append(f"{what}: tp_size {s.tp_size} does not divide the {ranks_per_node} trainer GPUs of a node "
                   f"(an engine spans one node's GPUs)")
    elif not s.urls and engines * s.tp_size > ranks_per_node:
        out.append(f"{what}: engines launched by the trainer run on rank 0's node, which has {ranks_per_node} "
                   f"trainer GPUs; give the engines by rollout.sglang.urls (slurm/ scripts do) or use fewer")


def _world(c: Config, world_size: int, out: list[str]) -> None:
    p = c.parallel
    if min(p.tensor, p.pipeline, p.context, p.expert, p.expert_tensor or 1) < 1:
        return  # refused by _parallel; nothing divides by them
    model_parallel = p.tensor * p.pipeline * p.context
    if world_size < 1 or world_size % model_parallel:
        out.append(f"world size {world_size} is not divisible by parallel.tensor x pipeline x context = "
                   f"{p.tensor} x {p.pipeline} x {p.context}")
        return
    expert_ranks = p.expert * (p.expert_tensor or p.tensor) * p.pipeline
    if world_size % expert_ranks:
        out.append(f"world size {world_size} is not divisible by parallel.expert x expert_tensor x pipeline = "
                   f"{p.expert} x {p.expert_tensor or p.tensor} x {p.pipeline}")
        return
    dp = world_size // model_parallel
    per_step = c.actor.ppo_mini_batch_size * c.rollout.n  # sequences per mini-batch
    if per_step % dp:
        out.append(f"a mini-batch of actor.ppo_mini_batch_size x rollout.n = {per_step} sequences is not "
                   f"divisible by the data-parallel size {dp}")
        return
    micro = c.actor.ppo_micro_batch_size_per_gpu
    if micro is not None and micro >= 1 and (per_step // dp) % micro:
        out.append(f"{per_step // dp} sequences per data-parallel rank per mini-batch are not divisible by "
                   f"actor.ppo_micro_batch_size_per_gpu={micro}")
