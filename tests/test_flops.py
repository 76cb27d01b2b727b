"""trainer/step/flops.py, the one FLOPs definition (perf/* metrics, bench_gpu's MFU), against an
independent count: torch's FlopCounterMode over the HF model's own forward and backward."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_grpo.models import ModelArchitecture
from megatron_grpo.models.tiny import tiny_hf_config
from megatron_grpo.trainer.step import flops


def _counted(hf_model, tokens: int, backward: bool) -> int:
    ids = torch.arange(tokens).unsqueeze(0) % hf_model.config.vocab_size
    with FlopCounterMode(display=False) as counter:
        logits = hf_model(ids).logits
        if backward:
            logits.sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # tied / untied embeddings, head_dim != hidden / heads
def test_one_token_flops_equal_torchs_count_of_the_hf_model(arch):
    """With one token, causal attention is the full score matrix, so every FLOP the HF model does
    is useful: forward (matmuls incl. the LM head, no input-embedding FLOPs) and forward + backward
    must equal torch's count exactly."""
    from transformers import AutoModelForCausalLM

    hf_config = tiny_hf_config(arch, vocab_size=256)  # a multiple of 128: padded vocab == vocab
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    mc = ModelArchitecture.from_hf(hf_config)
    assert mc.padded_vocab_size == hf_config.vocab_size
    assert flops.forward_flops(mc, [1]) == _counted(model, 1, backward=False)
    assert flops.training_flops(mc, [1]) == _counted(model, 1, backward=True)


def test_attention_counts_only_the_causal_pairs():
    """A sequence of s tokens: s linear passes plus s(s+1)/2 (query, key) pairs per head and layer;
    sequences add up."""
    mc = ModelArchitecture.from_hf(tiny_hf_config("qwen3", vocab_size=256))
    per_pair = 4 * mc.num_layers * mc.num_attention_heads * mc.head_dim
    linear = flops.forward_flops(mc, [1]) - per_pair
    for s in (2, 9, 64):
        assert flops.forward_flops(mc, [s]) == s * linear + per_pair * s * (s + 1) / 2
    assert flops.training_flops(mc, [9, 64]) == flops.training_flops(mc, [9]) + flops.training_flops(mc, [64])


def test_peak_table_prefers_specific_names():
    def first(name):
        return next(row for row in flops.DEVICE_PEAKS if row[0] in name)

    assert first("NVIDIA H200")[1:] == (989.0, 4.8)
    assert first("NVIDIA GH200 480GB")[0] == "GH200"
    assert first("NVIDIA H100 PCIe")[1] == 756.0
    assert first("NVIDIA A100-SXM4-80GB")[2] == 2.039
    assert flops.peak_flops_per_device(torch.device("cpu")) is None
