"""Declarative Megatron <-> HF parameter tables, one per architecture, and their binding to a
model chunk. This module (with hf_io / writer) is the only place that knows HF parameter names.

Names use "{layer}": the global layer index on the HF side, the chunk-local index on the Megatron
side (megatron numbers layers per chunk; TransformerLayer.layer_number is the global 1-based one).
A rule lists Megatron name alternatives: the local spec name first, then Transformer Engine's
(TE fuses the pre-attention / pre-MLP norms into linear_qkv / linear_fc1).

MoE layers (qwen3_moe, qwen2_moe, glm4_moe): the router (HF mlp.gate) and one gate/up/down triple per expert under
"{expert}": the chunk-local expert index on the Megatron side (SequentialMLP's local_experts.{e},
TE grouped GEMM's weight{e}), the global one on the HF side (EP rank r holds experts
r * E/EP .. (r+1) * E/EP - 1). Expert tensors are split over the expert tensor-parallel group
(ETP), which need not be the TP group: bind() gives each its own ETP rank and group.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from megatron_grpo.convert.transforms import (ExpertTensorParallel, FusedGateUp, FusedQKV, Replicated, Split,
                                              Transform, VocabRows)
from megatron_grpo.errors import CheckpointError
from megatron_grpo.lora.attach import is_adapter_parameter
from megatron_grpo.models.hf_config import ModelArchitecture

# Where a tensor lives: "first" = pre_process stage, "last" = post_process stage,
# "last_only" = post_process stage that is not also pre_process (the tied output copy), "layer".
Place = Literal["first", "last", "last_only", "layer"]
LayerKind = Literal["all", "dense", "moe"]  # which layers a "layer" rule applies to
ShapeFn = Callable[[ModelArchitecture], tuple[tuple[int, ...], ...]]


@dataclass(frozen=True)
class Rule:
    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    transform: Transform
    hf_shapes: ShapeFn
    place: Place
    when: Callable[[ModelArchitecture], bool] = lambda cfg: True
    export: bool = True  # False for the tied output-layer copy: HF stores it once, as embed_tokens
    layers: LayerKind = "all"
    per_expert: bool = False  # one tensor per routed expert ("{expert}" in the names)

    def applies_to(self, cfg: ModelArchitecture, layer: int) -> bool:
        if self.layers == "all":
            return True
        return (layer in cfg.moe_layers) == (self.layers == "moe")


def _q_rows(c): return c.num_attention_heads * c.head_dim
def _kv_rows(c): return c.num_query_groups * c.head_dim


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

EMBEDDING = Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), VocabRows(),
                 lambda c: ((c.vocab_size, c.hidden_size),), "first")
FINAL_NORM = Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",), Replicated(),
                  lambda c: ((c.hidden_size,),), "last")
OUTPUT = Rule(("output_layer.weight",), ("lm_head.weight",), VocabRows(),
              lambda c: ((c.vocab_size, c.hidden_size),), "last", when=lambda c: not c.tie_word_embeddings)
# With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding.
TIED_OUTPUT = Rule(("output_layer.weight",), ("model.embed_tokens.weight",), VocabRows(),
                   lambda c: ((c.vocab_size, c.hidden_size),), "last_only",
                   when=lambda c: c.tie_word_embeddings, export=False)

INPUT_NORM = Rule((_L + "input_layernorm.weight", _L + "self_attention.linear_qkv.layer_norm_weight"),
                  (_H + "input_layernorm.weight",), Replicated(), lambda c: ((c.hidden_size,),), "layer")
QKV = Rule((_L + "self_attention.linear_qkv.weight",),
           (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
           FusedQKV(),
           lambda c: ((_q_rows(c), c.hidden_size), (_kv_rows(c), c.hidden_size), (_kv_rows(c), c.hidden_size)),
           "layer")
QKV_BIAS = Rule((_L + "self_attention.linear_qkv.bias",),
                (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
                FusedQKV(), lambda c: ((_q_rows(c),), (_kv_rows(c),), (_kv_rows(c),)), "layer")
Q_NORM = Rule((_L + "self_attention.q_layernorm.weight",), (_H + "self_attn.q_norm.weight",), Replicated(),
              lambda c: ((c.head_dim,),), "layer")
K_NORM = Rule((_L + "self_attention.k_layernorm.weight",), (_H + "self_attn.k_norm.weight",), Replicated(),
              lambda c: ((c.head_dim,),), "layer")
O_PROJ = Rule((_L + "self_attention.linear_proj.weight",), (_H + "self_attn.o_proj.weight",), Split(dim=1),
              lambda c: ((c.hidden_size, _q_rows(c)),), "layer")
POST_ATTN_NORM = Rule((_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"),
                      (_H + "post_attention_layernorm.weight",), Replicated(), lambda c: ((c.hidden_size,),), "layer")
GATE_UP = Rule((_L + "mlp.linear_fc1.weight",), (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
               FusedGateUp(),
               lambda c: ((c.ffn_hidden_size, c.hidden_size), (c.ffn_hidden_size, c.hidden_size)), "layer",
               layers="dense")
DOWN = Rule((_L + "mlp.linear_fc2.weight",), (_H + "mlp.down_proj.weight",), Split(dim=1),
            lambda c: ((c.hidden_size, c.ffn_hidden_size),), "layer", layers="dense")

_E = _H + "mlp.experts.{expert}."
ROUTER = Rule((_L + "mlp.router.weight",), (_H + "mlp.gate.weight",), Replicated(),
              lambda c: ((c.num_experts, c.hidden_size),), "layer", layers="moe")
EXPERT_GATE_UP = Rule((_L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
                       _L + "mlp.experts.linear_fc1.weight{expert}"),
                      (_E + "gate_proj.weight", _E + "up_proj.weight"), FusedGateUp(),
                      lambda c: ((c.moe_ffn_hidden_size, c.hidden_size), (c.moe_ffn_hidden_size, c.hidden_size)),
                      "layer", layers="moe", per_expert=True)
EXPERT_DOWN = Rule((_L + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
                    _L + "mlp.experts.linear_fc2.weight{expert}"),
                   (_E + "down_proj.weight",), Split(dim=1), lambda c: ((c.hidden_size, c.moe_ffn_hidden_size),),
                   "layer", layers="moe", per_expert=True)

# Qwen2-MoE's shared expert (megatron's SharedExpertMLP: split over TP like a dense MLP) and its
# sigmoid gate ([1, hidden], replicated).
_S = _L + "mlp.shared_experts."
SHARED_GATE_UP = Rule((_S + "linear_fc1.weight",),
                      (_H + "mlp.shared_expert.gate_proj.weight", _H + "mlp.shared_expert.up_proj.weight"),
                      FusedGateUp(), lambda c: ((c.shared_expert_ffn_hidden_size, c.hidden_size),) * 2, "layer",
                      layers="moe")
SHARED_DOWN = Rule((_S + "linear_fc2.weight",), (_H + "mlp.shared_expert.down_proj.weight",), Split(dim=1),
                   lambda c: ((c.hidden_size, c.shared_expert_ffn_hidden_size),), "layer", layers="moe")
SHARED_GATE = Rule((_S + "gate_weight",), (_H + "mlp.shared_expert_gate.weight",), Replicated(),
                   lambda c: ((1, c.hidden_size),), "layer", layers="moe")
QKV_BIAS_IF_SET = dataclasses.replace(QKV_BIAS, when=lambda c: c.qkv_bias)
Q_NORM_IF_SET = dataclasses.replace(Q_NORM, when=lambda c: c.qk_norm)
K_NORM_IF_SET = dataclasses.replace(K_NORM, when=lambda c: c.qk_norm)
# GLM-4.5 / DeepSeek-V3: the router's expert bias (a buffer on both sides, models/builder.py's
# install_frozen_expert_bias) and n_shared_experts ungated shared experts (HF: mlp.shared_experts).
EXPERT_BIAS = Rule((_L + "mlp.router.expert_bias",), (_H + "mlp.gate.e_score_correction_bias",), Replicated(),
                   lambda c: ((c.num_experts,),), "layer", layers="moe")
SHARED_EXPERTS_GATE_UP = Rule((_S + "linear_fc1.weight",), (_H + "mlp.shared_experts.gate_proj.weight",
                                                            _H + "mlp.shared_experts.up_proj.weight"),
                              FusedGateUp(), lambda c: ((c.shared_expert_ffn_hidden_size, c.hidden_size),) * 2,
                              "layer", layers="moe", when=lambda c: c.shared_expert_ffn_hidden_size > 0)
SHARED_EXPERTS_DOWN = Rule((_S + "linear_fc2.weight",), (_H + "mlp.shared_experts.down_proj.weight",), Split(dim=1),
                           lambda c: ((c.hidden_size, c.shared_expert_ffn_hidden_size),), "layer", layers="moe",
                           when=lambda c: c.shared_expert_ffn_hidden_size > 0)

# DeepSeek-V3's multi-head latent attention (megatron's MLASelfAttention). The up projections (q_b_proj or
# q_proj, kv_b_proj) are column-parallel, split by output rows over TP, i.e. by heads (each head's rows are
# contiguous in HF's tensors too); o_proj row-parallel; the down projections (q_a_proj, kv_a_proj_with_mqa)
# whole on every TP rank (models/spec.py; TE's are "duplicated" too). The q_a / kv_a RMSNorms: separate
# modules in the local spec, fused into the up projections with Transformer Engine.
_A = _L + "self_attention."
_HA = _H + "self_attn."
def _q_head(c): return c.qk_nope_head_dim + c.qk_rope_head_dim  # noqa: E302


MLA_Q_PROJ = Rule((_A + "linear_q_proj.weight",), (_HA + "q_proj.weight",), Split(dim=0),
                  lambda c: ((c.num_attention_heads * _q_head(c), c.hidden_size),), "layer",
                  when=lambda c: not c.q_lora_rank)
MLA_Q_A_PROJ = Rule((_A + "linear_q_down_proj.weight",), (_HA + "q_a_proj.weight",), Replicated(),
                    lambda c: ((c.q_lora_rank, c.hidden_size),), "layer", when=lambda c: c.q_lora_rank > 0)
MLA_Q_A_NORM = Rule((_A + "q_layernorm.weight", _A + "linear_q_up_proj.layer_norm_weight"),
                    (_HA + "q_a_layernorm.weight",), Replicated(), lambda c: ((c.q_lora_rank,),), "layer",
                    when=lambda c: c.q_lora_rank > 0)
MLA_Q_B_PROJ = Rule((_A + "linear_q_up_proj.weight",), (_HA + "q_b_proj.weight",), Split(dim=0),
                    lambda c: ((c.num_attention_heads * _q_head(c), c.q_lora_rank),), "layer",
                    when=lambda c: c.q_lora_rank > 0)
MLA_KV_A_PROJ = Rule((_A + "linear_kv_down_proj.weight",), (_HA + "kv_a_proj_with_mqa.weight",), Replicated(),
                     lambda c: ((c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),), "layer")
MLA_KV_A_NORM = Rule((_A + "kv_layernorm.weight", _A + "linear_kv_up_proj.layer_norm_weight"),
                     (_HA + "kv_a_layernorm.weight",), Replicated(), lambda c: ((c.kv_lora_rank,),), "layer")
MLA_KV_B_PROJ = Rule((_A + "linear_kv_up_proj.weight",), (_HA + "kv_b_proj.weight",), Split(dim=0),
                     lambda c: ((c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),),
                     "layer")
MLA_O_PROJ = dataclasses.replace(O_PROJ, hf_shapes=lambda c: ((c.hidden_size, c.num_attention_heads * c.v_head_dim),))

MAPPINGS: dict[str, tuple[Rule, ...]] = {
    "llama": (EMBEDDING, INPUT_NORM, QKV, O_PROJ, POST_ATTN_NORM, GATE_UP, DOWN, FINAL_NORM, OUTPUT, TIED_OUTPUT),
    "qwen2": (EMBEDDING, INPUT_NORM, QKV, QKV_BIAS, O_PROJ, POST_ATTN_NORM, GATE_UP, DOWN, FINAL_NORM, OUTPUT,
              TIED_OUTPUT),
    "qwen3": (EMBEDDING, INPUT_NORM, QKV, Q_NORM, K_NORM, O_PROJ, POST_ATTN_NORM, GATE_UP, DOWN, FINAL_NORM,
              OUTPUT, TIED_OUTPUT),
    "qwen3_moe": (EMBEDDING, INPUT_NORM, QKV, Q_NORM, K_NORM, O_PROJ, POST_ATTN_NORM, GATE_UP, DOWN, ROUTER,
                  EXPERT_GATE_UP, EXPERT_DOWN, FINAL_NORM, OUTPUT, TIED_OUTPUT),
    "qwen2_moe": (EMBEDDING, INPUT_NORM, QKV, QKV_BIAS_IF_SET, O_PROJ, POST_ATTN_NORM, GATE_UP, DOWN, ROUTER,
                  EXPERT_GATE_UP, EXPERT_DOWN, SHARED_GATE_UP, SHARED_DOWN, SHARED_GATE, FINAL_NORM, OUTPUT,
                  TIED_OUTPUT),
    "glm4_moe": (EMBEDDING, INPUT_NORM, QKV, QKV_BIAS_IF_SET, Q_NORM_IF_SET, K_NORM_IF_SET, O_PROJ, POST_ATTN_NORM,
                 GATE_UP, DOWN, ROUTER, EXPERT_BIAS, EXPERT_GATE_UP, EXPERT_DOWN, SHARED_EXPERTS_GATE_UP,
                 SHARED_EXPERTS_DOWN, FINAL_NORM, OUTPUT, TIED_OUTPUT),
    "deepseek_v3": (EMBEDDING, INPUT_NORM, MLA_Q_PROJ, MLA_Q_A_PROJ, MLA_KV_A_PROJ, MLA_Q_A_NORM, MLA_Q_B_PROJ,
                    MLA_KV_A_NORM, MLA_KV_B_PROJ, MLA_O_PROJ, POST_ATTN_NORM, GATE_UP, DOWN, ROUTER, EXPERT_BIAS,
                    EXPERT_GATE_UP, EXPERT_DOWN, SHARED_EXPERTS_GATE_UP, SHARED_EXPERTS_DOWN, FINAL_NORM, OUTPUT,
                    TIED_OUTPUT),
}


def sglang_load_together(cfg: ModelArchitecture) -> tuple[tuple[str, ...], ...]:
    """HF names that SGLang 0.5.23's model class must receive in ONE load_weights call: its DeepseekV2 loader
    fuses q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa, caching the first of the pair only for
    the rest of that call (a pair split over two calls is dropped without a word; shown from SGLang's own code by
    tests/test_deepseek_v3.py). Empty for other models."""
    if not (cfg.is_mla and cfg.q_lora_rank):
        return ()
    return tuple(tuple(f"model.layers.{i}.{suffix}" for suffix in SGLANG_FUSED_A_PROJ) for i in range(cfg.num_layers))


# A layer's two MLA down projections, in the order export yields them (MLA_Q_A_PROJ, then MLA_KV_A_PROJ in
# MAPPINGS; rollout/sglang/buckets.py never cuts a weight-sync bucket between them).
SGLANG_FUSED_A_PROJ = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")

# HF files of tied models sometimes still carry the (identical) lm_head; we accept and ignore it.
IGNORED_WHEN_TIED = ("lm_head.weight",)


def ignored_hf_tensors(cfg: ModelArchitecture, present) -> tuple[str, ...]:
    """Tensors of an HF checkpoint that import skips: a tied model's lm_head copy, and the
    multi-token-prediction layers (model.layers.{num_layers + i}.*, GLM-4.5 / DeepSeek-V3), which
    are not trained here (their names are not written back on export)."""
    ignored = list(IGNORED_WHEN_TIED) if cfg.tie_word_embeddings else []
    mtp = tuple(f"model.layers.{cfg.num_layers + i}." for i in range(cfg.mtp_layers))
    return tuple(ignored + [name for name in present if mtp and name.startswith(mtp)])


def rules_for(cfg: ModelArchitecture) -> tuple[Rule, ...]:
    if cfg.architecture not in MAPPINGS:
        raise CheckpointError(f"no conversion table for model_type {cfg.architecture!r}; "
                              f"supported: {', '.join(sorted(MAPPINGS))}")
    return tuple(rule for rule in MAPPINGS[cfg.architecture] if rule.when(cfg))


def expected_hf_tensors(cfg: ModelArchitecture) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the full model -> its shape, in HF order (embedding, layers, norm, head)."""
    out: dict[str, tuple[int, ...]] = {}
    for rule in rules_for(cfg):
        if not rule.export:
            continue
        layers = [i for i in range(cfg.num_layers) if rule.applies_to(cfg, i)] if rule.place == "layer" else [None]
        experts = range(cfg.num_experts) if rule.per_expert else [None]
        for layer in layers:
            for expert in experts:
                for name, shape in zip(rule.hf, rule.hf_shapes(cfg)):
                    out[name.format(layer=layer, expert=expert)] = tuple(shape)
    return dict(sorted(out.items(), key=lambda kv: _hf_order(kv[0])))


