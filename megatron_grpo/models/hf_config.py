"""HF config.json -> our typed ModelArchitecture, with every math-changing field checked.

A ModelArchitecture is the single description of the network that the builder, the converter and the
checkpoint tools share. It keeps the original HF config dict (written back verbatim on export)
and the padded vocabulary size (fixed once, at conversion time, so that a checkpoint reloads at
any TP size that divides it).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Union

from megatron_grpo.errors import CheckpointError, ConfigError
from megatron_grpo.models.architectures import ARCHITECTURES, ArchitectureSpec

HFConfigSource = Union[str, Path, Mapping[str, Any], Any]  # folder, config.json, dict, PretrainedConfig

MODEL_CONFIG_FILE = "megatron_grpo_model.json"
DEFAULT_VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class Llama3RopeScaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnRopeScaling:
    """HF's rope_type "yarn" (DeepSeek-V3) as megatron-core's MLA YaRN takes it. HF's attention factor (on
    cos / sin) is get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set, else
    get_mscale(factor); megatron's is the ratio always, so the second case is stored as mscale 1,
    mscale_all_dim 0 (the same value). The softmax scale's get_mscale(factor, mscale_all_dim)^2 is alike."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class ModelArchitecture:
    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int             # the HF (tokenizer) vocabulary: rows of embed_tokens / lm_head
    padded_vocab_size: int      # rows of the Megatron embedding / output layer
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    attention_dropout: float
    hf_config: dict = field(repr=False, compare=False)
    # Mixture of experts (0 / () for dense models). HF Qwen3-MoE: layer i is sparse unless it is in
    # mlp_only_layers or (i + 1) % decoder_sparse_step != 0; the other layers use ffn_hidden_size.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False       # renormalise the top-k softmax probabilities to sum to 1
    # HF adds router_aux_loss_coef * aux loss only when output_router_logits is true; 0 otherwise.
    router_aux_loss_coef: float = 0.0
    # Qwen2-MoE's shared expert on every sparse layer (0: none): a SwiGLU MLP of this width whose
    # output is scaled by sigmoid(shared_expert_gate(x)) and added to the routed experts' output.
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False   # Qwen2-MoE's sigmoid gate on the shared expert's output
    # GLM-4.5 / DeepSeek-V3 routers: "sigmoid" scores; the top-k of scores + the per-expert bias
    # (e_score_correction_bias, frozen) within the best moe_group_topk of moe_num_groups groups (0: no
    # groups); weights = the chosen scores normalised to sum 1, times routed_scaling_factor.
    router_score_function: str = "softmax"
    expert_bias: bool = False
    moe_num_groups: int = 0
    moe_group_topk: int = 0
    routed_scaling_factor: float = 1.0
    rotary_percent: float = 1.0        # the leading fraction of each head that RoPE rotates (GLM-4.5: 0.5)
    # Multi-token-prediction layers the HF checkpoint may carry after the last layer
    # (model.layers.{num_layers + i}.*): not trained, dropped on import.
    mtp_layers: int = 0
    # Multi-head latent attention (DeepSeek-V3; kv_lora_rank 0: none). head_dim is then the q/k head
    # (qk_nope_head_dim + qk_rope_head_dim), num_query_groups the head count; q_lora_rank 0: one q_proj.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_percent)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    @property
    def spec(self) -> ArchitectureSpec:
        return ARCHITECTURES[self.architecture]

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: HFConfigSource, tensor_parallel: int = 1,
                vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE) -> "ModelArchitecture":
        """Reads and validates an HF config; pads the vocabulary to a multiple of
        vocab_multiple * tensor_parallel (megatron's make-vocab-size-divisible-by rule)."""
        hf, where = load_hf_config_dict(source)
        return _parse(hf, where, padded_vocab_size=None, tensor_parallel=tensor_parallel,
                      vocab_multiple=vocab_multiple)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "model config") -> "ModelArchitecture":
        """Inverse of to_dict(): re-parses the stored HF config and keeps the stored padding."""
        try:
            hf = dict(data["hf_config"])
            padded = int(data["padded_vocab_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: missing or bad key {exc} (expected 'hf_config' and "
                                  f"'padded_vocab_size')") from None
        return _parse(hf, where, padded_vocab_size=padded, tensor_parallel=1, vocab_multiple=1)

    def to_dict(self) -> dict:
        return {"format_version": 1, "padded_vocab_size": self.padded_vocab_size,
                "hf_config": self.hf_config, "derived": {k: v for k, v in asdict(self).items() if k != "hf_config"}}

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MODEL_CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "ModelArchitecture":
        path = Path(directory) / MODEL_CONFIG_FILE
        if not path.is_file():
            raise CheckpointError(f"{path}: not found; this is not a megatron-grpo checkpoint "
                                  f"(convert an HF model with tools/convert_hf_to_megatron.py)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
        return cls.from_dict(data, where=str(path))

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """Raises ConfigError if the model cannot be split over `tensor_parallel` ranks."""
        checks = [("num_attention_heads", self.num_attention_heads),
                  ("num_key_value_heads", self.num_query_groups),
                  ("padded vocab size", self.padded_vocab_size)]
        if self.dense_layers:
            checks.append(("intermediate_size", self.ffn_hidden_size))
        if self.shared_expert_ffn_hidden_size:
            checks.append(("shared_expert_intermediate_size", self.shared_expert_ffn_hidden_size))
        for name, value in checks:
            if value % tensor_parallel:
                raise ConfigError(f"tensor parallel size {tensor_parallel} does not divide {name} = {value}")

    def check_expert_parallel(self, expert_parallel: int, expert_tensor_parallel: int) -> None:
        """Raises ConfigError if the experts cannot be split over EP x ETP ranks."""
        if not self.is_moe:
            if expert_parallel > 1:
                raise ConfigError(f"parallel.expert={expert_parallel}: model_type {self.architecture!r} has no "
                                  f"experts (expert parallelism needs a mixture-of-experts model)")
            return
        if self.num_experts % expert_parallel:
            raise ConfigError(f"expert parallel size {expert_parallel} does not divide "
                              f"num_experts = {self.num_experts}")
        if self.moe_ffn_hidden_size % expert_tensor_parallel:
            raise ConfigError(f"expert tensor parallel size {expert_tensor_parallel} does not divide "
                              f"moe_intermediate_size = {self.moe_ffn_hidden_size}")

    def same_math_as(self, other: "ModelArchitecture") -> list[str]:
        """Names of derived fields that differ (empty when the two configs build the same model)."""
        mine, theirs = self.to_dict()["derived"], other.to_dict()["derived"]
        return sorted(k for k in mine if mine[k] != theirs.get(k))


def load_hf_config_dict(source: HFConfigSource) -> tuple[dict, str]:
    """Returns (config dict, a description of where it came from for error messages)."""
    if isinstance(source, Mapping):
        return dict(source), "HF config dict"
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):  # transformers.PretrainedConfig
        return source.to_dict(), f"{type(source).__name__}"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: HF config.json not found")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None


def _require(hf: Mapping, key: str, where: str):
    if hf.get(key) is None:
        raise ConfigError(f"{where}: required key {key!r} is missing")
    return hf[key]


def _parse(hf: dict, where: str, padded_vocab_size: int | None, tensor_parallel: int,
           vocab_multiple: int) -> ModelArchitecture:
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported; supported: "
                          f"{', '.join(sorted(ARCHITECTURES))}")
    spec = ARCHITECTURES[model_type]
    architectures = hf.get("architectures") or [spec.hf_class]
    if list(architectures) != [spec.hf_class]:
        raise ConfigError(f"{where}: architectures {architectures} is not supported for model_type "
                          f"{model_type!r}; expected [{spec.hf_class!r}]")
    _reject_math_changes(hf, spec, where)

    hidden = int(_require(hf, "hidden_size", where))
    heads = int(_require(hf, "num_attention_heads", where))
    groups = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    mla = _parse_mla(hf, heads, where) if spec.mla else {}
    if mla:
        groups, head_dim = heads, mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    if heads % groups:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    vocab = int(_require(hf, "vocab_size", where))
    if padded_vocab_size is None:
        multiple = vocab_multiple * tensor_parallel
        padded_vocab_size = math.ceil(vocab / multiple) * multiple
    if padded_vocab_size < vocab:
        raise ConfigError(f"{where}: padded vocab size {padded_vocab_size} < vocab_size {vocab}")
    rope_theta, rope_scaling = _parse_rope(hf, spec, where)
    num_layers = int(_require(hf, "num_hidden_layers", where))
    moe = _parse_moe(hf, spec, num_layers, where)
    return ModelArchitecture(
        architecture=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(_require(hf, "intermediate_size", where)),
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=vocab,
        padded_vocab_size=padded_vocab_size,
        max_position_embeddings=int(_require(hf, "max_position_embeddings", where)),
        rms_norm_eps=float(_require(hf, "rms_norm_eps", where)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get(spec.qkv_bias_key, spec.qkv_bias)) if spec.qkv_bias_key else spec.qkv_bias,
        qk_norm=bool(hf.get(spec.qk_norm_key, spec.qk_norm)) if spec.qk_norm_key else spec.qk_norm,
        rotary_percent=_parse_partial_rotary(hf, spec, head_dim, where),
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
        hf_config=hf,
        **moe,
        **mla,
    )


