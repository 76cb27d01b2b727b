"""deepseek_v3 (multi-head latent attention + sigmoid-routed MoE) on two tiny random configs unlike each other
(models/tiny.py), against the real components:

  deepseek_v3       MLA with q_lora_rank 32 (q_a_proj / q_a_layernorm / q_b_proj), q/k head 16 + 8 rope dims,
                    v head 16, YaRN (factor 4, mscale 0.9 != mscale_all_dim 0.7), layer 0 dense, 16 experts
                    top-4 within the best 2 of 4 groups, random expert bias, scaling 2.5, one shared expert
  deepseek_v3_lite  q_lora_rank null (one q_proj), q/k head 32 + 16 rope dims, v head 24, no rope scaling,
                    layers 0-1 dense, 8 experts top-2, no groups, two shared experts, tied embeddings

HF config parsing and refusals (each naming its field); megatron-core's YaRN against transformers' numbers;
Megatron logits vs HF `transformers` DeepseekV3ForCausalLM (fp32) and HF -> Megatron -> HF bitwise at
(TP, PP, EP, ETP) layouts; the exported HF-named stream through SGLang 0.5.23's own DeepseekV3ForCausalLM
`load_weights` (tests/sglang_models/load_names.py); the first GRPO step at EP2 x TP2 (SP) equal to one process.

Logit tolerance: tests/test_moe_models.py's TOLERANCE (1e-5 of the largest logit: fp32 rounding over
different reduction orders is a few eps times a depth factor; a flipped top-k choice shows as ~1e-1).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_grpo.errors import ConfigError
from megatron_grpo.models.hf_config import ModelArchitecture, YarnRopeScaling
from megatron_grpo.models.tiny import TINY_CONFIGS, save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed
from tests.first_step import SingleProcessSteps, check_step_equals_single, first_step, uneven_samples
from tests.test_moe_models import TOLERANCE, _logits_and_export, _tokens, check_logits_and_round_trip

CONFIGS = ("deepseek_v3", "deepseek_v3_lite")
FP32_EPS = float(torch.finfo(torch.float32).eps)


# ---- config parsing ---------------------------------------------------------------------------
def test_config_fields():
    cfg = ModelArchitecture.from_hf(dict(TINY_CONFIGS["deepseek_v3"], num_nextn_predict_layers=1), vocab_multiple=8)
    mla = (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    assert cfg.is_mla and mla == (32, 32, 16, 8, 16) and (cfg.head_dim, cfg.num_query_groups) == (24, 4)
    assert cfg.rope_scaling == YarnRopeScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                                               beta_slow=1.0, mscale=0.9, mscale_all_dim=0.7)
    router = (cfg.router_score_function, cfg.expert_bias, cfg.moe_num_groups, cfg.moe_group_topk)
    assert router == ("sigmoid", True, 4, 2) and cfg.routed_scaling_factor == 2.5 and cfg.mtp_layers == 1
    assert (cfg.moe_layers, cfg.shared_expert_ffn_hidden_size, cfg.num_experts) == ((1, 2, 3), 16, 16)
    assert ModelArchitecture.from_dict(cfg.to_dict()) == cfg
    lite = ModelArchitecture.from_hf(TINY_CONFIGS["deepseek_v3_lite"], vocab_multiple=8)
    assert (lite.q_lora_rank, lite.kv_lora_rank, lite.head_dim, lite.v_head_dim, lite.rope_scaling) == (0, 16, 48, 24,
                                                                                                        None)
    assert (lite.moe_layers, lite.moe_num_groups, lite.shared_expert_ffn_hidden_size) == ((2, 3), 0, 64)
    assert lite.tie_word_embeddings and ModelArchitecture.from_dict(lite.to_dict()) == lite
    # MLA splits the heads over TP (the up projections and o_proj; the down projections are whole)
    with pytest.raises(ConfigError, match="size 3 does not divide num_attention_heads = 4"):
        cfg.check_tensor_parallel(3)
    whole = ModelArchitecture.from_hf(dict(TINY_CONFIGS["deepseek_v3"], q_lora_rank=33, kv_lora_rank=31))
    whole.check_tensor_parallel(2)  # the down projections (q_lora_rank, kv_lora_rank + rope) are not split


def _yarn(**params):
    base = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    return dict(TINY_CONFIGS["deepseek_v3"], rope_scaling=dict(base, **params))


@pytest.mark.parametrize("overrides, message", [
    (dict(rope_interleave=False), "rope_interleave=false is not supported"),
    (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(norm_topk_prob=False), "norm_topk_prob=false with the sigmoid router"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 != num_attention_heads=4"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 with multi-head latent attention is not supported"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config .* is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(kv_lora_rank=None), "required key 'kv_lora_rank' is missing"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim=7 must be even"),
    (dict(q_lora_rank=0), "q_lora_rank=0 must be >= 1 or null"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace=4 must be in"),
    (dict(n_group=3), "n_group=3 / topk_group=2 do not split 16 experts"),
    (dict(num_experts=16), "num_experts=16 .mixture of experts. is not supported for model_type 'deepseek_v3'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope type 'llama3' is not supported for "
                                                                 "model_type 'deepseek_v3' .supported: default, yarn"),
    (_yarn(attention_factor=1.2), "yarn with attention_factor=1.2 is not supported"),
    (_yarn(truncate=False), "yarn with truncate=False is not supported"),
    (_yarn(mscale_all_dim=1.0), "mscale_all_dim=1.0 and mscale=None is not supported"),
    (dict(_yarn(), rope_scaling={"rope_type": "yarn", "factor": 4.0}), "missing 'original_max_position_embeddings'"),
])
def test_refusals_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS["deepseek_v3"], **overrides))


def test_yarn_is_refused_for_other_models():
    with pytest.raises(ConfigError, match="rope type 'yarn' is not supported .supported: default, llama3"):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen3"], rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                            "original_max_position_embeddings": 64}))


def test_context_parallel_is_refused_with_mla():
    from megatron_grpo.launch.parallel import ParallelLayout
    from megatron_grpo.models.builder import transformer_config

    cfg = ModelArchitecture.from_hf(TINY_CONFIGS["deepseek_v3"])
    with pytest.raises(ConfigError, match="parallel.context=2: model_type 'deepseek_v3' .multi-head latent attention. "
                                          "runs context parallel only with model.attention_backend=te"):
        transformer_config(cfg, ParallelLayout(context=2), backend="local")


@pytest.mark.parametrize("params", [
    dict(factor=4.0, original_max_position_embeddings=64, mscale=0.9, mscale_all_dim=0.7),  # the tiny model's
    dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
         mscale_all_dim=1.0),                                                          # DeepSeek-V3's own
    dict(factor=8.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=0),  # HF ignores mscale
    dict(factor=2.0, original_max_position_embeddings=32, beta_fast=16, beta_slow=2),   # no mscale keys
])
def test_megatron_yarn_equals_transformers(params, monkeypatch):
    """megatron-core's YarnRotaryEmbedding (frequencies and the factor on cos / sin) and MLA's softmax scale,
    built from our YarnRopeScaling, against transformers' DeepseekV3RotaryEmbedding and DeepseekV3Attention
    scaling for the same config: the rope within fp32 rounding of the angle, the scale to a few ulp."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (YarnRotaryEmbedding,
                                                                                   _yarn_get_mscale)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from megatron_grpo.models.tiny import tiny_hf_config

    fields = dict(TINY_CONFIGS["deepseek_v3"], max_position_embeddings=4 * params["original_max_position_embeddings"],
                  rope_scaling=dict(rope_type="yarn", **params))
    cfg = ModelArchitecture.from_hf(fields)
    y = cfg.rope_scaling
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # megatron places it on "CUDA"
    rope = YarnRotaryEmbedding(cfg.qk_rope_head_dim, rotary_base=cfg.rope_theta, scaling_factor=y.factor,
                               original_max_position_embeddings=y.original_max_position_embeddings,
                               beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale,
                               mscale_all_dim=y.mscale_all_dim, use_cpu_initialization=True)
    positions = 3 * y.original_max_position_embeddings
    emb, concentration = rope.get_emb(positions)
    ours_cos, ours_sin = (torch.cos(emb) * concentration).squeeze(), (torch.sin(emb) * concentration).squeeze()
    hf_config = tiny_hf_config("deepseek_v3", **{k: v for k, v in fields.items() if k != "model_type"})
    hf_rope = DeepseekV3RotaryEmbedding(hf_config)
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    angle_rounding = 4 * FP32_EPS * positions * concentration  # cos / sin of an fp32 angle up to `positions`
    assert torch.allclose(ours_cos, cos[0], rtol=0, atol=angle_rounding)
    assert torch.allclose(ours_sin, sin[0], rtol=0, atol=angle_rounding)
    # MultiLatentAttention.__init__: mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(q/k head)
    megatron_scale = _yarn_get_mscale(y.factor, y.mscale_all_dim) ** 2 / math.sqrt(cfg.head_dim)
    assert math.isclose(megatron_scale, DeepseekV3Attention(hf_config, 0).scaling, rel_tol=4 * FP32_EPS)


def test_mtp_layers_are_skipped_on_import():
    from megatron_grpo.convert.mappings import ignored_hf_tensors

    cfg = ModelArchitecture.from_hf(dict(TINY_CONFIGS["deepseek_v3"], num_nextn_predict_layers=1))
    present = ["model.layers.3.self_attn.q_a_proj.weight", "model.layers.4.eh_proj.weight",
               "model.layers.4.self_attn.kv_b_proj.weight", "model.layers.5.enorm.weight"]
    assert ignored_hf_tensors(cfg, present) == ("model.layers.4.eh_proj.weight",
                                                "model.layers.4.self_attn.kv_b_proj.weight")


@pytest.mark.parametrize("family", CONFIGS)
def test_hf_names_are_the_files_names(family, tmp_path):
    """expected_hf_tensors (the conversion table) names exactly what transformers saves, shapes too."""
    from safetensors.torch import load_file

    from megatron_grpo.convert.mappings import expected_hf_tensors

    path = save_tiny_hf_model(family, tmp_path / "hf", seed=0)
    saved = {name: tuple(t.shape) for name, t in load_file(f"{path}/model.safetensors").items()}
    assert sorted(expected_hf_tensors(ModelArchitecture.from_hf(path)).items()) == sorted(saved.items())


# ---- logits vs HF, bitwise round trip -----------------------------------------------------------
@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Per config: the saved folder and transformers' fp32 logits."""
    from transformers import AutoModelForCausalLM

    out = {}
    for family in CONFIGS:
        path = str(save_tiny_hf_model(family, tmp_path_factory.mktemp(family) / "hf", seed=0))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out[family] = path, model(_tokens(model.config.vocab_size)).logits.numpy()
    return out


