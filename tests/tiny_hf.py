"""Tiny random HF models and a character-level tokenizer, built from configs (no downloads)."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 300
PAD_ID, EOS_ID = 0, 1


# A chat template for char_tokenizer, which has no whitespace: spelled without it.
CHAR_CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}|{% endfor %}"
                      "{% if add_generation_prompt %}[assistant]{% endif %}")


def char_tokenizer(whitespace: bool = False):
    """A PreTrainedTokenizerFast whose tokens are single characters (ids 2..299) plus <pad>, <eos>.

    Printable ASCII without space (ids 2..95), then Cyrillic letters. With `whitespace`, the last two
    ids (298, 299) spell " " and "\\n" instead of two Cyrillic letters (every other id is unchanged):
    for text such as "#### 42" or a tool's printed output; without it those characters are dropped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(0x400, 0x400 + VOCAB_SIZE - 2 - 94)]
    if whitespace:
        chars = chars[:-2] + [" ", "\n"]
    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID}
    vocab.update({ch: i + 2 for i, ch in enumerate(chars)})
    assert len(vocab) == VOCAB_SIZE
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    # no clean-up on decode: it would drop the space before "." or "," that a model generated
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   **({"clean_up_tokenization_spaces": False} if whitespace else {}))


def tiny_qwen3_config(tie_word_embeddings: bool = False):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                       tie_word_embeddings=tie_word_embeddings, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def tiny_model(seed: int, tie_word_embeddings: bool = False, scale: float = 1.0):
    """A random tiny Qwen3 in fp32. `scale` multiplies the weights: > 1 gives peakier next-token
    distributions, so samples are not uniform noise."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(tie_word_embeddings), dtype=torch.float32)
    if scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.mul_(scale)
    return model.eval()


def save_tiny_model(folder: str | Path, seed: int, tie_word_embeddings: bool = False, scale: float = 1.0) -> Path:
    """Writes an HF folder (config, safetensors, tokenizer) for the fake server / disk tests."""
    folder = Path(folder)
    tiny_model(seed, tie_word_embeddings, scale).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def float64_logprobs(model, prompt_ids, response_ids, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each response id, from one full forward of `model` over prompt +
    response, in float64: the reference the engines' per-token log-probs are held to."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].double()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(1, torch.tensor(list(response_ids))[:, None]).squeeze(1)


def save_peaky_llama(folder: str | Path):
    """A tiny Llama (SGLang's LlamaForCausalLM has get_weights_by_name) with the character tokenizer,
    its weights large enough that top-p cuts the distributions at different sizes; returns the
    model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.models.tiny import tiny_hf_config

    torch.manual_seed(0)
    config = tiny_hf_config("llama", vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                            bos_token_id=None, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if name.endswith("norm.weight")
                        else 0.4 * torch.randn_like(param))
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return model.eval()