def _parse_mla(hf: Mapping, heads: int, where: str) -> dict:
    """DeepSeek-V3's multi-head latent attention fields, as megatron-core's MLASelfAttention builds them."""
    if hf.get("rope_interleave", True) is False:
        # megatron-core's MLA rope always takes the rope dims as interleaved pairs (HF's rope_interleave true)
        raise ConfigError(f"{where}: rope_interleave=false is not supported (megatron-core's MLA rope is interleaved)")
    if int(hf.get("num_key_value_heads") or heads) != heads:
        raise ConfigError(f"{where}: num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads={heads} "
                          f"is not supported for multi-head latent attention")
    if hf.get("quantization_config"):
        raise ConfigError(f"{where}: quantization_config (quantized weights, e.g. DeepSeek-V3's fp8 release) is not "
                          f"supported: convert the checkpoint to bf16 first")
    if int(hf.get("moe_layer_freq") or 1) != 1:
        raise ConfigError(f"{where}: moe_layer_freq={hf['moe_layer_freq']} is not supported (only 1: every layer "
                          f"after first_k_dense_replace sparse)")
    eps = float(_require(hf, "rms_norm_eps", where))
    if eps != 1e-6:
        # transformers' q_a_layernorm / kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says; SGLang's use
        # rms_norm_eps; megatron's use rms_norm_eps. DeepSeek's checkpoints have 1e-6, where all agree.
        raise ConfigError(f"{where}: rms_norm_eps={eps} with multi-head latent attention is not supported (only 1e-6: "
                          f"transformers' q_a / kv_a layernorms use 1e-6 whatever it says)")
    q_lora = hf.get("q_lora_rank")
    out = dict(q_lora_rank=int(q_lora or 0), kv_lora_rank=int(_require(hf, "kv_lora_rank", where)),
               qk_nope_head_dim=int(_require(hf, "qk_nope_head_dim", where)),
               qk_rope_head_dim=int(_require(hf, "qk_rope_head_dim", where)),
               v_head_dim=int(_require(hf, "v_head_dim", where)))
    if q_lora is not None and out["q_lora_rank"] < 1:
        raise ConfigError(f"{where}: q_lora_rank={q_lora} must be >= 1 or null")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if out[key] < 1:
            raise ConfigError(f"{where}: {key}={out[key]} must be >= 1")
    if out["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{where}: qk_rope_head_dim={out['qk_rope_head_dim']} must be even")
    return out


