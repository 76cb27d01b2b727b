"""The trainer's prediction of SGLang's /weights_checker checksums (rollout/sglang/expected_checksums.py)
against SGLang's own code: its hashes (sha256 on CPU; its Triton tile hash, run by Triton's interpreter
on this CPU) and its weight loaders' tensor-parallel splits, including the GPU-only case a CPU engine
cannot show (fewer kv heads than TP ranks: SGLang replicates them on a GPU and pads them on a CPU).
The prediction against a real engine after an update: tests/test_sglang_runtime_e2e.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from megatron_grpo.rollout.sglang.expected_checksums import (ChecksumPrediction, EngineLayout, ModelLayout,
                                                             sha256_hash, tile_hash)

pytestmark = [pytest.mark.sglang_runtime]

# (shape, dtype) cases: one word, odd byte counts (padded to whole words), several 8192-word tiles
HASH_CASES = [((1,), torch.float32), ((7, 5), torch.bfloat16), ((3,), torch.bfloat16),
              ((20011,), torch.float32), ((0,), torch.float32)]


def test_tile_hash_is_sglangs_triton_kernel_and_sha256_its_cpu_hash(tmp_path):
    """SGLang's gpu_tensor_hash kernels (Triton's interpreter runs them on CPU tensors; the wrapper
    only asserts is_cuda and launches them) and mm_utils.tensor_hash give what ours give."""
    script = textwrap.dedent(f"""
        import json, torch, triton
        from sglang.kernels.ops.memory import gpu_tensor_hash as g
        from sglang.srt.managers.mm_utils import tensor_hash

        def sglang_tile_hash(tensor, seed=0x243F6A88, tile=8192, block=256, chunk=1024):
            # gpu_tensor_hash's body, with its .cuda() asserts left out
            data = tensor.contiguous().reshape(-1).view(torch.uint8)
            data = torch.cat([data, data.new_zeros(-data.numel() % 4)])
            words = data.view(torch.uint32)
            n = words.numel()
            if n == 0:
                return 0
            partials = torch.empty(triton.cdiv(n, tile), dtype=torch.uint64)
            g.hash_tiles32_kernel_blocked[(partials.numel(),)](
                words, partials, n, seed1=seed & 0xFFFFFFFF, seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
                FM_C1=g.FMIX32_C1, FM_C2=g.FMIX32_C2, POS_A=g.POS_C1, POS_B=g.POS_C2, TILE=tile, BLOCK=block,
                USE_CG=False)
            while partials.numel() > 1:
                out = torch.empty(triton.cdiv(partials.numel(), chunk), dtype=torch.uint64)
                g.add_tree_reduce_u64_kernel[(out.numel(),)](partials, out, partials.numel(), CHUNK=chunk)
                partials = out
            return g._final_splitmix64(int(partials.item()))

        torch.manual_seed(0)
        out = []
        for shape, dtype in {[(s, str(d).removeprefix("torch.")) for s, d in HASH_CASES]!r}:
            t = torch.randn(shape).to(getattr(torch, dtype))
            torch.save(t, f"case{{len(out)}}.pt")
            out.append([sglang_tile_hash(t), tensor_hash(t)])
        print(json.dumps(out))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    sglang = json.loads(result.stdout.strip().splitlines()[-1])
    cases = [torch.load(tmp_path / f"case{i}.pt") for i in range(len(HASH_CASES))]
    ours = [[tile_hash(t), sha256_hash(t)] for t in cases]
    assert ours == sglang


