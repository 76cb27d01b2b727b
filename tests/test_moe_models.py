"""qwen3_moe (models/, convert/): HF config parsing, Megatron logits vs HF transformers and
HF -> Megatron -> HF bitwise, at (TP, PP, EP) in {1,2}^3 (ETP 1 or = TP) on the tiny random
Qwen3-MoE (8 experts, top-2, 4 layers, layer 2 dense).

Tolerance of the logits: both sides run the same fp32 math over different reduction orders
(megatron's fused QKV / gate-up GEMMs, its permuted expert batches, TP partial sums), so they differ
by fp32 rounding, a few eps (1.19e-7) times a depth factor; 1e-5 relative to the largest logit, as
tests/test_models.py uses for the dense models (measured: at most 8.5e-7). A top-k near-tie that
rounding flips would show as an error of order 1e-1, far above it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_grpo.errors import ConfigError
from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.models.tiny import TINY_CONFIGS, save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed

SEQ, BATCH = 24, 2
TOLERANCE = 1e-5


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def test_moe_config_fields():
    cfg = ModelArchitecture.from_hf(TINY_CONFIGS["qwen3_moe"], vocab_multiple=8)
    assert (cfg.num_experts, cfg.moe_top_k, cfg.moe_ffn_hidden_size) == (8, 2, 32)
    assert cfg.moe_layers == (0, 1, 3) and cfg.dense_layers == (2,) and cfg.norm_topk_prob
    assert cfg.router_aux_loss_coef == 0.0  # HF adds it only with output_router_logits
    on = ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen3_moe"], output_router_logits=True,
                                        router_aux_loss_coef=0.01))
    assert on.router_aux_loss_coef == 0.01
    # HF: sparse where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
    step2 = ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen3_moe"], decoder_sparse_step=2, mlp_only_layers=[]))
    assert step2.moe_layers == (1, 3)
    # Qwen's own config.json says num_experts; transformers >= 5 writes num_local_experts
    fields = dict(TINY_CONFIGS["qwen3_moe"])
    fields["num_local_experts"] = fields.pop("num_experts")
    assert ModelArchitecture.from_hf(fields).num_experts == 8
    assert ModelArchitecture.from_dict(cfg.to_dict()) == cfg
    assert ModelArchitecture.from_hf(TINY_CONFIGS["qwen3"]).num_experts == 0


@pytest.mark.parametrize("overrides, message", [
    (dict(num_experts=None), "num_experts"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(num_local_experts=4), "differ"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    (dict(mlp_only_layers=[0, 1, 2, 3]), "no sparse layer"),
    (dict(shared_expert_intermediate_size=64), "shared experts"),
])
def test_bad_moe_configs_raise(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen3_moe"], **overrides))


def test_dense_models_still_refuse_experts():
    with pytest.raises(ConfigError, match="num_experts=8 .mixture of experts. is not supported for model_type 'qwen3'"):
        ModelArchitecture.from_hf(dict(TINY_CONFIGS["qwen3"], num_experts=8))


def test_expert_parallel_must_divide():
    cfg = ModelArchitecture.from_hf(TINY_CONFIGS["qwen3_moe"])
    with pytest.raises(ConfigError, match="expert parallel size 3 does not divide num_experts = 8"):
        cfg.check_expert_parallel(3, 1)
    with pytest.raises(ConfigError, match="expert tensor parallel size 3 does not divide moe_intermediate_size"):
        cfg.check_expert_parallel(1, 3)
    with pytest.raises(ConfigError, match="has no experts"):
        ModelArchitecture.from_hf(TINY_CONFIGS["qwen3"]).check_expert_parallel(2, 1)


def test_hf_names_of_the_moe_model():
    from megatron_grpo.convert.mappings import expected_hf_tensors

    cfg = ModelArchitecture.from_hf(TINY_CONFIGS["qwen3_moe"])
    names = expected_hf_tensors(cfg)
    assert names["model.layers.0.mlp.gate.weight"] == (8, 64)
    assert names["model.layers.3.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert names["model.layers.2.mlp.gate_proj.weight"] == (128, 64)  # the dense layer
    assert not any(n.startswith("model.layers.2.mlp.experts") for n in names)
    assert "model.layers.0.mlp.gate_proj.weight" not in names


def _logits_and_export(rank, world_size, path, tp, pp, ep, etp, attention_class="SelfAttention"):
    """(this rank's logits or None, the HF export on rank 0) of the HF folder built at (TP, PP, EP, ETP)."""
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.convert.export import gather_hf_weights_on_rank0
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import build_reference_model
    from megatron_grpo.testing.logits import forward_only_logits

    layout = ParallelLayout(tensor=tp, pipeline=pp, expert=ep, expert_tensor=etp)
    initialize_model_parallel(layout)
    cfg = ModelArchitecture.from_hf(path, tensor_parallel=tp, vocab_multiple=8)
    chunks = build_reference_model(cfg, layout)
    load_hf_weights(chunks, cfg, path)
    attention = chunks[0].decoder.layers[0].self_attention
    assert type(attention).__name__ == attention_class
    assert attention.num_attention_heads_per_partition == cfg.num_attention_heads // tp  # heads split over TP
    layers = chunks[0].decoder.layers
    local_experts = {len(layer.mlp.local_expert_indices) for layer in layers
                     if hasattr(layer.mlp, "local_expert_indices")}
    sparse_here = any(layer.layer_number - 1 in cfg.moe_layers for layer in layers)
    assert local_experts == ({cfg.num_experts // ep} if sparse_here else set())  # a dense-only stage has none
    full = forward_only_logits(chunks, _tokens(cfg.vocab_size))
    logits = None if full is None else full[..., : cfg.vocab_size].numpy()
    exported = {name: tensor.clone() for name, tensor in gather_hf_weights_on_rank0(chunks, cfg)}
    return logits, exported


def check_logits_and_round_trip(results, ref, hf_path, label: str, pp: int) -> None:
    """_logits_and_export's results against HF: every last-stage rank's logits within TOLERANCE of
    `ref`, and the export (on rank 0 only) bitwise the HF checkpoint's tensors."""
    from safetensors.torch import load_file

    logits = [r[0] for r in results if r[0] is not None]
    assert len(logits) == len(results) // pp  # every rank of the last stage
    for got in logits:
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        print(f"{label}: max relative error {rel:.2e}")
        assert rel <= TOLERANCE, f"{label}: max relative error {rel:.2e}"
    original = load_file(f"{hf_path}/model.safetensors")
    exported = results[0][1]
    assert sorted(exported) == sorted(original)
    different = [name for name in original if not torch.equal(exported[name], original[name])]
    assert not different, f"HF -> Megatron -> HF changed {different[:5]}"
    assert all(not r[1] for r in results[1:])  # the export arrives on rank 0 only


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe") / "hf", seed=0))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(_tokens(model.config.vocab_size)).logits.numpy()
    return path, logits


LAYOUTS = [  # (TP, PP, EP, ETP); ETP None = TP (megatron's default)
    (1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (2, 2, 1, None),
    (1, 1, 2, None), (2, 1, 2, 1), (2, 1, 2, 2), (1, 2, 2, None), (2, 2, 2, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, ep, etp", LAYOUTS)
def test_moe_logits_match_hf_and_export_is_bitwise(hf_moe, tp, pp, ep, etp):
    path, ref = hf_moe
    world = max(tp * pp, ep * (etp or tp) * pp)
    results = run_distributed(_logits_and_export, world_size=world, args=(path, tp, pp, ep, etp), timeout=300)
    check_logits_and_round_trip(results, ref, path, f"TP={tp} PP={pp} EP={ep} ETP={etp}", pp)


def _cli(rank, world_size, argv):
    from megatron_grpo.convert.cli import main

    return main(argv)


def _same_safetensors(a_dir, b_dir) -> list[str]:
    """Names whose tensors differ (or exist on one side only) between two HF folders."""
    from pathlib import Path

    from safetensors.torch import load_file

    def tensors(folder):
        out = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            out.update(load_file(str(file)))
        return out

    a, b = tensors(a_dir), tensors(b_dir)
    return sorted(set(a) ^ set(b)) + [n for n in sorted(set(a) & set(b))
                                       if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


@pytest.mark.slow
def test_convert_tools_at_expert_parallel(hf_moe, tmp_path):
    """hf-to-megatron at EP2 (2 ranks), back to HF at EP1 (1 process) and at EP2 x TP2 (4 ranks):
    both folders hold the original tensors bit for bit."""
    path, _ = hf_moe
    ckpt = str(tmp_path / "mcore")
    assert run_distributed(_cli, 2, args=(["hf-to-megatron", "--hf", path, "--out", ckpt, "--ep", "2"],),
                           timeout=300)[0] == 0
    single, spread = tmp_path / "hf_ep1", tmp_path / "hf_ep2tp2"
    assert run_distributed(_cli, 1, args=(["megatron-to-hf", "--ckpt", ckpt, "--out", str(single)],),
                           timeout=300)[0] == 0
    assert run_distributed(_cli, 4, args=(["megatron-to-hf", "--ckpt", ckpt, "--out", str(spread), "--ep", "2",
                                           "--tp", "2", "--etp", "1"],), timeout=300)[0] == 0
    assert _same_safetensors(path, single) == []
    assert _same_safetensors(path, spread) == []


def test_convert_refuses_an_expert_split_that_does_not_divide(hf_moe, tmp_path, capsys):
    from megatron_grpo.convert.cli import main

    path, _ = hf_moe
    assert main(["hf-to-megatron", "--hf", path, "--out", str(tmp_path / "x"), "--ep", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --ep 3 / --etp 1: {path}/config.json: expert parallel size 3 does not divide "
                   f"num_experts = 8"]