def _parse_moe(hf: Mapping, spec: ArchitectureSpec, num_layers: int, where: str) -> dict:
    """The MoE fields of ModelArchitecture (empty for dense architectures), as the HF model reads them."""
    if not spec.moe:
        return {}
    # Qwen's config.json says num_experts; transformers >= 5 saves it as num_local_experts (an alias).
    keys = ("num_experts", "num_local_experts") if spec.experts_key == "num_experts" else (spec.experts_key,)
    named = {key: hf[key] for key in keys if hf.get(key) is not None}
    if not named:
        raise ConfigError(f"{where}: required key {spec.experts_key!r} is missing")
    if len(set(named.values())) > 1:
        raise ConfigError(f"{where}: num_experts and num_local_experts differ ({named})")
    experts = int(next(iter(named.values())))
    top_k = int(_require(hf, "num_experts_per_tok", where))
    if not 1 <= top_k <= experts:
        raise ConfigError(f"{where}: num_experts_per_tok={top_k} must be in [1, {spec.experts_key}={experts}]")
    moe_width = int(_require(hf, "moe_intermediate_size", where))
    out = dict(num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=moe_width,
               moe_layers=_moe_layers(hf, spec, num_layers, where),
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if spec.shared_expert == "gated":
        shared = int(_require(hf, "shared_expert_intermediate_size", where))
        if shared < 1:
            raise ConfigError(f"{where}: shared_expert_intermediate_size={shared} must be >= 1")
        out.update(shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
    elif spec.shared_expert == "counted":
        count = int(hf.get("n_shared_experts") or 0)
        out.update(shared_expert_ffn_hidden_size=count * moe_width)
    if spec.router == "softmax":
        # HF adds router_aux_loss_coef * the load-balancing loss only with output_router_logits.
        out["router_aux_loss_coef"] = (float(hf.get("router_aux_loss_coef") or 0.0)
                                       if hf.get("output_router_logits") else 0.0)
        return out
    out.update(_parse_sigmoid_router(hf, experts, top_k, where))
    return out


def _moe_layers(hf: Mapping, spec: ArchitectureSpec, num_layers: int, where: str) -> tuple[int, ...]:
    if spec.moe_layout == "first_k_dense":
        first = int(hf.get("first_k_dense_replace") or 0)
        if not 0 <= first < num_layers:
            raise ConfigError(f"{where}: first_k_dense_replace={first} must be in [0, num_hidden_layers={num_layers})")
        return tuple(range(first, num_layers))
    step = int(hf["decoder_sparse_step"]) if hf.get("decoder_sparse_step") is not None else 1
    if step < 1:
        raise ConfigError(f"{where}: decoder_sparse_step={step} must be >= 1")
    dense_only = hf.get("mlp_only_layers") or []
    if not isinstance(dense_only, (list, tuple)) or any(not isinstance(i, int) for i in dense_only):
        raise ConfigError(f"{where}: mlp_only_layers={dense_only!r} must be a list of layer indices")
    moe_layers = tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    if not moe_layers:
        raise ConfigError(f"{where}: no sparse layer (decoder_sparse_step={step}, mlp_only_layers={dense_only})")
    return moe_layers


def _parse_sigmoid_router(hf: Mapping, experts: int, top_k: int, where: str) -> dict:
    """GLM-4.5 / DeepSeek-V3's router as megatron-core's sigmoid router with expert bias builds it."""
    if top_k > 1 and not hf.get("norm_topk_prob", False):
        # megatron-core's sigmoid router always normalises the top-k weights
        raise ConfigError(f"{where}: norm_topk_prob=false with the sigmoid router is not supported")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"{where}: topk_method={hf['topk_method']!r} is not supported (only 'noaux_tc')")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"{where}: scoring_func={hf['scoring_func']!r} is not supported (only 'sigmoid')")
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if groups > 1:
        if experts % groups or not 1 <= group_topk <= groups:
            raise ConfigError(f"{where}: n_group={groups} / topk_group={group_topk} do not split {experts} experts")
        # HF ranks a group by the sum of its best 2 scores; megatron-core by its best top_k / topk_group.
        if top_k % group_topk or top_k // group_topk != 2:
            raise ConfigError(f"{where}: n_group={groups} with num_experts_per_tok={top_k} / topk_group={group_topk} "
                              f"!= 2 is not supported (megatron-core ranks a group by its best "
                              f"num_experts_per_tok / topk_group scores, HF by its best 2)")
    else:
        groups, group_topk = 0, 0
    return dict(router_score_function="sigmoid", expert_bias=True, moe_num_groups=groups, moe_group_topk=group_topk,
                routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0), router_aux_loss_coef=0.0,
                mtp_layers=int(hf.get("num_nextn_predict_layers") or 0))


def _parse_partial_rotary(hf: Mapping, spec: ArchitectureSpec, head_dim: int, where: str) -> float:
    params = hf.get("rope_parameters") or {}
    given = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    factor = float(given) if given is not None else (spec.partial_rotary_default or 1.0)
    if factor != 1.0 and spec.partial_rotary_default is None:
        raise ConfigError(f"{where}: partial_rotary_factor={factor} is not supported for model_type "
                          f"{spec.model_type!r}")
    rotary = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary % 2:
        raise ConfigError(f"{where}: partial_rotary_factor={factor} gives {rotary} rotary dims of head_dim "
                          f"{head_dim} (must be even and > 0)")
    return factor


def _reject_math_changes(hf: Mapping, spec: ArchitectureSpec, where: str) -> None:
    """Fields whose non-default value changes the network's math in a way we do not build."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (only 'silu' / SwiGLU)")
    if spec.attention_bias_key and hf.get(spec.attention_bias_key):
        raise ConfigError(f"{where}: {spec.attention_bias_key}=true (biases on q/k/v/o_proj) is not supported")
    if hf.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported (sliding-window attention)")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"{where}: layer_types {sorted(set(layer_types))} is not supported "
                          f"(only 'full_attention')")
    # transformers writes num_local_experts beside num_experts for Qwen3-MoE (an alias).
    own = (() if not spec.moe else ("num_experts", "num_local_experts") if spec.experts_key == "num_experts"
           else (spec.experts_key,))
    for key in [k for k in ("n_routed_experts", "num_experts", "num_local_experts") if k not in own]:
        if hf.get(key):
            moe_types = ", ".join(sorted(t for t, s in ARCHITECTURES.items() if s.moe))
            raise ConfigError(f"{where}: {key}={hf[key]} (mixture of experts) is not supported for model_type "
                              f"{spec.model_type!r} (supported: {moe_types})")
    shared_key = {"gated": "shared_expert_intermediate_size", "counted": "n_shared_experts"}.get(spec.shared_expert)
    for key in ("n_shared_experts", "shared_expert_intermediate_size"):
        if key != shared_key and hf.get(key):
            raise ConfigError(f"{where}: {key}={hf[key]} (shared experts) is not supported for model_type "
                              f"{spec.model_type!r}")


def _parse_rope(hf: Mapping, spec: ArchitectureSpec,
                where: str) -> tuple[float, Llama3RopeScaling | YarnRopeScaling | None]:
    # transformers >= 5 writes "rope_parameters" (with rope_theta inside); older configs write
    # top-level "rope_theta" and an optional "rope_scaling" dict.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if spec.mla:
        if rope_type != "yarn":
            raise ConfigError(f"{where}: rope type {rope_type!r} is not supported for model_type {spec.model_type!r} "
                              f"(supported: default, yarn)")
        return float(theta), _parse_yarn(hf, params, where)
    if rope_type == "llama3":
        try:
            return float(theta), Llama3RopeScaling(
                factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]))
        except KeyError as exc:
            raise ConfigError(f"{where}: rope scaling 'llama3' is missing {exc}") from None
    raise ConfigError(f"{where}: rope type {rope_type!r} is not supported (supported: default, llama3)")


def _parse_yarn(hf: Mapping, params: Mapping, where: str) -> YarnRopeScaling:
    """HF's yarn rope parameters (transformers' _compute_yarn_parameters, DeepseekV3Attention's scaling)."""
    for key, value in (("attention_factor", None), ("truncate", True)):
        if params.get(key, value) != value:
            raise ConfigError(f"{where}: rope scaling yarn with {key}={params[key]!r} is not supported")
    original = int(params.get("original_max_position_embeddings") or 0)
    if original < 1:
        raise ConfigError(f"{where}: rope scaling 'yarn' is missing 'original_max_position_embeddings'")
    factor = params.get("factor")
    # transformers: no factor = max_position_embeddings / original_max_position_embeddings
    factor = float(factor) if factor is not None else int(_require(hf, "max_position_embeddings", where)) / original
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if all_dim and not mscale:
        raise ConfigError(f"{where}: rope scaling yarn with mscale_all_dim={all_dim} and mscale={mscale!r} is not "
                          f"supported (megatron-core's attention factor would differ from transformers')")
    if not (mscale and all_dim):
        mscale, all_dim = 1.0, 0.0  # HF's attention factor get_mscale(factor); no softmax mscale
    return YarnRopeScaling(factor=factor, original_max_position_embeddings=original,
                           beta_fast=float(params.get("beta_fast") or 32),
                           beta_slow=float(params.get("beta_slow") or 1),
                           mscale=float(mscale), mscale_all_dim=float(all_dim))