LAYOUTS = [  # (config, TP, PP, EP, ETP); ETP None = TP
    ("deepseek_v3", 2, 1, 2, None), ("deepseek_v3", 1, 2, 2, None),
    ("deepseek_v3_lite", 1, 1, 1, None), ("deepseek_v3_lite", 2, 2, 2, 1),
]
_RUNS: dict = {}  # layout -> the ranks' (logits, export); the SGLang test reuses the EP2 x TP2 export


def _run(hf_models, family, tp, pp, ep, etp):
    key = (family, tp, pp, ep, etp)
    if key not in _RUNS:
        world = max(tp * pp, ep * (etp or tp) * pp)
        _RUNS[key] = run_distributed(_logits_and_export, world_size=world,
                                     args=(hf_models[family][0], tp, pp, ep, etp, "MLASelfAttention"), timeout=300)
    return _RUNS[key]


@pytest.mark.parametrize("family, tp, pp, ep, etp", LAYOUTS)
def test_logits_match_hf_and_export_is_bitwise(hf_models, family, tp, pp, ep, etp):
    path, ref = hf_models[family]
    results = _run(hf_models, family, tp, pp, ep, etp)
    check_logits_and_round_trip(results, ref, path, f"{family} TP={tp} PP={pp} EP={ep} ETP={etp}", pp)


