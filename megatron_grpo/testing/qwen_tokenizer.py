"""Qwen's real tokenizer (Qwen2 / Qwen2.5 / Qwen3 share it) as an HF fast tokenizer, built offline
from Qwen's BPE ranks in tiktoken format (`qwen.tiktoken`, 151,643 ranks; the `dashscope` wheel
carries it: scripts/install_qwen_vocab.sh puts it in build/qwen-vocab/). For tests and
benchmarks that need real token counts and ids (GSM8K lengths, chat-formatted prompts) on a
machine that cannot reach the Hub. tests/test_qwen_tokenizer.py checks it against the ids
transformers' own integration test publishes for Qwen/Qwen-tokenizer.

The conversion is transformers' TikTokenConverter (ranks -> byte-level BPE vocabulary + merges)
with Qwen2's pre-tokenizer split (digits one by one) and NFC normalisation, as Qwen2TokenizerFast
has them, and Qwen3's 26 added tokens at their ids 151643-151668 (its tokenizer_config.json:
<|endoftext|>, <|im_start|>, <|im_end|>, ... special; <tool_call> ... </think> not). No chat
template: tests take the real Qwen3 templates from where they are shipped (TRL's)."""
from __future__ import annotations

import base64
import shutil
import tempfile
from pathlib import Path

# Qwen2's split (transformers' Qwen2TokenizerFast): like GPT-4's but \p{N} one digit at a time.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
NUM_RANKS = 151_643
# Qwen3's added tokens from id 151643 on, in order; the first 14 are special (skipped when decoding).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")
DEFAULT_VOCAB = Path(__file__).resolve().parents[2] / "build" / "qwen-vocab" / "qwen.tiktoken"
# Where the built tokenizer is kept (its name changes when what is built changes).
DEFAULT_FOLDER = DEFAULT_VOCAB.parents[1] / "qwen3-tokenizer-v1"


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`<base64 token bytes> <rank>` per line (tiktoken's format)."""
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_qwen_tokenizer(out_dir: Path = DEFAULT_FOLDER, vocab_file: Path = DEFAULT_VOCAB) -> Path:
    """Writes the HF tokenizer folder `out_dir` (kept when it exists; processes building it at
    once each write their own and the first rename wins); returns it."""
    if (out_dir / "tokenizer.json").is_file():
        return out_dir
    from tokenizers import AddedToken, normalizers
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
    backend.add_tokens([AddedToken(token, normalized=False, special=False) for token in ADDED_TOKENS])
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    ids = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, *ADDED_TOKENS])
    if ids != list(range(NUM_RANKS, NUM_RANKS + len(ids))):  # the ids Qwen3's checkpoints were trained with
        raise ValueError(f"Qwen3's added tokens got ids {ids[0]}..{ids[-1]}, expected {NUM_RANKS}..")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out_dir)
    except OSError:  # another process built it first
        shutil.rmtree(tmp)
    return out_dir
