"""Qwen's real tokenizer built offline from its BPE ranks (megatron_grpo/testing/qwen_tokenizer.py)
against the token ids published for Qwen/Qwen-tokenizer in transformers' own integration test
(tests/models/qwen2/test_tokenization_qwen2.py, test_tokenizer_integration) and the chat-format
special tokens."""
from __future__ import annotations

import pytest

from megatron_grpo.testing.qwen_tokenizer import DEFAULT_VOCAB, build_qwen_tokenizer
from tests.requirements import missing

# transformers' test_tokenizer_integration: its sequences and expected input_ids (padding removed)
PUBLISHED = [
    ("Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides "
     "general-purpose architectures (BERT, GPT-2, RoBERTa, XLM, DistilBert, XLNet...) for Natural "
     "Language Understanding (NLU) and Natural Language Generation (NLG) with over 32+ pretrained "
     "models in 100+ languages and deep interoperability between Jax, PyTorch and TensorFlow.",
     [8963, 388, 320, 69514, 3881, 438, 4510, 27414, 32852, 388, 323, 4510, 27414, 21334, 35722, 1455, 529, 8,
      5707, 4586, 58238, 77235, 320, 61437, 11, 479, 2828, 12, 17, 11, 11830, 61437, 64, 11, 1599, 10994, 11,
      27604, 321, 33, 529, 11, 29881, 6954, 32574, 369, 18448, 11434, 45451, 320, 45, 23236, 8, 323, 18448,
      11434, 23470, 320, 30042, 38, 8, 448, 916, 220, 18, 17, 10, 80669, 4119, 304, 220, 16, 15, 15, 10, 15459,
      323, 5538, 94130, 2897, 1948, 619, 706, 11, 5355, 51, 21584, 323, 94986, 13]),
    ("🤗 Transformers 提供了可以轻松地下载并且训练先进的预训练模型的 API 和工具。"
     "使用预训练模型可以减少计算消耗和碳排放，并且节省从头训练所需要的时间和资源。",
     [144834, 80532, 93685, 83744, 34187, 73670, 104261, 29490, 62189, 103937, 104034, 102830, 98841, 104034,
      104949, 9370, 5333, 58143, 102011, 1773, 37029, 98841, 104034, 104949, 73670, 101940, 100768, 104997,
      33108, 100912, 105054, 90395, 100136, 106831, 45181, 64355, 104034, 113521, 101975, 33108, 85329, 1773]),
    ("```python\ntokenizer = AutoTokenizer.from_pretrained(\"Qwen/Qwen-tokenizer\")\ntokenizer(\"世界，你好！\")```",
     [73594, 12669, 198, 85593, 284, 8979, 37434, 6387, 10442, 35722, 445, 48, 16948, 45274, 16948, 34841, 3135,
      1138, 85593, 445, 99489, 3837, 108386, 6313, 899, 73594]),
]


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    if not DEFAULT_VOCAB.is_file():
        missing(f"{DEFAULT_VOCAB} is missing (bash scripts/install_qwen_vocab.sh)")
    return AutoTokenizer.from_pretrained(build_qwen_tokenizer())


@pytest.mark.parametrize("text, ids", PUBLISHED, ids=["english", "chinese-emoji", "code"])
def test_ids_equal_the_ones_published_for_qwens_tokenizer(qwen, text, ids):
    assert qwen.encode(text, add_special_tokens=False) == ids
    assert qwen.decode(ids) == text


def test_chat_format_special_tokens_and_nfc(qwen):
    assert qwen.encode("<|im_start|>hello<|im_end|>") == [151644, 14990, 151645]  # as Qwen2Tokenizer gives
    assert qwen.convert_tokens_to_ids(["<|endoftext|>", "<tool_call>", "<think>", "</think>"]) == [
        151643, 151657, 151667, 151668] and len(qwen) == 151_669  # Qwen3's tokenizer_config.json
    assert qwen.encode("<think>\n1</think>") == [151667, 198, 16, 151668]
    assert qwen.decode([151644, 14990, 151645, 151667], skip_special_tokens=True) == "hello<think>"
    assert qwen.backend_tokenizer.normalizer.normalize_str("\u03d2\u0301") == "\u03d3"  # NFC, as Qwen2's

