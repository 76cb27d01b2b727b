"""Qwen's real tokenizer (Qwen2 / Qwen2.5 / Qwen3 share it) as an HF fast tokenizer, built offline
from Qwen's BPE ranks in tiktoken format (`qwen.tiktoken`, 151,643 ranks; the `dashscope` wheel
carries it: scripts/install_qwen_vocab.sh puts it in build/qwen-vocab/). For tests and
benchmarks that need real token counts and ids (GSM8K lengths, chat-formatted prompts) on a
machine that cannot reach the Hub. tests/test_qwen_tokenizer.py checks it against the ids
transformers' own integration test publishes for Qwen/Qwen-tokenizer.

The conversion is transformers' TikTokenConverter (ranks -> byte-level BPE vocabulary + merges)
with Qwen2's pre-tokenizer split (digits one by one) and NFC normalisation, as Qwen2TokenizerFast
has them, and the three special tokens of Qwen's chat format at ids 151643-151645."""
from __future__ import annotations

import base64
from pathlib import Path

# Qwen2's split (transformers' Qwen2TokenizerFast): like GPT-4's but \p{N} one digit at a time.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
NUM_RANKS = 151_643
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 151643, 151644, 151645
DEFAULT_VOCAB = Path(__file__).resolve().parents[2] / "build" / "qwen-vocab" / "qwen.tiktoken"


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`<base64 token bytes> <rank>` per line (tiktoken's format)."""
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_qwen_tokenizer(out_dir: Path, vocab_file: Path = DEFAULT_VOCAB) -> Path:
    """Writes the HF tokenizer folder `out_dir` (kept when it exists); returns it."""
    if (out_dir / "tokenizer.json").is_file():
        return out_dir
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if not vocab_file.is_file():
        raise FileNotFoundError(f"{vocab_file}: Qwen's BPE ranks are not there (bash scripts/install_qwen_vocab.sh)")
    ranks = read_tiktoken_ranks(vocab_file)
    if len(ranks) != NUM_RANKS or sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise ValueError(f"{vocab_file}: expected Qwen's {NUM_RANKS} ranks 0..{NUM_RANKS - 1}, got {len(ranks)}")

    class QwenRanks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    backend = QwenRanks(vocab_file=str(vocab_file), pattern=QWEN2_PATTERN,
                        extra_special_tokens=list(SPECIAL_TOKENS)).converted()
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        clean_up_tokenization_spaces=False)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir
