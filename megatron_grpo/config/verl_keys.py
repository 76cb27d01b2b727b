"""verl's config keys and what each is here: one table behind `config from-verl`, the "verl's X is Y
here" hints for unknown keys, and the table of docs/verl.md (`config verl-keys`).

The table covers every key of verl 0.9.1's ppo_trainer.yaml and ppo_megatron_trainer.yaml (their
flattened forms, _generated_ppo_trainer.yaml / _generated_ppo_megatron_trainer.yaml): each key
either translates (`ours` non-empty) or says why it has no equivalent here. tests/test_verl_keys.py
checks the table against the key lists in tests/data/ (tools/verl_key_list.py writes them).

A row's `verl` is a dotted key or a pattern in which `*` stands for any run of characters (dots
included); a key matches its exact row first, else the most specific pattern (the most literal
characters). A converter gets the value, every verl key given (some meanings depend on another
key, as in verl: ppo_max_token_len_per_gpu counts only with use_dynamic_bsz) and the key itself.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

VERL_VERSION = "0.9.1"
FROM_VERL = "`megatron-grpo config from-verl` translates a whole verl command line or YAML"


@dataclass(frozen=True)
class Translation:
    values: Mapping[str, Any]    # our dotted key -> value
    note: Optional[str] = None   # a change of meaning the user should read (vllm -> sglang ...)


Converter = Callable[[Any, Mapping[str, Any], str], Translation]


@dataclass(frozen=True)
class VerlKey:
    verl: str                    # dotted verl key, or a pattern with `*`
    ours: tuple[str, ...] = ()   # the keys it sets here; () = no equivalent
    note: str = ""               # how the value translates, or why there is no equivalent
    convert: Optional[Converter] = field(default=None, compare=False)
    # not a key of verl 0.9.1's default config: written with `+key=...`, or from an older verl
    added: bool = False

    @property
    def is_pattern(self) -> bool:
        return "*" in self.verl

    def translate(self, value: Any, given: Mapping[str, Any], key: str) -> Translation:
        if self.convert is not None:
            return self.convert(value, given, key)
        return Translation({self.ours[0]: value})


def same(verl: str, ours: str, note: str = "", added: bool = False) -> VerlKey:
    return VerlKey(verl, (ours,), note, added=added)


def conv(verl: str, ours: tuple[str, ...], note: str, convert: Converter, added: bool = False) -> VerlKey:
    return VerlKey(verl, ours, note, convert, added)


def none(verl: str, why: str, added: bool = False) -> VerlKey:
    return VerlKey(verl, (), why, added=added)


# ---------------------------------------------------------------- converters

AR = "actor_rollout_ref"
ACTOR, ROLLOUT, REF, MODEL = f"{AR}.actor", f"{AR}.rollout", f"{AR}.ref", f"{AR}.model"
# verl's defaults that other keys' meanings depend on
VERL_DEFAULTS = {f"{ACTOR}.ppo_max_token_len_per_gpu": 16384, f"{ROLLOUT}.tensor_model_parallel_size": 2,
                 "trainer.n_gpus_per_node": 8, "trainer.nnodes": 1, f"{ACTOR}.optim.lr": 1e-6,
                 f"{AR}.hybrid_engine": True, "algorithm.rollout_correction.rollout_is_threshold": 2.0,
                 "custom_reward_function.name": "compute_score", "reward.custom_reward_function.name": "compute_score"}


def _get(given: Mapping[str, Any], key: str) -> Any:
    return given.get(key, VERL_DEFAULTS.get(key))


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _path(value: Any) -> Any:
    return os.path.expanduser(value) if isinstance(value, str) else value


def _paths(ours: str) -> Converter:
    def convert(value: Any, given: Mapping[str, Any], key: str) -> Translation:
        return Translation({ours: _path(value)})
    return convert


def _files(ours: str) -> Converter:
    def convert(value: Any, given: Mapping[str, Any], key: str) -> Translation:
        files = value if isinstance(value, list) else [value]
        return Translation({ours: [_path(f) for f in files]})
    return convert


def _token_budget(tokens: Any, given: Mapping[str, Any]) -> Translation:
    """verl's micro-batch holds ppo_max_token_len_per_gpu x ulysses_sequence_parallel_size tokens
    (verl/workers/engine/utils.py): the budget is per GPU after the Ulysses split, which the
    Megatron trainer does not make (context parallelism is parallel.context)."""
    sp = int(_get(given, f"{ACTOR}.ulysses_sequence_parallel_size") or 1)
    values = {"actor.max_tokens_per_micro_batch": int(tokens) * sp, "actor.ppo_micro_batch_size_per_gpu": None}
    if sp == 1:
        return Translation(values)
    return Translation(values, f"x ulysses_sequence_parallel_size={sp}: actor.max_tokens_per_micro_batch="
                               f"{int(tokens) * sp} (verl's budget is per GPU after the Ulysses split)")


def _dynamic_bsz(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if not _truthy(value):
        return Translation({})  # fixed micro-batches: ppo_micro_batch_size_per_gpu says how many
    budget = _token_budget(_get(given, f"{ACTOR}.ppo_max_token_len_per_gpu"), given)
    # the note goes with ppo_max_token_len_per_gpu when that is given (the header says it once)
    return Translation(budget.values) if f"{ACTOR}.ppo_max_token_len_per_gpu" in given else budget


def _max_token_len(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if _truthy(given.get(f"{ACTOR}.use_dynamic_bsz")):
        return _token_budget(value, given)
    return Translation({}, "ignored without use_dynamic_bsz=True, as in verl")


def _micro_batch(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if _truthy(given.get(f"{ACTOR}.use_dynamic_bsz")) or value is None:
        return Translation({})  # verl ignores it with dynamic batch sizes
    return Translation({"actor.ppo_micro_batch_size_per_gpu": value, "actor.max_tokens_per_micro_batch": None})


def _packing(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({"actor.packing": _truthy(value)})


def _truncation(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if _truthy(given.get("data.filter_overlong_prompts")):
        # filtered prompts are never over-long: verl's truncation never acts
        return Translation({}, "superseded by data.filter_overlong_prompts=True (data.truncation=filter)")
    if value == "middle":
        return Translation({"data.truncation": "error"}, "truncation='middle' is not supported: over-long "
                                                         "prompts are an error (or set data.truncation=left|right)")
    return Translation({"data.truncation": value})


def _filter_overlong(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({"data.truncation": "filter"} if _truthy(value) else {})


def _router_replay(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    mode = str(value).upper() if value is not None else "DISABLED"
    if mode == "R3":
        return Translation({"actor.moe_routing_replay": True})
    if mode == "R2":
        return Translation({"actor.moe_routing_replay": False}, "router_replay.mode=R2 (routes recorded in the "
                           "trainer's own old-log-prob pass) is not supported: R3 replays the rollout engine's routes")
    return Translation({"actor.moe_routing_replay": False})


def _rollout_engine(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if value == "hf":
        return Translation({"rollout.engine": "local"})
    if value not in ("sglang", "vllm", "trtllm"):
        return Translation({}, f"rollout engine {value!r} is unknown; rollout.engine is local or sglang")
    tp = int(_get(given, f"{ROLLOUT}.tensor_model_parallel_size"))
    gpus = int(_get(given, "trainer.n_gpus_per_node")) * int(_get(given, "trainer.nnodes"))
    values: dict[str, Any] = {"rollout.engine": "sglang", "rollout.sglang.num_engines": max(1, gpus // tp)}
    if _truthy(_get(given, f"{AR}.hybrid_engine")):
        values["rollout.sglang.weight_sync"] = "tensor"  # colocated on the trainer GPUs, as verl's hybrid engine
    note = (f"SGLang colocated as verl's hybrid engine: {values['rollout.sglang.num_engines']} engines of "
            f"{tp} GPUs on the {gpus} trainer GPUs")
    if value != "sglang":
        note = f"{value} is not supported here; {note}"
    return Translation(values, note)


def _loggers(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    names = [value] if isinstance(value, str) else list(value or [])
    values = {"logging.console": "console" in names, "logging.wandb": "wandb" in names,
              "logging.tensorboard": "tensorboard" in names}
    other = [n for n in names if n not in ("console", "wandb", "tensorboard")]
    return Translation(values,
                       f"loggers {other} are not supported (console, wandb, tensorboard are)" if other else None)


def _freq(ours: str) -> Converter:
    def convert(value: Any, given: Mapping[str, Any], key: str) -> Translation:
        return Translation({ours: value if isinstance(value, int) and value > 0 else -1})
    return convert


def _resume_mode(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if value == "disable":
        return Translation({"checkpoint.resume": "never"})
    if value == "resume_path":
        path = given.get("trainer.resume_from_path")
        return Translation({"checkpoint.resume": _path(path)} if path else {},
                           None if path else "resume_mode=resume_path without trainer.resume_from_path")
    return Translation({"checkpoint.resume": "auto"})


def _resume_path(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if value and given.get("trainer.resume_mode") == "resume_path":
        return Translation({})  # _resume_mode sets it
    return Translation({}, "read only with trainer.resume_mode=resume_path, as in verl" if value else None)


def _reward_function(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    section = key.rpartition(".")[0]
    path = given.get(f"{section}.path")
    if not path:
        return Translation({})  # no custom function: verl's default scorer (by_data_source)
    name = _get(given, f"{section}.name") or "compute_score"
    return Translation({"reward.function": f"{_path(path)}:{name}"})


def _reward_name(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({})  # read with .path (_reward_function)


def _under(ours: str) -> Converter:
    """A free-form subtree: verl's `<prefix>.a.b` is `ours.a.b` here."""
    def convert(value: Any, given: Mapping[str, Any], key: str) -> Translation:
        prefix = _matching_row(key).verl.rstrip("*").rstrip(".")
        return Translation({f"{ours}.{key[len(prefix) + 1:]}" if key != prefix else ours: value})
    return convert