def _sglang_loaded(tp: int, model: ModelLayout, hf: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Per TP rank, qkv_proj (weight, bias) and gate_up_proj as SGLang's own GPU weight loaders fill
    them (QKVParallelLinear / MergedColumnParallelLinear.weight_loader, called on a stand-in layer
    with the attributes their __init__ sets, and the rank SGLang's TP group would give)."""
    import sglang.srt.layers.linear as linear

    ranks = []
    real_rank_size = linear.get_group_rank_size
    try:
        for rank in range(tp):
            linear.get_group_rank_size = lambda group, rank=rank: (rank, tp)
            heads = model.num_heads // tp
            kv_heads, replicas = ((1, tp // model.num_kv_heads) if tp >= model.num_kv_heads
                                  else (model.num_kv_heads // tp, 1))
            qkv = types.SimpleNamespace(tp_group=None, kv_tp_group=None, num_heads=heads, num_kv_heads=kv_heads,
                                        head_size=model.head_dim, v_head_size=model.head_dim,
                                        num_kv_head_replicas=replicas, use_presharded_weights=False)
            gate_up = types.SimpleNamespace(tp_group=None, output_sizes=[model.intermediate_size] * 2,
                                            use_presharded_weights=False)
            out = {}
            for leaf in ("weight", "bias"):
                q = hf[f"self_attn.q_proj.{leaf}"]
                param = torch.nn.Parameter(torch.full(((heads + 2 * kv_heads) * model.head_dim, *q.shape[1:]),
                                                      float("nan")), requires_grad=False)
                param.output_dim = 0
                for part in "qkv":
                    linear.QKVParallelLinear.weight_loader(qkv, param, hf[f"self_attn.{part}_proj.{leaf}"], part)
                out[f"self_attn.qkv_proj.{leaf}"] = param.data
            gate = hf["mlp.gate_proj.weight"]
            param = torch.nn.Parameter(torch.full((2 * model.intermediate_size // tp, gate.shape[1]), float("nan")),
                                       requires_grad=False)
            param.output_dim = 0
            for shard, part in enumerate(("gate", "up")):
                linear.MergedColumnParallelLinear.weight_loader(gate_up, param, hf[f"mlp.{part}_proj.weight"], shard)
            out["mlp.gate_up_proj.weight"] = param.data
            ranks.append(out)
    finally:
        linear.get_group_rank_size = real_rank_size
    return ranks


@pytest.mark.parametrize("tp,kv_heads", [(2, 1), (4, 2), (4, 1), (2, 2), (2, 4)])
def test_fused_tp_shards_are_what_sglangs_gpu_weight_loaders_load(tp, kv_heads):
    """kv heads replicated (tp > kv heads: each on tp / kv ranks) or split, q split, biases like
    weights, gate/up split each: bitwise SGLang's loaders' parameters, hashed as a GPU engine does."""
    model = ModelLayout("Qwen2ForCausalLM", num_heads=8, num_kv_heads=kv_heads, head_dim=4, intermediate_size=16,
                        vocab_size=10, tied=False)
    hidden = 6
    torch.manual_seed(tp * 10 + kv_heads)
    hf = {"self_attn.q_proj.weight": torch.randn(8 * 4, hidden), "self_attn.q_proj.bias": torch.randn(8 * 4)}
    for part in "kv":
        hf[f"self_attn.{part}_proj.weight"] = torch.randn(kv_heads * 4, hidden)
        hf[f"self_attn.{part}_proj.bias"] = torch.randn(kv_heads * 4)
    hf["mlp.gate_proj.weight"], hf["mlp.up_proj.weight"] = torch.randn(16, hidden), torch.randn(16, hidden)
    gpu = EngineLayout(tp_size=tp, dtype="float32", device="cuda")
    assert model.problem(gpu) is None
    prediction = ChecksumPrediction(model, (gpu,))
    for name, tensor in hf.items():
        prediction.add(f"model.layers.3.{name}", tensor)
    loaded = _sglang_loaded(tp, model, hf)
    for rank in range(tp):
        assert not any(t.isnan().any() for t in loaded[rank].values())  # every row was loaded
        want = {f"model.layers.3.{name}": f"{tile_hash(t):016x}" for name, t in loaded[rank].items()}
        assert prediction.expected(gpu)[rank] == want, rank


def test_what_is_not_predicted_says_why():
    from megatron_grpo.models.hf_config import ModelArchitecture
    from megatron_grpo.models.tiny import tiny_hf_config

    moe = ModelLayout.of(ModelArchitecture.from_hf(tiny_hf_config("qwen3_moe").to_dict()))
    assert isinstance(moe, str) and "'qwen3_moe'" in moe
    dense = ModelLayout.of(ModelArchitecture.from_hf(tiny_hf_config("qwen2", num_key_value_heads=1).to_dict()))
    assert isinstance(dense, ModelLayout) and dense.num_kv_heads == 1
    # a CPU engine pads 1 kv head to 2 at tp 2 (a GPU engine replicates it)
    assert "pads" in dense.problem(EngineLayout(2, "float32", "cpu"))
    assert dense.problem(EngineLayout(2, "float32", "cuda")) is None
    assert "--dtype auto" in EngineLayout.of({"dtype": "auto", "device": "cuda", "tp_size": 1})
    assert "--quantization fp8" in EngineLayout.of({"dtype": "bfloat16", "device": "cuda", "quantization": "fp8"})
    assert EngineLayout.of({"dtype": "bfloat16", "device": "cpu", "tp_size": 2}) == EngineLayout(2, "bfloat16", "cpu")
