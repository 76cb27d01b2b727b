"""Build megatron-core GPTModel chunks for this rank from a ModelArchitecture.

    layout = ParallelLayout(tensor=2, pipeline=2)
    initialize_model_parallel(layout)
    cfg = ModelArchitecture.from_hf("/models/Qwen3-8B", tensor_parallel=layout.tensor)
    chunks = build_model(cfg, layout)                # list: one chunk per virtual stage
    load_hf_weights(chunks, cfg, "/models/Qwen3-8B")   # megatron_grpo.convert

pre_process / post_process come from megatron's parallel_state, so the same call builds the
right stage on every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass

import torch

from megatron_grpo.errors import ConfigError
from megatron_grpo.launch.parallel import ParallelLayout
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.models.rope import rope_inv_freq
from megatron_grpo.models.spec import Backend, block_spec, resolve_backend

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
log = logging.getLogger(__name__)
_warned_frozen_bias: set[str] = set()


@dataclass(frozen=True)
class Recompute:
    """Activation recompute (megatron's recompute_granularity / method / num_layers)."""

    granularity: str | None = None  # None | "selective" (core attention) | "full" (whole layers)
    method: str | None = None       # "uniform" | "block", for granularity="full"
    num_layers: int | None = None


def transformer_config(model_config: ModelArchitecture, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
                       recompute: Recompute = Recompute(), backend: Backend = "auto"):
    """The megatron TransformerConfig of this model under `layout` (`backend`: model.attention_backend)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in _DTYPES:
        raise ConfigError(f"model dtype {dtype}: expected torch.float32 or torch.bfloat16")
    model_config.check_tensor_parallel(layout.tensor)
    model_config.check_expert_parallel(layout.expert, layout.expert_tensor_size)
    on_gpu = torch.cuda.is_available()
    config_class, mla = TransformerConfig, {}
    if model_config.is_mla:
        config_class, mla = _mla_config(model_config, layout, backend)
    return config_class(
        num_layers=model_config.num_layers,
        hidden_size=model_config.hidden_size,
        ffn_hidden_size=model_config.ffn_hidden_size,
        num_attention_heads=model_config.num_attention_heads,
        num_query_groups=model_config.num_query_groups,
        kv_channels=model_config.head_dim,  # Qwen3: head_dim != hidden / heads
        normalization="RMSNorm",
        layernorm_epsilon=model_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_config.qkv_bias,
        qk_layernorm=model_config.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=model_config.attention_dropout,
        init_method_std=float(model_config.hf_config.get("initializer_range", 0.02)),
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.context,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # Fusions need CUDA kernels; on GPU the trainer may turn them on through its own config.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        batch_p2p_sync=on_gpu,
        # As Megatron-LM's training arguments: the interleaved schedule overlaps its p2p and does not
        # batch it. Batched, at PP=2 (next and previous stage are one rank) an activation and a
        # gradient of the same shape travel to one peer in one batch in opposite orders and are
        # received swapped (measured on gloo: the micro-batches after the first group went wrong).
        overlap_p2p_comm=layout.virtual_pipeline is not None,
        batch_p2p_comm=layout.virtual_pipeline is None,
        recompute_granularity=recompute.granularity,
        recompute_method=recompute.method if recompute.granularity == "full" else None,
        recompute_num_layers=recompute.num_layers if recompute.granularity == "full" else None,
        **moe_config(model_config, layout, grouped_gemm=resolve_backend(backend, dtype) == "te",
                     balanced_routing=backend == "memory-model"),
        **mla,
    )


def _mla_config(model_config: ModelArchitecture, layout: ParallelLayout, backend: Backend):
    """megatron-core's MLATransformerConfig fields for DeepSeek-V3's attention (HF names in the comments).

    RoPE: megatron's MLA builds its own rotary embedding per layer (GPTModel builds none): RotaryEmbedding
    ("rope") or YarnRotaryEmbedding ("yarn"), over qk_rope_head_dim, taking the rope dims as interleaved pairs
    (HF's rope_interleave true). Its YaRN frequencies, attention factor on cos / sin and softmax scale
    mscale(factor, mscale_all_dim)^2 / sqrt(q/k head) are transformers' formulas (checked against HF's logits,
    tests/test_deepseek_v3.py; hf_config.YarnRopeScaling maps the one case where the two read mscale apart)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if layout.context > 1 and resolve_backend(backend) != "te":
        raise ConfigError(f"parallel.context={layout.context}: model_type {model_config.architecture!r} (multi-head "
                          f"latent attention) runs context parallel only with model.attention_backend=te; our "
                          f"context-parallel attention takes one head dim for q, k and v")
    yarn = model_config.rope_scaling
    fields = dict(multi_latent_attention=True,
                  q_lora_rank=model_config.q_lora_rank or None,   # None: one q_proj (linear_q_proj)
                  kv_lora_rank=model_config.kv_lora_rank,
                  qk_head_dim=model_config.qk_nope_head_dim,      # qk_nope_head_dim
                  qk_pos_emb_head_dim=model_config.qk_rope_head_dim,
                  v_head_dim=model_config.v_head_dim,
                  rotary_base=model_config.rope_theta,
                  rope_type="rope" if yarn is None else "yarn",
                  mscale=1.0, mscale_all_dim=0.0)  # no YaRN: megatron's softmax mscale is then 1
    if yarn is not None:
        fields.update(rotary_scaling_factor=yarn.factor,
                      original_max_position_embeddings=yarn.original_max_position_embeddings,
                      beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=yarn.mscale,
                      mscale_all_dim=yarn.mscale_all_dim)
    return MLATransformerConfig, fields



def moe_config(model_config: ModelArchitecture, layout: ParallelLayout, grouped_gemm: bool = False,
               balanced_routing: bool = False) -> dict:
    """TransformerConfig's MoE fields for HF Qwen3-MoE's math (nothing for dense models).

    Router: HF takes softmax over all experts, then the top-k, renormalised when norm_topk_prob.
    megatron's top-k of the logits followed by a softmax over the k chosen (pre_softmax off) is that
    renormalised distribution; pre_softmax on (softmax, then top-k) is the unnormalised one.
    Aux loss: HF's Switch loss E * sum_e f_e * P_e (f_e: fraction of token-slots routed to e, P_e:
    mean router probability of e), added as router_aux_loss_coef * loss when output_router_logits.
    HF pools the router logits of all layers into one batch first; megatron applies the formula per
    layer and sums, with f_e divided by top-k. We take coef * top_k / num_moe_layers: the mean over
    layers of HF's per-layer loss (equal to HF's value for one MoE layer or equal routing
    statistics in every layer). Capacity factor / token dropping off: every token reaches its k
    experts (HF drops none)."""
    if not model_config.is_moe:
        return {}
    coef = model_config.router_aux_loss_coef
    return dict(
        num_moe_experts=model_config.num_experts,
        moe_router_topk=model_config.moe_top_k,
        moe_ffn_hidden_size=model_config.moe_ffn_hidden_size,
        # Shared experts: megatron's SharedExpertMLP (Qwen2-MoE's output times sigmoid(gate_weight . x)).
        moe_shared_expert_intermediate_size=model_config.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=model_config.shared_expert_gate,
        moe_layer_freq=[1 if i in model_config.moe_layers else 0 for i in range(model_config.num_layers)],
        moe_router_pre_softmax=not model_config.norm_topk_prob and model_config.router_score_function == "softmax",
        moe_router_score_function=model_config.router_score_function,
        # GLM-4.5 / DeepSeek-V3 (sigmoid): groups, scaling; HF computes these routers in fp32. The expert
        # bias is installed frozen by install_frozen_expert_bias (megatron's own, moe_router_enable_expert_bias,
        # is created on CUDA and updated by its aux-loss-free rule: see docs/models.md).
        moe_router_num_groups=model_config.moe_num_groups or None,
        moe_router_group_topk=model_config.moe_group_topk or None,
        moe_router_topk_scaling_factor=(model_config.routed_scaling_factor
                                        if model_config.router_score_function == "sigmoid" else None),
        moe_router_dtype="fp32" if model_config.router_score_function == "sigmoid" else None,
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
        moe_aux_loss_coeff=coef * model_config.moe_top_k / len(model_config.moe_layers),
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=1.0 if balanced_routing else None,
        moe_pad_expert_input_to_capacity=balanced_routing,
        moe_grouped_gemm=grouped_gemm,  # TE's grouped GEMM experts (the TE spec); SequentialMLP otherwise
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor_size,
    )


def current_layout(sequence_parallel: bool = False) -> ParallelLayout:
    """The layout megatron's parallel_state was initialised with."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(tensor=ps.get_tensor_model_parallel_world_size(),
                          pipeline=ps.get_pipeline_model_parallel_world_size(),
                          virtual_pipeline=ps.get_virtual_pipeline_model_parallel_world_size(),
                          context=ps.get_context_parallel_world_size(),
                          sequence_parallel=sequence_parallel,
                          expert=ps.get_expert_model_parallel_world_size(),
                          expert_tensor=ps.get_expert_tensor_parallel_world_size())


def build_model(model_config: ModelArchitecture, layout: ParallelLayout | None = None, *,
                dtype: torch.dtype = torch.float32, backend: Backend = "auto",
                recompute: Recompute = Recompute(), fp32_lm_head: bool = False) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage; one without VPP).

    bf16 chunks are wrapped in megatron's Float16Module (fp32 logits out), as megatron-LM does;
    with fp32_lm_head the output layer's matmul itself runs in fp32 (models/fp32_head.py)."""
    chunks = _build(model_config, layout, dtype, backend, recompute, fp32_lm_head)
    if (model_config.is_moe and chunks[0].config.tensor_model_parallel_size > 1
            and not chunks[0].config.sequence_parallel):
        # megatron-core's MoELayer refuses to train so (ValueError at the first forward).
        raise ConfigError("a mixture-of-experts model with parallel.tensor > 1 trains only with "
                          "parallel.sequence_parallel=true (megatron-core's MoE layer requires it)")
    return chunks


def _build(model_config: ModelArchitecture, layout: ParallelLayout | None, dtype: torch.dtype, backend: Backend,
           recompute: Recompute, fp32_lm_head: bool = False) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps

    actual = current_layout(layout.sequence_parallel if layout else False)
    if layout is not None and layout.expert_tensor is None:  # None = TP: compare what it resolves to
        layout = dataclasses.replace(layout, expert_tensor=layout.tensor)
    if layout is not None and layout != actual:
        raise ConfigError(f"build_model: layout {layout} differs from the initialised parallel state {actual}")
    requested = backend
    backend = resolve_backend(backend, dtype)  # model.attention_backend -> te / torch_varlen / local (logged once)
    if model_config.is_mla and requested == "auto" and backend == "torch_varlen":
        log.info("attention backend: local for multi-head latent attention (torch_varlen takes one head dim)")
        backend = "local"
    config = transformer_config(model_config, actual, dtype, recompute, backend)
    vp_stages = [None] if actual.virtual_pipeline is None else list(range(actual.virtual_pipeline))
    chunks = []
    for vp_stage in vp_stages:
        pre = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        spec = block_spec(model_config, config, actual.context, backend, vp_stage)
        chunks.append(_build_chunk(model_config, config, spec, pre, post, vp_stage, dtype,
                                   local_context_parallel=actual.context > 1 and backend != "te",
                                   fp32_lm_head=fp32_lm_head))
    return chunks


def _build_chunk(model_config, config, spec, pre_process, post_process, vp_stage, dtype, local_context_parallel,
                 fp32_lm_head=False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from megatron_grpo.launch.mcore_compat import mla_without_transformer_engine

    building = mla_without_transformer_engine() if model_config.is_mla else contextlib.nullcontext()
    with building:
        model = _gpt_model(GPTModel, model_config, config, spec, pre_process, post_process, vp_stage)
    if not model_config.is_mla:  # MLA's rotary embeddings live in its attention layers (see _mla_config)
        # Our inv_freq honours every llama3 rope field of the config (see models/rope.py).
        inv_freq = model.rotary_pos_emb.inv_freq
        model.rotary_pos_emb.inv_freq = rope_inv_freq(
            model_config.rotary_dim, model_config.rope_theta, model_config.rope_scaling).to(inv_freq.device)
    if model_config.is_mla and torch.cuda.is_available():
        # the down projections' model-opt Linear (mcore_compat.replicated_linear) is created on the CPU
        for layer in model.decoder.layers:
            for name in ("linear_q_down_proj", "linear_kv_down_proj"):
                module = getattr(layer.self_attention, name, None)
                if module is not None:
                    module.to(torch.cuda.current_device())
    if model_config.expert_bias:
        install_frozen_expert_bias(model, model_config)
    if local_context_parallel:
        from megatron_grpo.ops.context_parallel import ContextParallelRotaryEmbedding

        # Same module and state, our CP slicing in forward (see ops/context_parallel.py).
        model.rotary_pos_emb.__class__ = ContextParallelRotaryEmbedding
    if fp32_lm_head and post_process:
        from megatron_grpo.models.fp32_head import use_fp32_output_layer

        use_fp32_output_layer(model.output_layer)  # same module and state, fp32 matmul
    if dtype == torch.bfloat16:
        return Float16Module(config, model)
    return model


def _gpt_model(GPTModel, model_config, config, spec, pre_process, post_process, vp_stage):
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model_config.padded_vocab_size,
        max_sequence_length=model_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model_config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=model_config.rope_theta,
        rotary_percent=model_config.rotary_percent,
        vp_stage=vp_stage,
    )


def install_frozen_expert_bias(model, model_config: ModelArchitecture) -> None:
    """Gives every router of `model` an `expert_bias` buffer (fp32 [num_experts], HF's
    e_score_correction_bias, loaded by the converter), which megatron-core's top-k routing adds to
    the sigmoid scores to choose the experts. Built with moe_router_enable_expert_bias off, megatron
    neither counts tokens for nor updates it: the bias stays at its checkpoint value (frozen)."""
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        weight = router.weight
        if "expert_bias" in router.__dict__:
            del router.expert_bias  # megatron's plain None attribute when its own bias is off
        router.register_buffer("expert_bias", torch.zeros(model_config.num_experts, dtype=torch.float32,
                                                          device=weight.device))
    if model_config.architecture not in _warned_frozen_bias:
        _warned_frozen_bias.add(model_config.architecture)
        log.warning("%s: the routers' e_score_correction_bias (aux-loss-free load balancing) stays frozen at the "
                    "checkpoint's values; megatron-core's bias update rule (moe_router_bias_update_rate) is not "
                    "applied", model_config.architecture)


def build_reference_model(model_config: ModelArchitecture, layout: ParallelLayout | None = None, *,
                          dtype: torch.dtype = torch.float32, backend: Backend = "auto",
                          fp32_lm_head: bool = False) -> list[torch.nn.Module]:
    """Same network as build_model, frozen (requires_grad False) and in eval mode; no optimizer."""
    chunks = _build(model_config, layout, dtype, backend, Recompute(), fp32_lm_head)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    from megatron.core.models.gpt import GPTModel

    module = chunk
    while not isinstance(module, GPTModel):
        inner = getattr(module, "module", None)
        if inner is None:
            raise TypeError(f"{type(chunk).__name__} does not wrap a megatron GPTModel")
        module = inner
    return module