# ---- the exported stream into SGLang's own model class ------------------------------------------
def test_exported_stream_is_what_sglang_loads(hf_models, tmp_path):
    """The HF-named stream gathered at EP2 x TP2 (the round-trip test's), fed to SGLang 0.5.23's own
    DeepseekV3ForCausalLM.load_weights (deepseek_v2.py): one tensor per call, except each layer's q_a_proj +
    kv_a_proj_with_mqa, which SGLang fuses into fused_qkv_a_proj_with_mqa only when both arrive in one call
    (convert.mappings.sglang_load_together). Every tensor overwrites exactly its size (the embedding and head:
    their padded rows too), every pair exactly both sizes, and no parameter of SGLang's model is left
    unwritten. Also shown from SGLang's code: the config must carry DeepSeek's own moe_layer_freq /
    topk_method keys (models/tiny.py), which transformers' DeepseekV3Config does not define."""
    from safetensors.torch import save_file

    from megatron_grpo.convert.mappings import sglang_load_together
    from megatron_grpo.rollout.sglang.buckets import iter_buckets
    from tests.test_moe_families import _loaded_in_full, sglang_load

    path = hf_models["deepseek_v3"][0]
    stream = _run(hf_models, "deepseek_v3", 2, 1, 2, None)[0][1]
    save_file({n: t.contiguous() for n, t in stream.items()}, str(tmp_path / "stream.safetensors"))
    pairs = sglang_load_together(ModelArchitecture.from_hf(path))
    assert len(pairs) == 4
    (tmp_path / "together.json").write_text(json.dumps([list(p) for p in pairs]))
    report = sglang_load(path, tmp_path / "stream.safetensors", tmp_path / "report.json",
                         tmp_path / "together.json")
    assert report["class"] == "DeepseekV3ForCausalLM"
    paired = {name for pair in pairs for name in pair}
    assert sorted(report["written"]) == sorted(set(stream) - paired) and report["pending"] == []
    skipped = {n: (report["written"][n], t.numel()) for n, t in stream.items()
               if n not in paired and not _loaded_in_full(report, n, t.numel())}
    assert not skipped, f"SGLang's DeepseekV3ForCausalLM did not load (elements written, size): {skipped}"
    assert report["groups"] == {" + ".join(p): sum(stream[n].numel() for n in p) for p in pairs}
    assert report["left"] == {}  # every parameter of SGLang's model was written
    # weight sync's buckets (rollout/sglang/buckets.py) keep each pair in one call, even one byte large
    buckets = [[name for name, _ in bucket] for bucket in iter_buckets(stream.items(), bucket_bytes=1)]
    assert all(any(set(pair) <= set(bucket) for bucket in buckets) for pair in pairs)
    assert len(buckets) == len(stream) - len(pairs)  # every other tensor alone


# ---- the first GRPO step at EP2 x TP2 (SP) equals one process -----------------------------------


def test_first_grpo_step_at_ep2_tp2_equals_single_process(tmp_path):
    policy = str(save_tiny_hf_model("deepseek_v3", tmp_path / "policy", seed=3))
    samples, n8 = uneven_samples(32, TINY_CONFIGS["deepseek_v3"]["vocab_size"]), ("rollout.n=8",)
    single = run_distributed(first_step, 1, args=(policy, {}, samples, n8), timeout=300)[0]
    layout = dict(tensor=2, expert=2, sequence_parallel=True)
    step = run_distributed(first_step, 4, args=(policy, layout, samples, n8), timeout=600)[0]
    check_step_equals_single("deepseek_v3 EP2 x TP2", step, single, policy, TOLERANCE,
                             frozen=("e_score_correction_bias",))  # the frozen expert bias


# ---- the first GRPO step at EP2 x PP2 (and the lite config's EP2 x TP2) equals one process -----------
@pytest.fixture(scope="module")
def single_steps(tmp_path_factory):
    return SingleProcessSteps(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [
    # stage 0: the dense layer 0 and MoE layer 1; stage 1: MoE layers 2-3 (MLA with q_lora_rank, YaRN, groups)
    pytest.param("deepseek_v3", dict(expert=2, pipeline=2), id="v3-ep2-pp2"),
    # stage 0 wholly dense (layers 0-1), stage 1 wholly MoE; q_lora_rank null, embeddings tied across stages
    pytest.param("deepseek_v3_lite", dict(expert=2, pipeline=2), id="lite-ep2-pp2"),
    # the other MLA shape under TP: q_proj split by heads, kv_a whole on each rank; experts EP2 x ETP 1
    pytest.param("deepseek_v3_lite", dict(expert=2, tensor=2, expert_tensor=1, sequence_parallel=True),
                 id="lite-ep2-tp2"),
])
def test_first_grpo_step_at_more_layouts_equals_single_process(single_steps, family, layout):
    """As the EP2 x TP2 test above (4 ranks each, the single process run once per config). Measured worst
    (metrics and every tensor's update; 1e-5 plus each tensor's 2-ulp rounding allowance): deepseek_v3
    EP2 x PP2 2.1e-5 (layer 3's q_a_layernorm, allowed 1.1e-4), deepseek_v3_lite EP2 x PP2 3.5e-6, EP2 x TP2
    (ETP 1) 4.8e-6."""
    policy, samples, n8, single = single_steps(family)
    step = run_distributed(first_step, 4, args=(policy, layout, samples, n8), timeout=600)[0]
    check_step_equals_single(f"{family} {layout}", step, single, policy, TOLERANCE,
                             frozen=("e_score_correction_bias",))  # the frozen expert bias


