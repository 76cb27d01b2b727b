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


# tied / untied embeddings, head_dim != hidden / heads; MoE (router, top-k and shared experts); multi-head
# latent attention with q_lora_rank set (q_a/q_b) and null (q_proj), v head != q/k head
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe", "deepseek_v3", "deepseek_v3_lite"])
def test_one_token_flops_equal_torchs_count_of_the_hf_model(arch):
    """With one token, causal attention is the full score matrix, so every FLOP the HF model does
    is useful: forward (matmuls incl. the LM head, no input-embedding FLOPs) and forward + backward
    must equal torch's count exactly. transformers' MoE runs each expert on the tokens routed to it
    (top-k of them per token), so its count is the active experts'."""
    from transformers import AutoModelForCausalLM

    hf_config = tiny_hf_config(arch, vocab_size=256)  # a multiple of 128: padded vocab == vocab
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"  # its grouped_mm default is not in torch's count
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


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v3_lite", "qwen3_moe"])
def test_many_token_flops_equal_torchs_count_less_the_wasted_scores(arch):
    """s tokens through the HF model (eager attention: the full s x s score and value matmuls, half of
    them masked): torch's count is ours plus the s(s-1)/2 masked pairs' FLOPs, forward and backward.
    The pairs' FLOPs use the q/k head for scores and MLA's own value head for the weighted sum; each
    token goes through exactly top-k experts whatever the router picks."""
    from transformers import AutoModelForCausalLM

    hf_config = tiny_hf_config(arch, vocab_size=256)
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"  # its grouped_mm default is not in torch's count
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    mc = ModelArchitecture.from_hf(hf_config)
    s = 7
    wasted = flops.attention_pair_flops(mc) * s * (s - 1) / 2
    assert flops.forward_flops(mc, [s]) + wasted == _counted(model, s, backward=False)
    assert flops.training_flops(mc, [s]) + 3 * wasted == _counted(model, s, backward=True)


def test_mla_attention_pair_uses_both_head_dims():
    mc = ModelArchitecture.from_hf(tiny_hf_config("deepseek_v3_lite"))  # q/k head 32 + 16, v head 24
    assert flops.attention_pair_flops(mc) == 2 * mc.num_layers * mc.num_attention_heads * (48 + 24)


def test_peak_table_prefers_specific_names():
    def first(name):
        return next(row for row in flops.DEVICE_PEAKS if row[0] in name)

    assert first("NVIDIA H200")[1:] == (989.0, 4.8)
    assert first("NVIDIA GH200 480GB")[0] == "GH200"
    assert first("NVIDIA H100 PCIe")[1] == 756.0
    assert first("NVIDIA A100-SXM4-80GB")[2] == 2.039
    assert flops.peak_flops_per_device(torch.device("cpu")) is None
