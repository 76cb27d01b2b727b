"""The MoE families beyond Qwen3-MoE, on tiny random configs (models/tiny.py), each against the real
components: HF config parsing and refusals; Megatron logits vs HF `transformers` (fp32) and HF ->
Megatron -> HF bitwise at a few (TP, PP, EP, ETP) layouts; the exported HF-named stream fed to
SGLang 0.5.23's own model class's `load_weights` (tests/sglang_models/load_names.py); the first GRPO
step at EP2, EP2 x PP2 and EP2 x TP2 (SP) equal to one process (tests/first_step.py).

  qwen2_moe  q/k/v bias, top-4 of 8 not renormalised, a shared expert gated by
             sigmoid(shared_expert_gate(x)), layer 0 dense (mlp_only_layers)
  glm4_moe   q/k/v bias, q/k norm, RoPE on half of each head, layer 0 dense (first_k_dense_replace),
             16 sigmoid-routed experts with a random e_score_correction_bias, top-4 within the best 2
             of 4 groups, routed_scaling_factor 2.5, one ungated shared expert

Logit tolerance: tests/test_moe_models.py's (1e-5 of the largest logit; fp32 rounding over
different reduction orders is a few eps times a depth factor). Layouts run by hand beyond the
parametrized ones are listed in docs/models.md.
"""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch

from megatron_grpo.errors import ConfigError
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.models.tiny import TINY_CONFIGS, save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed
from tests.first_step import SingleProcessSteps, check_step_equals_single, first_step
from tests.test_moe_models import TOLERANCE, _logits_and_export, _tokens, check_logits_and_round_trip

FAMILIES = ("qwen2_moe", "glm4_moe")


# ---- config parsing ---------------------------------------------------------------------------
def test_qwen2_moe_config_fields():
    cfg = ModelArchitecture.from_hf(TINY_CONFIGS["qwen2_moe"], vocab_multiple=8)
    sizes = (cfg.num_experts, cfg.moe_top_k, cfg.moe_ffn_hidden_size, cfg.shared_expert_ffn_hidden_size)
    assert sizes == (8, 4, 32, 96)
    assert cfg.moe_layers == (1, 2, 3) and not cfg.norm_topk_prob and cfg.qkv_bias and not cfg.qk_norm
    assert not ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen2_moe"], qkv_bias=False)).qkv_bias
    assert ModelArchitecture.from_dict(cfg.to_dict()) == cfg
    odd = ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen2_moe"], shared_expert_intermediate_size=99))
    with pytest.raises(ConfigError, match="size 2 does not divide shared_expert_intermediate_size = 99"):
        odd.check_tensor_parallel(2)


