"""models/: HF config parsing, Llama 3 RoPE, and Megatron logits vs the HF transformers model at
(TP, PP) in {(1,1), (2,1), (1,2), (2,2)} for tiny Qwen2, Qwen3 and Llama 3 models."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_grpo.errors import ConfigError
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.models.tiny import TINY_CONFIGS, save_tiny_hf_model, tiny_hf_config
from megatron_grpo.testing.distributed import run_distributed

ARCHS = ("qwen2", "qwen3", "llama")
SEQ, BATCH = 40, 2


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def test_model_config_fields():
    cfg = ModelArchitecture.from_hf(tiny_hf_config("qwen3"), tensor_parallel=2, vocab_multiple=128)
    assert (cfg.head_dim, cfg.num_query_groups, cfg.qk_norm, cfg.qkv_bias) == (32, 2, True, False)
    assert cfg.padded_vocab_size == 256 and cfg.tie_word_embeddings
    assert ModelArchitecture.from_hf(TINY_CONFIGS["qwen2"], vocab_multiple=8).padded_vocab_size == 256
    assert ModelArchitecture.from_hf(TINY_CONFIGS["qwen2"]).qkv_bias
    llama = ModelArchitecture.from_hf(TINY_CONFIGS["llama"])
    assert llama.rope_scaling.original_max_position_embeddings == 64 and llama.rope_theta == 500000.0
    again = ModelArchitecture.from_dict(llama.to_dict())
    assert again == llama and again.padded_vocab_size == llama.padded_vocab_size


@pytest.mark.parametrize("overrides, message", [
    (dict(model_type="mistral"), "model_type 'mistral' is not supported"),
    (dict(model_type="mixtral"), "model_type 'mixtral' is not supported"),
    (dict(architectures=["Qwen2ForSequenceClassification"]), "architectures"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    (dict(num_attention_heads=3), "not a multiple"),
])
def test_unsupported_configs_raise(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen2"], **overrides))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_output_projection_bias_rejected(arch):
    with pytest.raises(ConfigError, match="attention_bias=true"):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS[arch], attention_bias=True))
    if arch == "llama":
        with pytest.raises(ConfigError, match="mlp_bias"):
            ModelArchitecture.from_hf(dict(TINY_CONFIGS[arch], mlp_bias=True))


def test_tp_must_divide():
    cfg = ModelArchitecture.from_hf(TINY_CONFIGS["qwen2"])
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        cfg.check_tensor_parallel(4)


def test_llama3_inv_freq_matches_transformers():
    # Reference: transformers' own llama3 rope initialisation, with non-default factors
    # (megatron-core's built-in scaling hard-codes 1 / 4 / 8192 and would differ).
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_grpo.models.rope import rope_inv_freq

    hf_config = tiny_hf_config("llama")
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    cfg = ModelArchitecture.from_hf(hf_config)
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(ours, expected.float())
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    ratio = plain / ours  # all three bands are exercised: kept (1), interpolated, divided by factor (4)
    assert ratio[0] == 1 and ((ratio > 1.01) & (ratio < 3.99)).any() and (ratio > 3.99).any()


def _megatron_logits(rank, world_size, paths, tp, pp):
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import build_model, build_reference_model
    from megatron_grpo.testing.logits import forward_only_logits

    layout = ParallelLayout(tensor=tp, pipeline=pp)
    initialize_model_parallel(layout)
    results = {}
    for arch, path in paths.items():
        cfg = ModelArchitecture.from_hf(path, tensor_parallel=tp, vocab_multiple=8)
        build = build_reference_model if arch == "qwen3" else build_model  # both paths are exercised
        chunks = build(cfg, layout)
        load_hf_weights(chunks, cfg, path)
        if arch == "qwen3":
            assert not any(p.requires_grad for p in chunks[0].parameters()) and not chunks[0].training
        full = forward_only_logits(chunks, _tokens(cfg.vocab_size))
        if full is not None:
            assert full.shape[-1] == cfg.padded_vocab_size
            results[arch] = full[..., : cfg.vocab_size].numpy()
    return results


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: str(save_tiny_hf_model(arch, root / arch, seed=i)) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def hf_logits(hf_models):
    from transformers import AutoModelForCausalLM

    out = {}
    for arch, path in hf_models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out[arch] = model(_tokens(model.config.vocab_size)).logits.numpy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logits_match_hf(hf_models, hf_logits, tp, pp):
    results = run_distributed(_megatron_logits, world_size=tp * pp, args=(hf_models, tp, pp), timeout=300)
    last_stage = results[-tp:]  # ranks of the last PP stage (TP is the fastest-varying dimension)
    for arch in ARCHS:
        ref = hf_logits[arch]
        for got in (r[arch] for r in last_stage):
            rel = np.abs(got - ref).max() / np.abs(ref).max()
            assert rel <= 1e-5, f"{arch} TP={tp} PP={pp}: max relative error {rel:.2e}"
    assert all(not r for r in results[:-tp])  # earlier stages produce no logits


def _bf16_logits(rank, world_size, path):
    from megatron_grpo.convert import export_hf_weights, load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import build_model

    initialize_model_parallel(ParallelLayout())
    cfg = ModelArchitecture.from_hf(path, vocab_multiple=8)
    chunks = build_model(cfg, dtype=torch.bfloat16)
    load_hf_weights(chunks, cfg, path)
    assert next(chunks[0].parameters()).dtype == torch.bfloat16
    exported = dict(export_hf_weights(chunks, cfg))
    tokens = _tokens(cfg.vocab_size)
    logits = chunks[0](tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1), None)
    return logits[..., : cfg.vocab_size].detach().float().numpy(), exported["model.norm.weight"].dtype


@pytest.mark.slow
def test_bf16_build(hf_models, hf_logits):
    logits, exported_dtype = run_distributed(_bf16_logits, 1, args=(hf_models["llama"],), timeout=300)[0]
    ref = hf_logits["llama"]
    assert exported_dtype == torch.bfloat16
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 5e-2  # bf16 weights and activations


def _fp32_head(rank, world_size, path):
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import build_model, unwrap

    initialize_model_parallel(ParallelLayout())
    cfg = ModelArchitecture.from_hf(path, vocab_multiple=8)
    tokens = _tokens(cfg.vocab_size)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    out = {}
    for fp32_head in (False, True):
        (chunk,) = build_model(cfg, dtype=torch.bfloat16, fp32_lm_head=fp32_head)
        load_hf_weights([chunk], cfg, path)
        head = unwrap(chunk).output_layer
        seen = {}
        head.register_forward_hook(lambda module, args, output, seen=seen: seen.update(hidden=args[0]))
        logits = chunk(tokens, positions, None)
        weight = unwrap(chunk).shared_embedding_or_output_weight()
        exact = (seen["hidden"].float() @ weight.float().t()).transpose(0, 1)  # [s, b, V] -> [b, s, V]
        logits.float().sum().backward()
        out[fp32_head] = dict(err=float((logits.float() - exact).abs().max()), weight_dtype=weight.dtype,
                              grad=weight.main_grad if hasattr(weight, "main_grad") else weight.grad)
    return {k: dict(err=v["err"], weight_dtype=v["weight_dtype"], grad_dtype=v["grad"].dtype,
                    grad_finite=bool(v["grad"].float().isfinite().all())) for k, v in out.items()}


@pytest.mark.slow
def test_fp32_lm_head_computes_the_head_in_fp32(hf_models):
    """model.fp32_lm_head: in a bf16 model the output layer's matmul runs in fp32 (its logits are
    exactly fp32(hidden) @ fp32(weight)), the weight stays bf16 and its gradient reaches it; without
    it the logits carry bf16 rounding. The local engine's HF model does the same."""
    from megatron_grpo.rollout.local import LocalEngine

    result = run_distributed(_fp32_head, 1, args=(hf_models["qwen3"],), timeout=300)[0]
    assert result[True]["err"] == 0.0
    assert result[False]["err"] > 1e-3  # bf16 logits: rounded
    for side in result.values():
        assert side["weight_dtype"] == torch.bfloat16 and side["grad_finite"]
    engine = LocalEngine.from_pretrained(hf_models["qwen3"], dtype=torch.bfloat16, fp32_lm_head=True)
    head = engine.model.get_output_embeddings()
    hidden = torch.randn(2, 3, head.weight.shape[1], dtype=torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(hidden.float(), head.weight.float()))
