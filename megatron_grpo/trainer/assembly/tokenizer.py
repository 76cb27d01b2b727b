"""The policy's tokenizer: loading it with a one-line error, and checking that the model has an
embedding row for every id it can produce (the start, `config show --check-data`, the initial
model and tools/prepare_gsm8k.py use these)."""
from __future__ import annotations

from pathlib import Path

from megatron_grpo.errors import ConfigError


def load_tokenizer(folder: str | Path, source: str):
    """The HF tokenizer in `folder`; `source` names the key it came from (model.tokenizer_path=...)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}: no tokenizer could be loaded from {folder} (expected a folder with "
                          f"tokenizer.json or the files of a slow tokenizer): {str(exc).splitlines()[0]}") from None


def check_tokenizer_fits(vocab_size: int, tokenizer, model_dir: Path, tokenizer_source: str) -> None:
    """Every token id the tokenizer can produce must have an embedding row (else the first prompt
    holding one fails deep in the forward pass)."""
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"the tokenizer ({tokenizer_source}) has {len(tokenizer)} tokens but the model has "
                          f"embeddings for {vocab_size} (vocab_size in {model_dir / 'config.json'}): use the model's "
                          "own tokenizer, or a model whose vocabulary covers it")
