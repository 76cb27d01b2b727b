"""rollout/sglang/verify.py's check of the engines against the trainer's predicted checksums, with a
stand-in for the engines' answers (the prediction itself against SGLang's code and real engines:
tests/test_sglang_expected_checksums.py, tests/test_sglang_runtime_e2e.py)."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_grpo.models.hf_config import ModelArchitecture
from megatron_grpo.models.tiny import tiny_hf_config
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.verify import ChecksumPlan, WeightVerificationError, verify_engines
from megatron_grpo.rollout.sglang.weight_sync import EngineTarget

SERVER_INFO = {"dtype": "float32", "device": "cpu", "tp_size": 1}


class Engines:
    """Answers /server_info, /weights_checker and /get_weights_by_name (400, as SGLang's Qwen3)."""

    def __init__(self, checksums: dict[str, list[dict[str, str]]]):
        self.checksums = checksums
        self.calls: list[tuple[str, str]] = []

    def call(self, url, path, payload=None, *, method="POST", timeout_s=None, retry=None):
        self.calls.append((url, path))
        if path == "/server_info":
            return SERVER_INFO
        if path == "/weights_checker":
            return {"success": True, "ranks": [{"checksums": dict(rank)} for rank in self.checksums[url]]}
        raise SGLangError("Get parameter by name failed", url, status=400)


def _model_tensors():
    arch = ModelArchitecture.from_hf(tiny_hf_config("qwen3"))  # tied, 4 layers
    torch.manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(arch.vocab_size, arch.hidden_size),
               "model.norm.weight": torch.randn(arch.hidden_size)}
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        q_rows, kv_rows = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
        tensors.update({p + "self_attn.q_proj.weight": torch.randn(q_rows, arch.hidden_size),
                        p + "self_attn.k_proj.weight": torch.randn(kv_rows, arch.hidden_size),
                        p + "self_attn.v_proj.weight": torch.randn(kv_rows, arch.hidden_size),
                        p + "self_attn.o_proj.weight": torch.randn(arch.hidden_size, q_rows),
                        p + "self_attn.q_norm.weight": torch.randn(arch.head_dim),
                        p + "self_attn.k_norm.weight": torch.randn(arch.head_dim),
                        p + "mlp.gate_proj.weight": torch.randn(arch.ffn_hidden_size, arch.hidden_size),
                        p + "mlp.up_proj.weight": torch.randn(arch.ffn_hidden_size, arch.hidden_size),
                        p + "mlp.down_proj.weight": torch.randn(arch.hidden_size, arch.ffn_hidden_size),
                        p + "input_layernorm.weight": torch.randn(arch.hidden_size),
                        p + "post_attention_layernorm.weight": torch.randn(arch.hidden_size)})
    return arch, tensors


def _predicted(arch, tensors, urls):
    """A plan (over engines that answer nothing yet) and its sample of the pushed tensors, with the
    checksums predicted for the first engine."""
    engines = Engines({})
    plan = ChecksumPlan(engines, arch)
    sample = plan.sample([EngineTarget(url) for url in urls])
    list(sample.tap(iter(tensors.items())))
    return engines, plan, sample, sample.prediction.expected(plan.layout(urls[0]))


def test_one_engine_is_checked_against_the_trainer_and_a_wrong_tensor_named():
    arch, tensors = _model_tensors()
    url = "http://engine-a"
    engines, plan, sample, expected = _predicted(arch, tensors, [url])
    assert len(expected[0]) == 4 * 8 + 2  # fused: qkv, gate_up; tied: no lm_head
    engines.checksums[url] = expected
    report = verify_engines(engines, [EngineTarget(url)], sample, plan)
    assert report.metrics()["sync/checksums_verified"] == report.metrics()["sync/verified_tensors"] == 34
    wrong = [dict(expected[0], **{"model.layers.2.mlp.gate_up_proj.weight": "0" * 16})]
    with pytest.raises(WeightVerificationError, match=r"http://engine-a holds other values for "
                                                      r"'model.layers.2.mlp.gate_up_proj.weight' \(TP rank 0\)"):
        verify_engines(Engines({url: wrong}), [EngineTarget(url)], sample, plan)
    missing = [{k: v for k, v in expected[0].items() if k != "model.norm.weight"}]
    with pytest.raises(WeightVerificationError, match="the trainer's tensors make"):
        verify_engines(Engines({url: missing}), [EngineTarget(url)], sample, plan)
    extra = [dict(expected[0], **{"lm_head.weight": "1" * 16})]
    with pytest.raises(WeightVerificationError, match="the trainer pushed nothing for .*'lm_head.weight'"):
        verify_engines(Engines({url: extra}), [EngineTarget(url)], sample, plan)


def test_engines_with_other_parameters_are_compared_with_each_other_and_that_is_said_once(caplog):
    """The test harness keeps HF-named, unfused parameters: not SGLang's layout, so not predicted."""
    arch, tensors = _model_tensors()
    urls = ["http://harness-a", "http://harness-b"]
    engines, plan, sample, _ = _predicted(arch, tensors, urls)
    hf_named = [{name: f"{i:016x}" for i, name in enumerate(tensors)}]
    engines.checksums.update({url: hf_named for url in urls})
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.rollout.sglang.verify"):
        for _ in range(2):
            report = verify_engines(engines, [EngineTarget(u) for u in urls], sample, plan)
            assert report.metrics()["sync/checksums_verified"] == report.metrics()["sync/verified_tensors"] == 0
    notes = [r.getMessage() for r in caplog.records if "not predicted" in r.getMessage()]
    assert len(notes) == 2 and all("not SGLang's fused parameters" in n for n in notes)  # once per engine
    engines.checksums[urls[1]] = [dict(hf_named[0], **{"model.norm.weight": "f" * 16})]
    with pytest.raises(WeightVerificationError, match="engines http://harness-a and http://harness-b disagree on "
                                                      "'model.norm.weight'"):
        verify_engines(engines, [EngineTarget(u) for u in urls], sample, plan)