# ---- the memory planner's engine arithmetic (plan/engines.py) -----------------------------------
def _hub_config(name: str) -> dict:
    from importlib import resources

    return json.loads(resources.files("megatron_grpo.plan").joinpath("hub_configs.json").read_text())[name]["config"]


@pytest.mark.parametrize("family", CONFIGS + ("deepseek-ai/DeepSeek-V3",))
def test_planned_parameter_count_is_the_hf_models(family):
    """plan/engines.py's parameter count (the engines' weight bytes, the sync volume) equals transformers'
    DeepseekV3ForCausalLM's: q_a_proj / q_a_layernorm / q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj, o_proj of heads x v_head_dim, shared experts (the router's bias is a buffer). DeepSeek-V3's
    published config (plan/hub_configs.json) on the meta device: 671,026,404,352, without the MTP layer, which
    transformers does not build either."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_grpo.plan.engines import parameter_count

    fields = dict(TINY_CONFIGS[family] if family in CONFIGS else _hub_config(family))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    planned = parameter_count(ModelArchitecture.from_hf(TINY_CONFIGS[family] if family in CONFIGS
                                                        else _hub_config(family)))
    assert planned == sum(p.numel() for p in model.parameters())


_SGLANG_MLA_POOL = """
import json, sys, torch
from tests.sglang_harness import memory_saver_stub, torchvision_stub
torchvision_stub.install(); memory_saver_stub.install()
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
out = []
for layers, kv_lora_rank, rope in json.loads(sys.argv[1]):
    pool = MLATokenToKVPool(size=7, page_size=1, dtype=torch.bfloat16, kv_lora_rank=kv_lora_rank,
                            qk_rope_head_dim=rope, layer_num=layers, device="cpu", enable_memory_saver=False)
    out.append([int(pool.get_kv_size_bytes()), int(pool.size + pool.page_size)])