@pytest.mark.parametrize("overrides, message", [
    (dict(shared_expert_intermediate_size=None), "required key 'shared_expert_intermediate_size'"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0 must be >= 1"),
    (dict(n_shared_experts=2), "n_shared_experts=2 .shared experts. is not supported for model_type 'qwen2_moe'"),
    (dict(use_sliding_window=True), "use_sliding_window=true"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_qwen2_moe_refusals_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen2_moe"], **overrides))


def test_dense_and_qwen3_moe_refuse_a_shared_expert():
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size=64 .shared experts. is not supported "
                                          "for model_type 'qwen3_moe'"):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen3_moe"], shared_expert_intermediate_size=64))


def test_glm4_moe_config_fields():
    cfg = ModelArchitecture.from_hf(dict(TINY_CONFIGS["glm4_moe"], num_nextn_predict_layers=1), vocab_multiple=8)
    sizes = (cfg.num_experts, cfg.moe_top_k, cfg.moe_ffn_hidden_size, cfg.shared_expert_ffn_hidden_size)
    assert sizes == (16, 4, 16, 16)
    assert cfg.moe_layers == (1, 2, 3) and cfg.qkv_bias and cfg.qk_norm and not cfg.shared_expert_gate
    router = (cfg.router_score_function, cfg.expert_bias, cfg.moe_num_groups, cfg.moe_group_topk)
    assert router == ("sigmoid", True, 4, 2)
    assert (cfg.routed_scaling_factor, cfg.rotary_percent, cfg.rotary_dim, cfg.mtp_layers) == (2.5, 0.5, 16, 1)
    assert ModelArchitecture.from_dict(cfg.to_dict()) == cfg
    # transformers' default for GLM-4.5 when the config has no partial_rotary_factor is 0.5
    fields = {k: v for k, v in TINY_CONFIGS["glm4_moe"].items() if k != "partial_rotary_factor"}
    assert ModelArchitecture.from_hf(fields).rotary_percent == 0.5
    no_groups = ModelArchitecture.from_hf(dict(TINY_CONFIGS["glm4_moe"], n_group=1, topk_group=1))
    assert (no_groups.moe_num_groups, no_groups.moe_group_topk) == (0, 0)
    plain = ModelArchitecture.from_hf(dict(TINY_CONFIGS["glm4_moe"], attention_bias=False, use_qk_norm=False))
    assert not plain.qkv_bias and not plain.qk_norm


@pytest.mark.parametrize("overrides, message", [
    (dict(n_routed_experts=None), "required key 'n_routed_experts' is missing"),
    (dict(norm_topk_prob=False), "norm_topk_prob=false with the sigmoid router is not supported"),
    (dict(topk_group=1), "n_group=4 with num_experts_per_tok=4 / topk_group=1 != 2 is not supported"),
    (dict(n_group=3), "n_group=3 / topk_group=2 do not split 16 experts"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace=4 must be in"),
    (dict(partial_rotary_factor=0.3), "partial_rotary_factor=0.3 gives 9 rotary dims"),
    (dict(num_experts=16), "num_experts=16 .mixture of experts. is not supported for model_type 'glm4_moe'"),
    (dict(shared_expert_intermediate_size=8), "shared_expert_intermediate_size=8 .shared experts. is not supported"),
    (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
])
def test_glm4_moe_refusals_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS["glm4_moe"], **overrides))


def test_partial_rotary_refused_where_the_model_has_none():
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5 is not supported for model_type 'qwen3'"):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen3"], partial_rotary_factor=0.5))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_names_are_the_files_names(family, tmp_path):
    """expected_hf_tensors (the conversion table) names exactly what transformers saves, shapes too."""
    from safetensors.torch import load_file

    from megatron_grpo.convert.mappings import expected_hf_tensors

    path = save_tiny_hf_model(family, tmp_path / "hf", seed=0)
    saved = {name: tuple(t.shape) for name, t in load_file(f"{path}/model.safetensors").items()}
    assert sorted(expected_hf_tensors(ModelArchitecture.from_hf(path)).items()) == sorted(saved.items())


# ---- logits vs HF, bitwise round trip -----------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def hf_family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    path = str(save_tiny_hf_model(family, tmp_path_factory.mktemp(family) / "hf", seed=0))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(_tokens(model.config.vocab_size)).logits.numpy()
    return family, path, logits