# verl's megatron backend names megatron's fused layers; PEFT's projection names are what model.lora takes
_MEGATRON_LORA_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                          "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def _lora_targets(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    names = [value] if isinstance(value, str) else list(value or [])
    return Translation({"model.lora.target_modules": [p for n in names for p in _MEGATRON_LORA_TARGETS.get(n, (n,))]})


def _override_config(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    """verl applies override_config (its megatron workers: the model_config entry) to the HF config,
    also of a pretrained model; here it shapes only a model built from scratch (model.config_path)."""
    if f"{MODEL}.path" in given:
        return Translation({}, "no effect: with model.path the checkpoint's config.json is used as it is (the start "
                               "warns about a field set here that differs); verl would change the config")
    if key == f"{MODEL}.override_config":  # the whole mapping
        fields = value.get("model_config", value) if isinstance(value, dict) else value
        return Translation({"model.override_config": fields})
    field_name = key.removeprefix(f"{MODEL}.override_config.").removeprefix("model_config.")
    return Translation({f"model.override_config.{field_name}": value})


def _grad_checkpointing(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({"model.recompute_granularity": "full" if _truthy(value) else "none"})


def _recompute(ours: str) -> Converter:
    def convert(value: Any, given: Mapping[str, Any], key: str) -> Translation:
        return Translation({} if value is None else {ours: value})
    return convert


def _attention_backend(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    """megatron-core's AttnBackend: auto / local are ours too; flash / fused / unfused pick a kernel
    inside Transformer Engine's attention, which here is te (TE chooses its kernel itself)."""
    text = str(value).lower()
    if value is None or text.startswith("${"):
        return Translation({})
    if text in ("auto", "local"):
        return Translation({"model.attention_backend": text})
    if text in ("flash", "fused", "unfused"):
        return Translation({"model.attention_backend": "te"},
                           f"attention_backend={value}: Transformer Engine's attention (model.attention_backend=te), "
                           "which picks its own kernel")
    return Translation({}, f"attention_backend={value!r} is not a megatron-core attention backend (auto, local, "
                           "flash, fused, unfused); model.attention_backend stays auto")


def _sequence_parallel(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    tp = given.get(f"{ACTOR}.megatron.tensor_model_parallel_size", 1)
    if _truthy(value) and int(tp) > 1:
        return Translation({"parallel.sequence_parallel": True})
    return Translation({"parallel.sequence_parallel": False})  # verl turns it off itself at TP 1


def _clip_ratio(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    # verl: clip_ratio_low / clip_ratio_high default to clip_ratio
    return Translation({f"actor.{side}": value for side in ("clip_ratio_low", "clip_ratio_high")
                        if given.get(f"{ACTOR}.{side}") is None})


def _warmup_steps(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if isinstance(value, int) and value >= 0:
        return Translation({"actor.optim.lr_warmup_steps": value})
    return Translation({})  # -1: verl takes lr_warmup_steps_ratio


def _warmup_ratio(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if not value:
        return Translation({})
    if isinstance(given.get(f"{ACTOR}.optim.lr_warmup_steps"), int) and given[f"{ACTOR}.optim.lr_warmup_steps"] >= 0:
        return Translation({})  # explicit steps win, as in verl
    total = given.get("trainer.total_training_steps")
    if isinstance(total, int):
        return Translation({"actor.optim.lr_warmup_steps": int(value * total)})
    return Translation({}, "lr_warmup_steps_ratio needs trainer.total_training_steps to become "
                           "actor.optim.lr_warmup_steps (a step count here)")


def _min_lr_ratio(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({"actor.optim.min_lr": float(value) * float(_get(given, f"{ACTOR}.optim.lr"))} if value else {})


def _scheduler(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if value in ("constant", "cosine"):
        return Translation({"actor.optim.lr_scheduler": value})
    if value is None:
        return Translation({})
    return Translation({}, f"lr schedule {value!r} is not supported (constant, cosine are)")


def _optimizer(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if str(value).lower() in ("adamw", "adam"):
        return Translation({})
    return Translation({}, f"optimizer {value!r} is not supported: the optimizer is AdamW")


def _save_contents(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({"checkpoint.save_hf": "hf_model" in (value or [])})


def _ref_offload(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if _lora_rank(given):  # verl's ref_in_actor: the reference is the actor with its adapters off, as here
        return Translation({}, "no effect with LoRA: the reference is the policy's base (adapters off), "
                               "there is no separate copy to offload")
    return Translation({"ref.param_offload": _truthy(value)}) if not str(value).startswith("${") else Translation({})


def _lora_rank(given: Mapping[str, Any]) -> int:
    for key in (f"{MODEL}.lora_rank", f"{MODEL}.lora.rank"):
        try:
            if int(given.get(key) or 0) > 0:
                return int(given[key])
        except (TypeError, ValueError):
            continue  # an interpolation or a bad value: reported by its own row
    return 0


def _rollout_is(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if value is None:
        return Translation({})
    if value == "token":
        return Translation({"actor.tis_cap": float(_get(given, "algorithm.rollout_correction.rollout_is_threshold"))})
    return Translation({}, f"rollout_is={value!r} is not supported: token-level truncated IS is actor.tis_cap")


def _is_threshold(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({})  # read with rollout_is (_rollout_is)


def _val_greedy(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({"eval.greedy": not _truthy(value)})


def _val_temperature(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({"eval.temperature": value} if value and value > 0 else {})


def _engine_kwargs(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    """verl's engine_kwargs.sglang {name: value} -> SGLang server flags (--name value)."""
    if not isinstance(value, Mapping):
        suffix = key.partition("engine_kwargs.sglang.")[2]
        value = {suffix: value} if suffix else {}
    flags: list[str] = []
    for name, setting in value.items():
        flag = "--" + str(name).replace("_", "-")
        if setting is True:
            flags.append(flag)
        elif setting not in (False, None):
            flags += [flag, str(setting)]
    return Translation({"rollout.sglang.extra_args": flags} if flags else {})


def _deterministic(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    return Translation({"rollout.sglang.deterministic_inference": _truthy(value)})


def _device(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if value in ("cuda", "cpu"):
        return Translation({"trainer.device": value})
    return Translation({}, f"trainer.device={value!r} is not supported (cuda, cpu are)")


def _strategy(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if value == "megatron" or str(value).startswith("${"):
        return Translation({})
    return Translation({}, f"strategy={value!r}: this trainer is Megatron (set parallel.tensor / pipeline for the "
                           "layout; FSDP settings do not carry over)")


def _reward_manager(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if value in ("naive", "batch", "dapo"):
        return Translation({})  # dapo: naive + its overlong_buffer_cfg (reward.overlong_buffer)
    return Translation({}, f"reward manager {value!r} is not supported: each function is called per sample, or "
                           "batched when its parameters are plural (data_sources, solution_strs, ...); dapo's "
                           "overlong penalty is reward.overlong_buffer")


RM = "reward.models.rm"  # verl's one reward model, by this name here


def _rm_enabled(given: Mapping[str, Any]) -> bool:
    return bool(given.get("reward_model.enable") or given.get("reward.reward_model.enable"))


def _custom_function(given: Mapping[str, Any]) -> bool:
    return bool(given.get("custom_reward_function.path") or given.get("reward.custom_reward_function.path"))


def _rm_enable(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    """verl 0.9's reward loop: with the RM enabled and no custom function, the reward is the
    discriminative RM's score alone (its rendering: the prompt's chat + the response through the
    RM's chat template, as reward.models does)."""
    if not value:
        return Translation({})
    if _custom_function(given):
        return Translation({}, "no effect: with a custom reward function verl calls only that function (it may post "
                               "to the reward model itself); here reward.function is that function, no model scores")
    return Translation({f"{RM}.kind": "reward_model", f"{RM}.backend": "sglang",
                        "reward.combine.weights": {"rule": 0.0, "rm": 1.0}},
                       "the reward is the reward model's score alone, as verl's; give its SGLang servers: "
                       f"{RM}.sglang.urls=[...] (or .gpus to launch them)")


def _rm_field(field: str) -> Converter:
    def convert(value: Any, given: Mapping[str, Any], key: str) -> Translation:
        if not _rm_enabled(given) or _custom_function(given):
            return Translation({}, "no effect: no reward model scores (reward_model.enable is false, or a custom "
                                   "reward function is given)")
        return Translation({f"{RM}.{field}": value})
    return convert


def _rm_engine(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    if value == "sglang" or not _rm_enabled(given):
        return Translation({})
    return Translation({}, f"the reward model is served by SGLang here ({RM}.backend=sglang, its /classify)")


def _dapo_manager(given: Mapping[str, Any]) -> bool:
    """verl reads reward_kwargs.overlong_buffer_cfg / max_resp_len only in its dapo reward manager."""
    return "dapo" in (given.get("reward_model.reward_manager"), given.get("reward.reward_manager.name"))


def _overlong(value: Any, given: Mapping[str, Any], key: str) -> Translation:
    """reward_kwargs.overlong_buffer_cfg.<name> and reward_kwargs.max_resp_len -> reward.overlong_buffer."""
    name = key.rsplit(".", 1)[1]
    ours = "reward.overlong_buffer." + ("max_response_length" if name == "max_resp_len" else name)
    if not _dapo_manager(given):
        return Translation({}, "no effect: only verl's dapo reward manager (reward_manager=dapo) reads it")
    return Translation({ours: value})


# ---------------------------------------------------------------- the table

_NO_CRITIC = "GRPO-family estimators need no critic (PPO's value model); this trainer has none"
_FSDP = "FSDP setting; this trainer is Megatron (parallel.* sets the layout)"
_ENGINE_TUNING = "inference-engine tuning: pass SGLang server flags in rollout.sglang.extra_args"
_LOG_PROB_MB = "the old / reference log-prob passes use the actor's micro-batches (actor.max_tokens_per_micro_batch)"
_REF_LAYOUT = "the reference model shares the actor's layout and settings (parallel.*)"
_KERNELS = "kernel / compile choice: megatron-core's own kernels are used (the attention: model.attention_backend)"
_LORA_EXCLUDE = "not supported: name the adapted layers in model.lora.target_modules"
_NO_MM = "multimodal inputs are not supported (text prompts only)"
_NO_MULTITURN = ("verl's agent loop and tool configs do not carry over: multi-turn / tool-calling rollouts here "
                 "run an environment class, rollout.multi_turn.environment (docs/multi-turn.md)")
_NO_RM = ("the reward model's serving options: its SGLang servers are reward.models.<name>.sglang.* (urls, or gpus "
          "to launch them; extra_args for server flags)")
_NO_SANDBOX = "code-execution sandboxes are not supported: a reward function may call one itself"
_NO_RAY = "no Ray: the processes come from the launcher (torchrun / srun / mpirun)"
_WORLD = "the world size comes from the launcher (torchrun --nnodes N --nproc-per-node G, srun)"
_PROFILE = "profiling is not configured here: run under nsys / torch.profiler"
_NOT_HERE = "not implemented here"
_MTP = "multi-token prediction / speculative decoding is not supported"
_QAT = "quantization-aware training / quantized rollout is not supported"
_DERIVED = "derived in verl from other keys (an interpolation); nothing to set"
_SEED = "trainer.seed seeds everything (data order, sampling, init)"
_MOE = "not configurable: parallel.expert / expert_tensor and actor.moe_routing_replay are the MoE keys"
_CKPT_FORMAT = ("checkpoints are megatron dist-checkpoints written by the trainer; an HF folder or a `convert "
                "hf-to-megatron` checkpoint goes into model.path")

TABLE: tuple[VerlKey, ...] = (
    # -- data --------------------------------------------------------------------------------
    conv("data.train_files", ("data.train_files",), "a file or a list; ~ expanded", _files("data.train_files")),
    conv("data.val_files", ("data.val_files",), "a file or a list; ~ expanded", _files("data.val_files")),
    same("data.prompt_key", "data.prompt_key"),
    same("data.max_prompt_length", "data.max_prompt_length"),
    same("data.max_response_length", "data.max_response_length"),
    same("data.train_batch_size", "data.train_batch_size", "prompts per step, as in verl"),
    same("data.shuffle", "data.shuffle"),
    same("data.seed", "data.seed"),
    conv("data.truncation", ("data.truncation",), "error / left / right; 'middle' is not supported", _truncation),
    conv("data.filter_overlong_prompts", ("data.truncation",), "true = data.truncation=filter (counted, logged)",
         _filter_overlong),
    same("data.val_batch_size", "eval.val_batch_size"),
    same("data.reward_fn_key", "data.reward_fn_key", "the column passed to the reward function as data_source"),
    none("data.filter_overlong_prompts_workers", "prompts are filtered while they are tokenized, once"),
    none("data.dataloader_num_workers", "prompts are tokenized once at start; no data-loader workers"),
    none("data.gen_batch_size", "dynamic sampling draws data.train_batch_size prompts per generation round"),
    none("data.train_max_samples", "not supported: trim the data file"),
    none("data.val_max_samples", "not supported: trim the data file"),
    none("data.validation_shuffle", "validation prompts are scored in file order"),
    none("data.return_raw_input_ids", "verl dataset internals"),
    none("data.return_raw_chat", "verl dataset internals"),
    none("data.return_full_prompt", "verl dataset internals"),
    none("data.return_multi_modal_inputs", _NO_MM),
    none("data.image_key", _NO_MM), none("data.video_key", _NO_MM), none("data.audio_key", _NO_MM),
    none("data.image_patch_size", _NO_MM), none("data.mm_processor_kwargs", _NO_MM),
    none("data.apply_chat_template_kwargs", "not supported: set data.chat_template (a Jinja string)"),
    none("data.custom_cls.*", "custom dataset classes are not supported: records in verl's column layout"),
    none("data.tokenizer", "the tokenizer is model.tokenizer_path (or the model folder's)"),
    none("data.use_shm", "no shared-memory copies of the data"),
    none("data.trust_remote_code", "model.trust_remote_code"),
    none("data.tool_config_path", _NO_MULTITURN), none("data.function_tool_path", _NO_MULTITURN),
    # -- model -------------------------------------------------------------------------------
    conv(f"{MODEL}.path", ("model.path",), "HF folder or hub id; ~ expanded", _paths("model.path")),
    conv(f"{MODEL}.hf_config_path", ("model.config_path",), "", _paths("model.config_path")),
    conv(f"{MODEL}.tokenizer_path", ("model.tokenizer_path",), "", _paths("model.tokenizer_path")),
    conv(f"{MODEL}.override_config", ("model.override_config",),
         "HF config fields of a model built from scratch; no effect with model.path", _override_config),
    conv(f"{MODEL}.override_config.*", ("model.override_config",),
         "one HF config field (verl's model_config.<field> too); no effect with model.path", _override_config,
         added=True),
    same(f"{MODEL}.custom_chat_template", "data.chat_template"),
    same(f"{MODEL}.trust_remote_code", "model.trust_remote_code"),
    conv(f"{MODEL}.enable_gradient_checkpointing", ("model.recompute_granularity",), "true = full recompute",
         _grad_checkpointing),
    conv(f"{MODEL}.use_remove_padding", ("actor.packing",), "packed (THD) micro-batches; exact either way", _packing),
    none(f"{MODEL}.enable_activation_offload", "not supported"),
    none(f"{MODEL}.external_lib", "not supported: architectures come from megatron_grpo.models"),
    none(f"{MODEL}.use_shm", "no shared-memory model copies"),
    none(f"{MODEL}.use_liger", _KERNELS), none(f"{MODEL}.use_fused_kernels", _KERNELS),
    none(f"{MODEL}.fused_kernel_options.*", _KERNELS), none(f"{MODEL}.tiled_mlp.*", _KERNELS),
    same(f"{MODEL}.lora_rank", "model.lora.rank", "0 = no LoRA, as in verl"),
    same(f"{MODEL}.lora_alpha", "model.lora.alpha"),
    conv(f"{MODEL}.target_modules", ("model.lora.target_modules",), "PEFT names or all-linear", _lora_targets),
    same(f"{MODEL}.lora_adapter_path", "model.lora.adapter_path", "a PEFT adapter folder"),
    none(f"{MODEL}.exclude_modules", _LORA_EXCLUDE),
    # verl's megatron backend (Megatron-Bridge's LoRA): its target names are megatron's linear layers
    same(f"{MODEL}.lora.rank", "model.lora.rank", "0 = no LoRA, as in verl"),
    same(f"{MODEL}.lora.alpha", "model.lora.alpha"),
    same(f"{MODEL}.lora.dropout", "model.lora.dropout"),
    conv(f"{MODEL}.lora.target_modules", ("model.lora.target_modules",),
         "linear_qkv -> q_proj, k_proj, v_proj; linear_proj -> o_proj; linear_fc1 -> gate_proj, up_proj; "
         "linear_fc2 -> down_proj", _lora_targets),
    same(f"{MODEL}.lora.adapter_path", "model.lora.adapter_path", "a PEFT adapter folder"),
    none(f"{MODEL}.lora.merge", "engines always get the merged weights here (model.lora.sync=merged)"),
    none(f"{MODEL}.lora.exclude_modules", _LORA_EXCLUDE),
    none(f"{MODEL}.lora.*", "not supported: LoRA here is PEFT's plain LoRA (kaiming-uniform A, zero B, dropout on "
                            "the input)"),
    none(f"{MODEL}.mtp.*", _MTP),
    # -- actor -------------------------------------------------------------------------------
    same(f"{ACTOR}.ppo_mini_batch_size", "actor.ppo_mini_batch_size", "prompts per optimizer step, as in verl"),
    conv(f"{ACTOR}.ppo_micro_batch_size_per_gpu", ("actor.ppo_micro_batch_size_per_gpu",
                                                   "actor.max_tokens_per_micro_batch"),
         "fixed micro-batches (max_tokens_per_micro_batch=null); ignored with use_dynamic_bsz, as in verl",
         _micro_batch),
    none(f"{ACTOR}.ppo_micro_batch_size", "deprecated in verl (a global size): use ppo_micro_batch_size_per_gpu"),
    conv(f"{ACTOR}.use_dynamic_bsz", ("actor.max_tokens_per_micro_batch", "actor.ppo_micro_batch_size_per_gpu"),
         "true = token-balanced micro-batches of ppo_max_token_len_per_gpu tokens", _dynamic_bsz),
    conv(f"{ACTOR}.ppo_max_token_len_per_gpu", ("actor.max_tokens_per_micro_batch",),
         "with use_dynamic_bsz=True", _max_token_len),
    same(f"{ACTOR}.ppo_epochs", "actor.ppo_epochs"),
    same(f"{ACTOR}.shuffle", "actor.shuffle"),
    same(f"{ACTOR}.use_kl_loss", "actor.use_kl_loss"),
    same(f"{ACTOR}.kl_loss_coef", "actor.kl_loss_coef"),
    same(f"{ACTOR}.kl_loss_type", "actor.kl_loss_type", "the same names, \"+\" variants included"),
    same(f"{ACTOR}.loss_agg_mode", "actor.loss_agg_mode"),
    same(f"{ACTOR}.loss_scale_factor", "actor.loss_scale_factor"),
    conv(f"{ACTOR}.clip_ratio", ("actor.clip_ratio_low", "actor.clip_ratio_high"),
         "both sides, unless clip_ratio_low / clip_ratio_high are given", _clip_ratio),
    same(f"{ACTOR}.clip_ratio_low", "actor.clip_ratio_low"),
    same(f"{ACTOR}.clip_ratio_high", "actor.clip_ratio_high"),
    same(f"{ACTOR}.clip_ratio_c", "actor.clip_ratio_c"),
    same(f"{ACTOR}.entropy_coeff", "actor.entropy_coeff"),
    same(f"{ACTOR}.policy_loss.loss_mode", "actor.policy_loss.loss_mode", "vanilla, gspo"),
    none(f"{ACTOR}.policy_loss.*", "parameters of loss modes not implemented here (clip_cov, kl_cov, dro ...)"),
    none(f"{ACTOR}.tau_pos", "SAPO is not implemented here"), none(f"{ACTOR}.tau_neg", "SAPO is not implemented here"),
    same(f"{ACTOR}.grad_clip", "actor.grad_clip"),
    same(f"{ACTOR}.optim.clip_grad", "actor.grad_clip"),
    same(f"{ACTOR}.optim.lr", "actor.optim.lr"),
    same(f"{ACTOR}.optim.weight_decay", "actor.optim.weight_decay"),
    same(f"{ACTOR}.optim.betas", "actor.optim.betas"),
    conv(f"{ACTOR}.optim.lr_warmup_steps", ("actor.optim.lr_warmup_steps",), "-1 = take lr_warmup_steps_ratio",
         _warmup_steps),
    conv(f"{ACTOR}.optim.lr_warmup_steps_ratio", ("actor.optim.lr_warmup_steps",),
         "x trainer.total_training_steps (a step count here)", _warmup_ratio),
    same(f"{ACTOR}.optim.min_lr", "actor.optim.min_lr"),
    conv(f"{ACTOR}.optim.min_lr_ratio", ("actor.optim.min_lr",), "x optim.lr", _min_lr_ratio),
    conv(f"{ACTOR}.optim.lr_scheduler_type", ("actor.optim.lr_scheduler",), "constant, cosine", _scheduler),
    conv(f"{ACTOR}.optim.warmup_style", ("actor.optim.lr_scheduler",), "constant, cosine", _scheduler),
    conv(f"{ACTOR}.optim.lr_decay_style", ("actor.optim.lr_scheduler",), "constant, cosine", _scheduler),
    conv(f"{ACTOR}.optim.optimizer", (), "AdamW only", _optimizer),
    none(f"{ACTOR}.optim.total_training_steps", "set from trainer.total_training_steps"),
    none(f"{ACTOR}.optim.lr_decay_steps", "cosine decays over the whole run (trainer.total_steps)"),
    none(f"{ACTOR}.optim.lr_warmup_init", "warmup starts at 0"),
    none(f"{ACTOR}.optim.num_cycles", "one half cosine cycle"),
    none(f"{ACTOR}.optim.zero_indexed_step", "verl scheduler internals"),
    none(f"{ACTOR}.optim.lr_wsd_*", "WSD schedules are not supported"),
    none(f"{ACTOR}.optim.weight_decay_incr_style", "constant weight decay"),
    none(f"{ACTOR}.optim.muon_*", "the optimizer is AdamW"),
    none(f"{ACTOR}.optim.optimizer_impl", "the optimizer is megatron-core's AdamW"),
    none(f"{ACTOR}.optim.override_optimizer_config", "not supported"),
    none(f"{ACTOR}.optim.*_dtype", "fp32 optimizer state and main gradients"),
    none(f"{ACTOR}.optim.use_checkpoint_opt_param_scheduler", "not configurable"),
    none(f"{ACTOR}.optim.use_layer_wise_distributed_optimizer", "parallel.use_distributed_optimizer"),
    none(f"{ACTOR}.optim.use_precision_aware_optimizer", "not supported"),
    conv(f"{ACTOR}.strategy", (), "this trainer is Megatron", _strategy),
    same(f"{ACTOR}.megatron.tensor_model_parallel_size", "parallel.tensor"),
    same(f"{ACTOR}.megatron.pipeline_model_parallel_size", "parallel.pipeline"),
    same(f"{ACTOR}.megatron.virtual_pipeline_model_parallel_size", "parallel.virtual_pipeline"),
    same(f"{ACTOR}.megatron.context_parallel_size", "parallel.context"),
    conv(f"{ACTOR}.megatron.sequence_parallel", ("parallel.sequence_parallel",), "only with TP > 1, as verl",
         _sequence_parallel),
    same(f"{ACTOR}.megatron.use_distributed_optimizer", "parallel.use_distributed_optimizer"),
    same(f"{ACTOR}.megatron.dtype", "model.dtype"),
    conv(f"{ACTOR}.megatron.override_transformer_config.recompute_granularity", ("model.recompute_granularity",),
         "", _recompute("model.recompute_granularity")),
    conv(f"{ACTOR}.megatron.override_transformer_config.recompute_method", ("model.recompute_method",), "",
         _recompute("model.recompute_method")),
    conv(f"{ACTOR}.megatron.override_transformer_config.recompute_num_layers", ("model.recompute_num_layers",), "",
         _recompute("model.recompute_num_layers")),
    conv(f"{ACTOR}.megatron.override_transformer_config.attention_backend", ("model.attention_backend",),
         "auto, local as they are; flash / fused / unfused (Transformer Engine's kernels) -> te", _attention_backend),
    none(f"{ACTOR}.megatron.override_transformer_config.*", "not supported: the layer spec is megatron_grpo.models'"),
    none(f"{ACTOR}.megatron.override_mcore_model_config", "not supported"),
    none(f"{ACTOR}.megatron.override_ddp_config", "not supported"),
    same(f"{ACTOR}.megatron.expert_model_parallel_size", "parallel.expert"),
    same(f"{ACTOR}.megatron.expert_tensor_parallel_size", "parallel.expert_tensor", "null = parallel.tensor, as verl"),
    none(f"{ACTOR}.megatron.expert_*", _MOE),
    none(f"{ACTOR}.megatron.param_offload", "parameter offload is not supported for the actor (ref.param_offload is)"),
    none(f"{ACTOR}.megatron.optimizer_offload", "optimizer offload is not supported"),
    none(f"{ACTOR}.megatron.grad_offload", "gradient offload is not supported", added=True),  # verl 0.9.0
    none(f"{ACTOR}.megatron.seed", _SEED),
    none(f"{ACTOR}.megatron.use_mbridge", "HF <-> Megatron conversion is built in (megatron_grpo.convert)"),
    none(f"{ACTOR}.megatron.vanilla_mbridge", "HF <-> Megatron conversion is built in (megatron_grpo.convert)"),
    none(f"{ACTOR}.megatron.use_dist_checkpointing", _CKPT_FORMAT),
    none(f"{ACTOR}.megatron.dist_checkpointing_*", _CKPT_FORMAT),
    none(f"{ACTOR}.megatron.dist_ckpt_optim_fully_reshardable", "checkpoints are always fully reshardable"),
    none(f"{ACTOR}.megatron.distrib_optim_fully_reshardable_mem_efficient", "checkpoints are always fully reshardable"),
    conv(f"{ACTOR}.megatron.use_remove_padding", ("actor.packing",), "packed (THD) micro-batches; exact either way",
         _packing),
    none(f"{ACTOR}.megatron.use_megatron_fsdp", "not supported"),
    none(f"{ACTOR}.megatron.dynamic_context_parallel", "context parallelism is static (parallel.context)"),
    none(f"{ACTOR}.megatron.max_seqlen_per_dp_cp_rank",
         "micro-batches are bounded by actor.max_tokens_per_micro_batch"),
    none(f"{ACTOR}.megatron.pad_*", "sequences are packed, not padded"),
    none(f"{ACTOR}.megatron.forward_only", "verl engine internals"),
    none(f"{ACTOR}.megatron.entropy_*", "the entropy is computed from the vocab-parallel logits, chunked"),
    none(f"{ACTOR}.megatron.qat.*", _QAT),
    conv(f"{ACTOR}.megatron.router_replay.mode", ("actor.moe_routing_replay",),
         "R3 = true (the engine's experts, the trainer's gate weights); disabled = false; R2 is not supported",
         _router_replay),
    none(f"{ACTOR}.megatron.router_replay.*", _MOE),
    none(f"{ACTOR}.fsdp_config.*", _FSDP),
    none(f"{ACTOR}.ulysses_sequence_parallel_size", "Ulysses SP is FSDP's; the Megatron equivalent is context "
                                                    "parallelism, parallel.context"),
    conv(f"{ACTOR}.checkpoint.save_contents", ("checkpoint.save_hf",), "'hf_model' in it = checkpoint.save_hf=true",
         _save_contents),
    none(f"{ACTOR}.checkpoint.load_contents", "a resume restores model, optimizer and trainer state"),
    same(f"{ACTOR}.checkpoint.async_save", "checkpoint.async_save"),
    none(f"{ACTOR}.checkpoint.strict", "not configurable"),
    none(f"{ACTOR}.checkpoint.mbridge_config", "HF <-> Megatron conversion is built in"),
    none(f"{ACTOR}.use_torch_compile", _KERNELS), none(f"{ACTOR}.use_fused_kernels", _KERNELS),
    none(f"{ACTOR}.entropy_*", "the entropy is computed from the vocab-parallel logits, chunked"),
    none(f"{ACTOR}.calculate_entropy", "the entropy is always logged (actor/entropy)"),
    none(f"{ACTOR}.calculate_sum_pi_squared", _NOT_HERE),
    none(f"{ACTOR}.data_loader_seed", _SEED),
    none(f"{ACTOR}.freeze_vision_tower", _NO_MM),
    none(f"{ACTOR}.use_prefix_grouper", _NOT_HERE),
    none(f"{ACTOR}.pad_to_length", "sequences are packed, not padded"),
    conv(f"{ACTOR}.use_remove_padding", ("actor.packing",), "packed (THD) micro-batches; exact either way", _packing),
    none(f"{ACTOR}.rollout_n", _DERIVED),
    none(f"{ACTOR}.qat.*", _QAT),
    none(f"{ACTOR}.profiler.*", _PROFILE),
    conv(f"{ACTOR}.router_replay.mode", ("actor.moe_routing_replay",), "as actor.megatron.router_replay.mode",
         _router_replay, added=True),  # verl 0.9.0
    none(f"{ACTOR}.router_replay.*", _MOE, added=True),  # verl 0.9.0
    # -- reference model ---------------------------------------------------------------------
    conv(f"{REF}.fsdp_config.param_offload", ("ref.param_offload",), "", _ref_offload),
    conv(f"{REF}.megatron.param_offload", ("ref.param_offload",), "", _ref_offload),
    none(f"{REF}.log_prob_*", _LOG_PROB_MB),
    none(f"{REF}.*", _REF_LAYOUT),
    # -- rollout -----------------------------------------------------------------------------
    conv(f"{ROLLOUT}.name", ("rollout.engine", "rollout.sglang.num_engines", "rollout.sglang.weight_sync"),
         "sglang (vllm / trtllm become sglang); hf = local", _rollout_engine),
    same(f"{ROLLOUT}.n", "rollout.n"),
    same(f"{ROLLOUT}.temperature", "rollout.temperature"),
    same(f"{ROLLOUT}.top_p", "rollout.top_p"),
    same(f"{ROLLOUT}.top_k", "rollout.top_k"),
    same(f"{ROLLOUT}.tensor_model_parallel_size", "rollout.sglang.tp_size"),
    same(f"{ROLLOUT}.gpu_memory_utilization", "rollout.sglang.mem_fraction"),
    same(f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes", "rollout.weight_bucket_mb"),
    conv(f"{ROLLOUT}.engine_kwargs.sglang", ("rollout.sglang.extra_args",), "as --flag value server arguments",
         _engine_kwargs),
    conv(f"{ROLLOUT}.engine_kwargs.sglang.*", ("rollout.sglang.extra_args",), "as --flag value server arguments",
         _engine_kwargs, added=True),
    none(f"{ROLLOUT}.engine_kwargs.*", "vLLM / TensorRT-LLM are not supported"),
    conv(f"{ROLLOUT}.full_determinism", ("rollout.sglang.deterministic_inference",), "", _deterministic),
    conv(f"{ROLLOUT}.val_kwargs.do_sample", ("eval.greedy",), "do_sample=false = eval.greedy=true", _val_greedy),
    same(f"{ROLLOUT}.val_kwargs.n", "eval.n_samples"),
    conv(f"{ROLLOUT}.val_kwargs.temperature", ("eval.temperature",), "only when > 0 (0 = greedy)", _val_temperature),
    none(f"{ROLLOUT}.val_kwargs.top_p", "eval samples with top_p=1"),
    none(f"{ROLLOUT}.val_kwargs.top_k", "eval samples with top_k off"),
    none(f"{ROLLOUT}.log_prob_*", _LOG_PROB_MB),
    none(f"{ROLLOUT}.calculate_log_probs", "always: the engines return the sampled tokens' log-probs"),
    none(f"{ROLLOUT}.dtype", "not configurable"),
    none(f"{ROLLOUT}.mode", "generation is asynchronous HTTP (SGLang) or in-process (local)"),
    none(f"{ROLLOUT}.prompt_length", _DERIVED), none(f"{ROLLOUT}.response_length", _DERIVED),
    none(f"{ROLLOUT}.n_gpus_per_node", _DERIVED),
    none(f"{ROLLOUT}.nnodes", "SGLang engines: rollout.sglang.num_engines"),
    none(f"{ROLLOUT}.seed", _SEED),
    none(f"{ROLLOUT}.do_sample", "training rollouts always sample (rollout.temperature)"),
    none(f"{ROLLOUT}.ignore_eos", "not supported"),
    none(f"{ROLLOUT}.data_parallel_size", "SGLang engines: rollout.sglang.num_engines"),
    none(f"{ROLLOUT}.expert_parallel_size", _MOE), none(f"{ROLLOUT}.moe_*", _MOE),
    none(f"{ROLLOUT}.enable_rollout_routing_replay", "the engine reports its routes whenever "
                                                      "actor.moe_routing_replay=true"),
    none(f"{ROLLOUT}.pipeline_model_parallel_size", _ENGINE_TUNING),
    none(f"{ROLLOUT}.over_sample_rate", "not supported"),
    none(f"{ROLLOUT}.quantization", _QAT), none(f"{ROLLOUT}.quantization_config_file", _QAT),
    none(f"{ROLLOUT}.qat", _QAT),
    none(f"{ROLLOUT}.mtp", _MTP),
    none(f"{ROLLOUT}.multi_turn.*", _NO_MULTITURN), none(f"{ROLLOUT}.agent.*", _NO_MULTITURN),
    none(f"{ROLLOUT}.trace.*", "rollout tracing is not supported: samples are in the metrics"),
    none(f"{ROLLOUT}.prometheus.*", "not supported"),
    none(f"{ROLLOUT}.disaggregation.*", "prefill / decode disaggregation is not supported"),
    none(f"{ROLLOUT}.checkpoint_engine.*", "weight sync: rollout.sglang.weight_sync (distributed, tensor, disk)"),
    none(f"{ROLLOUT}.logprobs_mode", "not configurable"),
    none(f"{ROLLOUT}.skip_tokenizer_init", "the engines take token ids"),
    none(f"{ROLLOUT}.scheduling_policy", _ENGINE_TUNING),
    none(f"{ROLLOUT}.router_config_path", "the router: rollout.sglang.router / router_policy"),
    none(f"{ROLLOUT}.multi_stage_wake_up", _ENGINE_TUNING),
    none(f"{ROLLOUT}.load_format", _ENGINE_TUNING), none(f"{ROLLOUT}.layered_summon", _ENGINE_TUNING),
    none(f"{ROLLOUT}.free_cache_engine", _ENGINE_TUNING), none(f"{ROLLOUT}.enforce_eager", _ENGINE_TUNING),
    none(f"{ROLLOUT}.enable_chunked_prefill", _ENGINE_TUNING), none(f"{ROLLOUT}.enable_prefix_caching", _ENGINE_TUNING),
    none(f"{ROLLOUT}.max_num_batched_tokens", _ENGINE_TUNING), none(f"{ROLLOUT}.max_num_seqs", _ENGINE_TUNING),
    none(f"{ROLLOUT}.max_model_len", _ENGINE_TUNING), none(f"{ROLLOUT}.cudagraph_capture_sizes", _ENGINE_TUNING),
    none(f"{ROLLOUT}.disable_log_stats", _ENGINE_TUNING),
    none(f"{ROLLOUT}.profiler.*", _PROFILE),
    none(f"{AR}.hybrid_engine", "colocation: rollout.sglang.weight_sync=tensor (set with rollout.name)"),
    none(f"{AR}.nccl_timeout", "not configurable"),
    # -- algorithm ---------------------------------------------------------------------------
    same("algorithm.adv_estimator", "algorithm.adv_estimator", "grpo, rloo, reinforce_plus_plus_baseline"),
    same("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo"),
    same("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward"),
    same("algorithm.kl_penalty", "algorithm.kl_penalty"),
    same("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.type"),
    same("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.kl_coef"),
    same("algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.horizon"),
    same("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.target_kl"),
    same("algorithm.filter_groups.enable", "algorithm.filter_groups.enable"),
    same("algorithm.filter_groups.metric", "algorithm.filter_groups.metric"),
    same("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches"),
    none("algorithm.filter_groups.max_inflight_gen_batches", "generation rounds run one at a time"),
    none("algorithm.gamma", "discounting is for GAE / REINFORCE++ returns, not implemented here"),
    none("algorithm.lam", "GAE's lambda; GAE is not implemented here"),
    none("algorithm.use_pf_ppo", "PF-PPO is not implemented here"),
    none("algorithm.pf_ppo.*", "PF-PPO is not implemented here"),
    conv("algorithm.rollout_correction.rollout_is", ("actor.tis_cap",),
         "'token' = truncated IS capped at rollout_is_threshold", _rollout_is),
    conv("algorithm.rollout_correction.rollout_is_threshold", ("actor.tis_cap",), "with rollout_is='token'",
         _is_threshold),
    none("algorithm.rollout_correction.*", "only token-level truncated IS is supported (actor.tis_cap)"),
    # -- reward ------------------------------------------------------------------------------
    conv("custom_reward_function.path", ("reward.function",), "reward.function=PATH:NAME, verl's signature detected",
         _reward_function),
    conv("custom_reward_function.name", ("reward.function",), "with .path", _reward_name),
    conv("custom_reward_function.reward_kwargs.*", ("reward.kwargs",), "", _under("reward.kwargs"), added=True),
    same("custom_reward_function.reward_kwargs", "reward.kwargs", added=True),
    conv("reward.custom_reward_function.path", ("reward.function",),
         "reward.function=PATH:NAME, verl's signature detected", _reward_function),
    conv("reward.custom_reward_function.name", ("reward.function",), "with .path", _reward_name),
    conv("reward.custom_reward_function.reward_kwargs.*", ("reward.kwargs",), "", _under("reward.kwargs"),
         added=True),
    same("reward.custom_reward_function.reward_kwargs", "reward.kwargs", added=True),
    same("reward.num_workers", "reward.num_workers", "worker processes (0 = in the trainer)"),
    conv("reward.reward_manager.name", (), "naive, batch and dapo (its overlong_buffer_cfg is "
         "reward.overlong_buffer)", _reward_manager),
    none("reward.reward_manager.*", "custom reward managers are not supported"),
    conv("reward_model.reward_manager", (), "naive, batch and dapo (its overlong_buffer_cfg is "
         "reward.overlong_buffer)", _reward_manager),
    *(conv(f"{section}.reward_kwargs.overlong_buffer_cfg.{name}", (f"reward.overlong_buffer.{name}",),
           "with reward_manager=dapo", _overlong, added=True)  # `+...` keys: not in verl's yaml
      for section in ("reward", "reward_model") for name in ("enable", "len", "penalty_factor", "log")),
    *(conv(f"{section}.reward_kwargs.max_resp_len", ("reward.overlong_buffer.max_response_length",),
           "with reward_manager=dapo: the cap the overlong buffer ends at", _overlong, added=True)
      for section in ("reward", "reward_model")),
    none("reward.reward_kwargs.*", "read by custom reward managers, which are not supported", added=True),
    none("reward_model.reward_kwargs.*", "read by custom reward managers, which are not supported", added=True),
    *(row for section, path in (("reward.reward_model", "model_path"), ("reward_model", "model.path")) for row in (
        conv(f"{section}.enable", ("reward.models", "reward.combine"), "a discriminative reward model, its score "
             "the whole reward (with a custom reward function verl calls only that)", _rm_enable),
        conv(f"{section}.{path}", ("reward.models",), f"{RM}.path", _rm_field("path")),
        conv(f"{section}.rollout.tensor_model_parallel_size", ("reward.models",), f"{RM}.sglang.tp_size",
             _rm_field("sglang.tp_size")),
        conv(f"{section}.rollout.gpu_memory_utilization", ("reward.models",), f"{RM}.sglang.mem_fraction",
             _rm_field("sglang.mem_fraction")),
        conv(f"{section}.rollout.name", (), "sglang here", _rm_engine))),
    none("reward.reward_model.*", _NO_RM), none("reward_model.*", _NO_RM),
    none("reward.sandbox_fusion.*", _NO_SANDBOX), none("sandbox_fusion.*", _NO_SANDBOX),
    # -- trainer -----------------------------------------------------------------------------
    same("trainer.total_epochs", "trainer.total_epochs"),
    same("trainer.total_training_steps", "trainer.total_steps"),
    same("trainer.project_name", "logging.project"),
    same("trainer.experiment_name", "logging.experiment_name"),
    conv("trainer.logger", ("logging.console", "logging.wandb", "logging.tensorboard"),
         "console, wandb, tensorboard", _loggers),
    conv("trainer.save_freq", ("checkpoint.save_interval",), "<= 0 = off (-1)", _freq("checkpoint.save_interval")),
    conv("trainer.test_freq", ("eval.interval",), "<= 0 = off (-1)", _freq("eval.interval")),
    same("trainer.val_before_train", "eval.before_train", "verl's default is true, here false"),
    conv("trainer.default_local_dir", ("checkpoint.save_dir",), "", _paths("checkpoint.save_dir")),
    same("trainer.max_actor_ckpt_to_keep", "checkpoint.keep_last"),
    conv("trainer.resume_mode", ("checkpoint.resume",), "auto = auto, disable = never, resume_path = the path",
         _resume_mode),
    conv("trainer.resume_from_path", ("checkpoint.resume",), "with resume_mode=resume_path", _resume_path),
    conv("trainer.device", ("trainer.device",), "cuda, cpu", _device),
    none("trainer.n_gpus_per_node", _WORLD), none("trainer.nnodes", _WORLD),
    none("trainer.critic_warmup", _NO_CRITIC), none("trainer.max_critic_ckpt_to_keep", _NO_CRITIC),
    none("trainer.balance_batch", "always: each mini-batch is split over the data-parallel ranks by token cost"),
    none("trainer.log_val_generations", "not supported"),
    none("trainer.rollout_data_dir", "not supported"), none("trainer.validation_data_dir", "not supported"),
    none("trainer.val_only", "`megatron-grpo eval RECIPE` evaluates a checkpoint"),
    none("trainer.del_local_ckpt_after_load", "checkpoints are kept (checkpoint.keep_last prunes old ones)"),
    none("trainer.default_hdfs_dir", "no HDFS copies: checkpoint.save_dir may be any mounted folder"),
    none("trainer.esi_redundant_time", "preemption: SIGTERM / SIGUSR1 save a checkpoint before exit"),
    none("trainer.ray_wait_register_center_timeout", _NO_RAY),
    none("trainer.checkpoint_callback_class", "not supported"),
    none("trainer.use_v1", "verl trainer internals"), none("trainer.v1.*", "verl trainer internals (async modes)"),
    # -- sections with no equivalent ---------------------------------------------------------
    none("critic.*", _NO_CRITIC),
    none("ray_kwargs.*", _NO_RAY),
    none("global_profiler.*", _PROFILE),
    none("transfer_queue.*", "verl's transfer queue: data moves by torch.distributed here"),
    none("distillation.*", "distillation is not supported"),
    none("skip.*", "rollout caching / skipping is not supported"),
    none("*._target_", "verl's dataclass marker"),
)

def verl_default_values(given: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """(our key, value, why) for verl defaults that differ from this project's and matter for the
    keys given: from-verl writes them, so a verl command line keeps its verl behaviour."""
    out = []
    if "trainer.val_before_train" not in given and given.get("data.val_files"):
        out.append(("eval.before_train", True, "verl's default trainer.val_before_train=True"))
    if not (given.get("custom_reward_function.path") or given.get("reward.custom_reward_function.path")):
        out.append(("reward.function", "by_data_source", "verl's default scorer picks a scorer by each row's "
                                                         "data_source"))
    return out


_EXACT = {row.verl: row for row in TABLE if not row.is_pattern}
_PATTERNS = sorted((row for row in TABLE if row.is_pattern), key=lambda r: -len(r.verl.replace("*", "")))


def _matching_row(key: str) -> VerlKey:
    row = lookup(key)
    assert row is not None, key
    return row


def lookup(key: str) -> Optional[VerlKey]:
    """The row for a verl key (exact, else the most specific matching pattern), or None."""
    key = key.lstrip("+~")
    if key in _EXACT:
        return _EXACT[key]
    return next((row for row in _PATTERNS if fnmatch.fnmatchcase(key, row.verl)), None)


def is_verl_section(key: str) -> bool:
    """True for a prefix of verl keys that is not a section here (`actor_rollout_ref`, `critic`)."""
    return any(row.verl.startswith(key + ".") for row in TABLE)


def hint(key: str) -> Optional[str]:
    """"verl's X is Y here" for a key unknown here that is a verl key, else None. A key written with
    our section names but a verl leaf (`actor.ppo_max_token_len_per_gpu`) is looked up under
    actor_rollout_ref too."""
    candidates = [key]
    if key.split(".", 1)[0] in ("actor", "rollout", "ref", "model"):
        candidates.append(f"{AR}.{key}")
    for candidate in candidates:
        row = lookup(candidate)
        if row is None:
            continue
        if row.ours:
            note = f" ({row.note})" if row.note else ""
            return f"verl's {candidate} is {' / '.join(row.ours)} here{note}; {FROM_VERL}"
        return f"verl's {candidate} has no equivalent here: {row.note}; {FROM_VERL}"
    if is_verl_section(key):
        return f"'{key}' is a section of verl's config; {FROM_VERL} (`megatron-grpo config verl-keys` lists the table)"
    return None