def _hf_order(name: str):
    if name.startswith("model.embed_tokens"):
        return (0, 0, 0, name)
    if name.startswith("model.layers."):
        parts = name.split(".")
        expert = int(parts[5]) if parts[3:5] == ["mlp", "experts"] else -1
        return (1, int(parts[2]), expert, name)
    return (2, 0, 0, name)


@dataclass(frozen=True)
class BoundTensor:
    """One rule applied to one parameter of a model chunk."""
    rule: Rule
    megatron_name: str      # name inside the chunk (chunk-local layer index)
    hf_names: tuple[str, ...]
    param: torch.nn.Parameter
    layer: int | None       # global layer index
    expert: int | None = None   # global expert index (per-expert rules)
    # The group this tensor's split is gathered over: None = the TP group; the expert tensor-parallel
    # group for expert tensors (their rule's transform then carries that group's rank and size).
    shard_group: Any = None


def _expert_tensor_parallel(linear) -> tuple[Any, int, int]:
    """(group, rank, size) of the tensor-parallel group an expert's linear layer is split over."""
    import torch.distributed as dist

    group = linear.tp_group
    return group, dist.get_rank(group), dist.get_world_size(group)


def bind(model, cfg: ModelArchitecture) -> list[BoundTensor]:
    """Pairs every parameter of one (unwrapped) GPTModel chunk with its rule, in HF order.
    Raises CheckpointError if a parameter has no rule or a rule finds no parameter."""
    params = {n: p for n, p in model.named_parameters() if not is_adapter_parameter(n)}  # LoRA: not HF weights
    # the routers' expert bias is a buffer (models/builder.py: install_frozen_expert_bias)
    params.update((n, b) for n, b in model.named_buffers() if n.endswith("mlp.router.expert_bias"))
    bound: list[BoundTensor] = []

    def add(rule: Rule, layer_local: int | None, layer_global: int | None, expert_local: int | None = None,
            expert_global: int | None = None, shard: tuple | None = None):
        for candidate in rule.megatron:
            name = candidate.format(layer=layer_local, expert=expert_local)
            if name in params:
                hf = tuple(h.format(layer=layer_global, expert=expert_global) for h in rule.hf)
                group = None
                if shard is not None:
                    group, rank, size = shard
                    rule = dataclasses.replace(rule, transform=ExpertTensorParallel(rule.transform, rank, size))
                bound.append(BoundTensor(rule, name, hf, params[name], layer_global, expert_global, group))
                return
        raise CheckpointError(f"model chunk has none of "
                              f"{[c.format(layer=layer_local, expert=expert_local) for c in rule.megatron]} "
                              f"(model_type {cfg.architecture}); it was not built from this config")

    def add_experts(rule: Rule, local: int, layer) -> None:
        experts = layer.mlp.experts
        for expert_local, expert_global in enumerate(layer.mlp.local_expert_indices):
            linear = (experts.local_experts[expert_local].linear_fc1 if hasattr(experts, "local_experts")
                      else experts.linear_fc1)
            add(rule, local, layer.layer_number - 1, expert_local, expert_global, _expert_tensor_parallel(linear))

    rules = rules_for(cfg)
    first, last = bool(model.pre_process), bool(model.post_process)
    for rule in rules:
        if rule.place == "first" and first:
            add(rule, None, None)
    for local, layer in enumerate(model.decoder.layers):
        for rule in rules:
            if rule.place != "layer" or not rule.applies_to(cfg, layer.layer_number - 1):
                continue
            if rule.per_expert:
                add_experts(rule, local, layer)
            else:
                add(rule, local, layer.layer_number - 1)
    for rule in rules:
        if (rule.place == "last" and last) or (rule.place == "last_only" and last and not first):
            add(rule, None, None)
    unmapped = sorted(set(params) - {b.megatron_name for b in bound})
    if unmapped:
        raise CheckpointError(f"megatron parameters without a conversion rule for {cfg.architecture}: {unmapped}")
    return bound