LAYOUTS = [  # (TP, PP, EP, ETP); ETP None = TP
    (1, 1, 1, None), (2, 1, 2, None), (1, 2, 2, None), (2, 2, 2, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, ep, etp", LAYOUTS)
def test_logits_match_hf_and_export_is_bitwise(hf_family, tp, pp, ep, etp):
    family, path, ref = hf_family
    world = max(tp * pp, ep * (etp or tp) * pp)
    results = run_distributed(_logits_and_export, world_size=world, args=(path, tp, pp, ep, etp), timeout=300)
    check_logits_and_round_trip(results, ref, path, f"{family} TP={tp} PP={pp} EP={ep} ETP={etp}", pp)


@pytest.mark.slow
def test_convert_tools_keep_the_expert_bias(tmp_path):
    """glm4_moe's expert bias is a buffer, not a parameter: hf-to-megatron at EP2 (2 ranks), back to HF
    at EP1 and at EP2 x TP2: both folders hold the original tensors, the bias included, bit for bit."""
    from tests.test_moe_models import _cli, _same_safetensors

    path = str(save_tiny_hf_model("glm4_moe", tmp_path / "hf", seed=0))
    ckpt = str(tmp_path / "mcore")
    assert run_distributed(_cli, 2, args=(["hf-to-megatron", "--hf", path, "--out", ckpt, "--ep", "2"],),
                           timeout=300)[0] == 0
    single, spread = tmp_path / "hf_ep1", tmp_path / "hf_ep2tp2"
    assert run_distributed(_cli, 1, args=(["megatron-to-hf", "--ckpt", ckpt, "--out", str(single)],),
                           timeout=300)[0] == 0
    assert run_distributed(_cli, 4, args=(["megatron-to-hf", "--ckpt", ckpt, "--out", str(spread), "--ep", "2",
                                           "--tp", "2", "--etp", "1"],), timeout=300)[0] == 0
    assert _same_safetensors(path, single) == [] and _same_safetensors(path, spread) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_local_engine_takes_every_tensor(family, tmp_path):
    """The local engine (transformers 5: fused experts; GLM-4.5's router bias a buffer) loads the
    checkpoint's HF names, each one landing: every parameter and persistent buffer is rewritten."""
    from safetensors.torch import load_file

    from megatron_grpo.rollout.local import LocalEngine
    from tests.tiny_hf import char_tokenizer

    path = save_tiny_hf_model(family, tmp_path / "hf", seed=0)
    char_tokenizer().save_pretrained(path)
    engine = LocalEngine.from_pretrained(str(path))
    doubled = {name: 2 * tensor for name, tensor in load_file(f"{path}/model.safetensors").items()}
    assert engine.load_weights(doubled.items(), version=2).missing == []
    state = engine.model.state_dict()
    assert all(torch.equal(state[name], doubled[name]) for name in doubled if name in state)
    assert all(torch.equal(state[name], 2 * load_file(f"{path}/model.safetensors")[name])
               for name in state if name.endswith("e_score_correction_bias"))


# ---- the exported stream into SGLang's own model class ------------------------------------------
def _export_stream(rank, world_size, path, out_file, ep):
    from safetensors.torch import save_file

    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import build_reference_model

    layout = ParallelLayout(expert=ep)
    initialize_model_parallel(layout)
    cfg = ModelArchitecture.from_hf(path, vocab_multiple=8)
    chunks = build_reference_model(cfg, layout)
    load_hf_weights(chunks, cfg, path)
    stream = {name: tensor.clone().contiguous() for name, tensor in gather_hf_weights_on_rank0(chunks, cfg)}
    if rank == 0:
        save_file(stream, out_file)
    return sorted(stream)


def sglang_load(model_dir, stream_file, out_file, together_file=None) -> dict:
    from tests.sglang_harness.fixtures import REPO_ROOT, sglang_python

    extra = [str(together_file)] if together_file else []
    done = subprocess.run([sglang_python(), "-m", "tests.sglang_models.load_names", str(model_dir), str(stream_file),
                           str(out_file), *extra], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(open(out_file).read())


_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")  # SGLang pads their rows and zero-fills them


def _loaded_in_full(report: dict, name: str, size: int) -> bool:
    written = report["written"][name]
    return written == size or (name in _VOCAB_ROWS and written == int(np.prod(report["parameters"][name])))


@pytest.mark.slow
@pytest.mark.parametrize("family, overrides", [("qwen2_moe", dict(mlp_only_layers=[])), ("glm4_moe", {})])
def test_exported_stream_is_what_sglang_loads(family, overrides, tmp_path):
    """The HF-named stream gathered at EP2, fed one tensor at a time to SGLang's own load_weights:
    every tensor overwrites exactly its size in SGLang's (renamed, stacked, fused) parameters (the
    embedding and head: their padded rows too), and every parameter is written."""
    path = save_tiny_hf_model(family, tmp_path / "hf", seed=0, **overrides)
    stream = tmp_path / "stream.safetensors"
    names = run_distributed(_export_stream, 2, args=(str(path), str(stream), 2), timeout=300)[0]
    report = sglang_load(path, stream, tmp_path / "report.json")
    from safetensors.torch import load_file

    sizes = {n: t.numel() for n, t in load_file(str(stream)).items()}
    assert sorted(report["written"]) == names
    skipped = {n: (report["written"][n], size) for n, size in sizes.items() if not _loaded_in_full(report, n, size)}
    assert not skipped, f"SGLang's {report['class']} did not load (elements written, size): {skipped}"
    assert report["left"] == {}  # and every parameter of SGLang's model was written


@pytest.mark.slow
def test_sglang_qwen2_moe_ignores_dense_layers(tmp_path):
    """SGLang 0.5.23's Qwen2MoeForCausalLM builds every layer sparse (it reads neither mlp_only_layers
    nor decoder_sparse_step): a dense layer's MLP tensors are skipped in silence and its experts stay
    unwritten. Shown here from SGLang's own code; the config check refuses such a model with SGLang."""
    path = save_tiny_hf_model("qwen2_moe", tmp_path / "hf", seed=0)  # layer 0 dense
    stream = tmp_path / "stream.safetensors"
    run_distributed(_export_stream, 1, args=(str(path), str(stream), 1), timeout=300)
    report = sglang_load(path, stream, tmp_path / "report.json")
    dropped = sorted(n for n, w in report["written"].items() if w == 0)
    assert dropped == [f"model.layers.0.mlp.{p}_proj.weight" for p in ("down", "gate", "up")]
    assert "model.layers.0.mlp.experts.w13_weight" in report["left"]


def test_sglang_refuses_qwen2_moe_with_dense_layers(tmp_path):
    from megatron_grpo.trainer.engines.sglang_setup import check_sglang_model

    dense = save_tiny_hf_model("qwen2_moe", tmp_path / "dense", seed=0)
    with pytest.raises(ConfigError, match=r"model_type 'qwen2_moe' with dense layers \[0\] .mlp_only_layers"):
        check_sglang_model(dense)
    check_sglang_model(save_tiny_hf_model("qwen2_moe", tmp_path / "sparse", seed=0, mlp_only_layers=[]))


# ---- the first GRPO step at EP2, EP2 x PP2, EP2 x TP2 (SP) equals one process ----------------------
STEP_LAYOUTS = {  # name: (ranks, ParallelLayout fields)
    "ep2": (2, dict(expert=2)),
    # 4 layers split 2 + 2: stage 0 holds the dense layer 0 and one MoE layer, stage 1 two MoE layers
    "ep2-pp2": (4, dict(expert=2, pipeline=2)),
    # TP2 x DP2 with sequence parallelism; the experts EP2 x ETP 1 (qwen2_moe: the shared expert is split
    # over TP like a dense MLP, the routed ones are not) or EP2 x ETP 2 (glm4_moe: megatron's default ETP = TP)
    "ep2-tp2": (4, dict(expert=2, tensor=2, sequence_parallel=True)),
}
STEP_ETP = {"qwen2_moe": 1, "glm4_moe": None}


@pytest.fixture(scope="module")
def single_step(tmp_path_factory):
    return SingleProcessSteps(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(STEP_LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_first_grpo_step_at_ep2_equals_single_process(single_step, family, layout):
    """The loss, policy loss, entropy, grad norm and every HF tensor's update against the single
    process (tests/first_step.py: 1e-5 relative, plus each tensor's 2-ulp rounding allowance, here
    3.9e-5 to 6.6e-5 for the worst tensors); the frozen expert bias bitwise unchanged. Measured worst:
    qwen2_moe EP2 9.6e-6, EP2 x PP2 9.6e-6, EP2 x TP2 (ETP 1) 1.2e-5 (a layernorm);
    glm4_moe EP2 1.0e-5, EP2 x PP2 1.0e-5, EP2 x TP2 (ETP 2) 1.2e-5 (an expert's down_proj)."""
    policy, samples, n8, single = single_step(family)
    world, parallel = STEP_LAYOUTS[layout]
    if "tensor" in parallel:
        parallel = dict(parallel, expert_tensor=STEP_ETP[family])
    step = run_distributed(first_step, world, args=(policy, parallel, samples, n8), timeout=600)[0]
    check_step_equals_single(f"{family} {layout}", step, single, policy, TOLERANCE,
                             frozen=("e_score_correction_bias",))  # the frozen expert bias


# ---- routing replay (R3) ------------------------------------------------------------------------
REPLAY_FAMILIES = FAMILIES + ("deepseek_v3",)


@pytest.mark.slow
@pytest.mark.parametrize("family", REPLAY_FAMILIES)
def test_routing_replay(family, tmp_path):
    """tests/test_moe_replay.py's check on these routers. (1) The local engine's recorded routes (prompt
    prefill in a left-padded batch, then KV-cache decode) are the HF model's own routing of each whole
    sequence in one forward, as expert sets (DeepSeek-V3's and GLM-4.5's routers take an unsorted top-k).
    (2) The recorded routes replayed by the trainer (the engine's expert indices, the trainer's own gate
    weights: softmax, or sigmoid scores normalised and scaled; the expert bias only chooses) close the
    routing part of the engine-vs-trainer gap that a perturbed router opens. Measured (gap unperturbed /
    perturbed / perturbed with replay): qwen2_moe 2.9e-7 / 1.0e-3 / 3.5e-4, glm4_moe 2.4e-7 / 1.2e-2 /
    3.7e-4, deepseek_v3 (MLA) 3.3e-7 / 1.3e-2 / 6.1e-4. The ratio is lower than Qwen3-MoE's ~18:
    qwen2_moe's flips swap the 4th of 4 unrenormalised experts (a small weight), and shared experts are
    never routed; the test asks for 2."""
    from megatron_grpo.rollout.routed_experts import RoutedExpertsRecorder
    from tests.test_moe_replay import _engine_samples, _gaps
    from tests.tiny_hf import char_tokenizer

    path = str(save_tiny_hf_model(family, tmp_path / "hf", seed=1))
    char_tokenizer().save_pretrained(path)  # the engine loads one; the routes do not depend on it
    engine, samples = _engine_samples(path)
    recorder = RoutedExpertsRecorder(engine.model)
    for sample in samples:
        sequence = sample.prompt_ids + sample.response_ids
        routes = torch.from_numpy(sample.routed_experts)
        assert tuple(routes.shape) == (len(sequence) - 1, 4, 4) and routes.dtype == torch.int32
        assert (routes[:, 0] == -1).all() and (routes[:, 1:] >= 0).all()  # layer 0 dense
        with torch.no_grad():
            engine.model(torch.tensor([sequence]))
        full = recorder.take(1, len(sequence))[0, :-1]
        assert torch.equal(torch.sort(full, dim=-1).values, torch.sort(routes, dim=-1).values), \
            f"{family}: the engine's routes differ from the full forward's"
    recorder.remove()
    gaps = run_distributed(_gaps, 1, args=(path, samples), timeout=300)[0]
    print(family, {k: f"{v:.2e}" for k, v in gaps.items()})
    assert gaps["same"] < 1e-5 and gaps["same_replay"] < 1e-5
    assert gaps["perturbed"] > 2 * gaps["perturbed_replay"]
    assert gaps["perturbed_replay"] > 10 * gaps["same"]


# ---- multi-token-prediction layers are dropped on import ------------------------------------------
def _load_and_export(rank, world_size, path):
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import build_reference_model

    initialize_model_parallel(ParallelLayout())
    cfg = ModelArchitecture.from_hf(path, vocab_multiple=8)
    chunks = build_reference_model(cfg)
    load_hf_weights(chunks, cfg, path)
    return {name: tensor.clone() for name, tensor in gather_hf_weights_on_rank0(chunks, cfg)}


def test_glm4_moe_mtp_layer_is_dropped_on_import(tmp_path):
    """A GLM-4.5 checkpoint holds its MTP layer as model.layers.{num_hidden_layers}.*
    (num_nextn_predict_layers 1): import skips it with a note; export writes the rest bitwise."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_hf_model("glm4_moe", tmp_path / "hf", seed=0)
    tensors = load_file(f"{path}/model.safetensors")
    mtp = {"model.layers.4.eh_proj.weight": torch.randn(64, 128), "model.layers.4.enorm.weight": torch.ones(64),
           "model.layers.4.mlp.experts.0.up_proj.weight": torch.randn(16, 64)}
    save_file(dict(tensors, **mtp), f"{path}/model.safetensors", metadata={"format": "pt"})
    exported = run_distributed(_load_and_export, 1, args=(str(path),), timeout=300)[0]
    assert sorted(exported) == sorted(tensors)
    assert all(torch.equal(exported[name], tensors[name]) for name in tensors)
    # a layer past the MTP layers is not skipped: the folder is refused, naming it
    save_file(dict(tensors, **{"model.layers.5.eh_proj.weight": torch.ones(2)}), f"{path}/model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"unexpected \[model.layers.5.eh_proj.weight\]"):
        run_distributed(_load_and_export, 1, args=(str(path),), timeout=300)


@pytest.mark.parametrize("family", ("qwen3_moe",) + FAMILIES)
def test_planned_parameter_count_is_the_hf_models(family):
    """plan/engines.py's parameter count (the engines' weight bytes) equals the HF model's, shared experts
    and their gate included (GLM-4.5's router bias is a buffer, not counted)."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.models.tiny import tiny_hf_config
    from megatron_grpo.plan.engines import parameter_count

    model = AutoModelForCausalLM.from_config(tiny_hf_config(family))
    planned = parameter_count(ModelArchitecture.from_hf(TINY_CONFIGS[family]))
    assert planned == sum(p.numel() for p in model.parameters())