print(json.dumps(out))
"""


def test_kv_bytes_per_token_is_sglangs_mla_pool():
    """The planner's KV bytes per token and GPU for MLA is what SGLang 0.5.23's own MLATokenToKVPool
    allocates per token slot (built on CPU, bf16 as --kv-cache-dtype auto gives a bf16 model): the latent and
    the rope key, one head, every layer. The pool takes no TP size, so the planner's figure does not shrink
    with the engine's tp_size, unlike a GQA model's."""
    import subprocess

    from megatron_grpo.plan.engines import kv_bytes_per_token
    from tests.sglang_harness.fixtures import REPO_ROOT, sglang_python

    archs = [ModelArchitecture.from_hf(TINY_CONFIGS[name]) for name in CONFIGS]
    archs.append(ModelArchitecture.from_hf(_hub_config("deepseek-ai/DeepSeek-V3")))
    shapes = [[a.num_layers, a.kv_lora_rank, a.qk_rope_head_dim] for a in archs]
    done = subprocess.run([sglang_python(), "-c", _SGLANG_MLA_POOL, json.dumps(shapes)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    sglang = [size // slots for size, slots in json.loads(done.stdout.strip().splitlines()[-1])]
    assert sglang[-1] == 61 * (512 + 64) * 2 == 70272  # DeepSeek-V3: 68.6 KiB per token on every GPU
    for tp in (1, 2, 8):
        assert [kv_bytes_per_token(a, tp) for a in archs] == sglang
    gqa = ModelArchitecture.from_hf(TINY_CONFIGS["qwen3_moe"])  # 2 KV heads: split over TP up to 2
    assert kv_bytes_per_token(gqa, 2) == kv_bytes_per_token(gqa, 1) // 2 == kv_bytes_per_token(gqa, 8)


def test_memory_plan_runs_for_mla(tmp_path):
    """`megatron-grpo plan` on a deepseek_v3 model (the tiny config, q/k head 24 != v head 16) at TP2 x EP4: the
    planner's fused-attention memory model (ops/flash_attention_memory.py) takes MLA's k_channels / v_channels
    (it was refused: unexpected keyword 'k_channels') and returns the value head's width, as a flash kernel with
    hdim_v != hdim_qk does; the engines' figures are the MLA ones."""
    from megatron_grpo.cli import main
    from megatron_grpo.ops.flash_attention_memory import _FlashAttentionMemory
    from megatron_grpo.plan.engines import kv_bytes_per_token, parameter_count

    q, k, v = (torch.randn(5, 4, 24, requires_grad=True), torch.randn(5, 4, 24, requires_grad=True),
               torch.randn(5, 4, 16, requires_grad=True))
    out = _FlashAttentionMemory.apply(q, k, v, 0)
    assert out.shape == (5, 4, 16)
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)

    fields = dict(TINY_CONFIGS["deepseek_v3"], hidden_size=128, vocab_size=4096)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    code = main(["plan", "qwen3_30b_a3b_gsm8k", f"model.path={tmp_path}", "parallel.tensor=2", "parallel.expert=4",
                 "data.max_response_length=256", "--nodes", "3", "--json", str(tmp_path / "plan.json")])
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert code == 0 and plan["fits"] and plan["placement"]["trainer_gpus"] == 8
    arch = ModelArchitecture.from_hf(fields)
    assert plan["engines"]["kv_bytes_per_token_per_gpu"] == kv_bytes_per_token(arch, 2) == 4 * (32 + 8) * 2
    replicated = 4 * 128 * (32 + 32 + 8)  # q_a_proj + kv_a_proj_with_mqa of 4 layers, whole on each engine GPU
    assert plan["engines"]["weights_per_gpu"] == 2 * ((parameter_count(arch) - replicated) // 2 + replicated)


# ---- rollout.engine=sglang: DeepSeek's own config keys -------------------------------------------
def test_sglang_refuses_a_deepseek_config_without_deepseeks_keys(tmp_path):
    """SGLang 0.5.23's DeepseekV3ForCausalLM reads config.moe_layer_freq, topk_method and scoring_func, which
    transformers' DeepseekV3Config does not define: a config.json saved by transformers lacks them. Before any
    server starts, check_sglang_model names the missing keys and the file; DeepSeek's own layout passes."""
    from transformers import DeepseekV3Config

    from megatron_grpo.trainer.engines.sglang_setup import SGLANG_DEEPSEEK_KEYS, check_sglang_model

    fields = {k: v for k, v in TINY_CONFIGS["deepseek_v3"].items() if k not in SGLANG_DEEPSEEK_KEYS}
    fields.pop("model_type")
    DeepseekV3Config(**fields).save_pretrained(tmp_path / "transformers")
    saved = json.loads((tmp_path / "transformers" / "config.json").read_text())
    assert not set(SGLANG_DEEPSEEK_KEYS) & set(saved)  # transformers writes none of them
    message = (r"rollout.engine=sglang: .*transformers/config.json lacks \['moe_layer_freq', 'scoring_func', "
               r"'topk_method'\]: .* add \"moe_layer_freq\": 1, \"topk_method\": \"noaux_tc\", \"scoring_func\": "
               r"\"sigmoid\" to it")
    with pytest.raises(ConfigError, match=message):
        check_sglang_model(tmp_path / "transformers")
    (tmp_path / "one.json").write_text(json.dumps(dict(saved, moe_layer_freq=1, scoring_func="sigmoid")))
    with pytest.raises(ConfigError, match=r"one.json lacks \['topk_method'\]"):
        check_sglang_model(tmp_path / "one.json")
    (tmp_path / "deepseek").mkdir()
    (tmp_path / "deepseek" / "config.json").write_text(json.dumps(TINY_CONFIGS["deepseek_v3"]))
    assert check_sglang_model(tmp_path / "deepseek").is_mla
