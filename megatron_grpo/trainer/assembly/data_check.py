"""`megatron-grpo config show --check-data`: the checks of a run's start that need only the config,
the tokenizer and the data (the model's context, the tokenizer against the model's vocabulary,
every prompt file read and encoded), with no model built, no folder written, no process group.
The trainer runs the same checks at its start (trainer/setup.py) before it builds any model."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError


def check_data(cfg: Config) -> list[str]:
    """Raises the trainer's own ConfigError / DataError; returns what was found, one line each."""
    from megatron_grpo.trainer.assembly.initial_model import initial_tokenizer_folder
    from megatron_grpo.trainer.assembly.model_path import check_context_length
    from megatron_grpo.trainer.assembly.tokenizer import check_tokenizer_fits, load_tokenizer
    from megatron_grpo.trainer.assembly.prompt_data import load_prompts

    model_folder = _model_folder(cfg) if cfg.model.path else None
    with tempfile.TemporaryDirectory(prefix="megatron-grpo-check-") as scratch:
        if cfg.model.tokenizer_path or model_folder is None:
            tokenizer_source, tokenizer_dir = initial_tokenizer_folder(cfg, Path(scratch) / "tokenizer")
        else:
            tokenizer_source, tokenizer_dir = "model.path", model_folder
        tokenizer = load_tokenizer(tokenizer_dir, tokenizer_source)
        context, vocab, where = _model_context(cfg, model_folder, len(tokenizer))
        check_context_length(cfg, context, f"max_position_embeddings in {where}")
        if model_folder is not None:
            check_tokenizer_fits(vocab, tokenizer, model_folder, tokenizer_source)
        train, evals = load_prompts(cfg, tokenizer)
    longest = max((len(p.input_ids) for p in train), default=0)
    return [f"model context {context} tokens >= data.max_prompt_length + data.max_response_length = "
            f"{cfg.data.max_prompt_length + cfg.data.max_response_length} ({where})",
            f"tokenizer ({tokenizer_source}): {len(tokenizer)} tokens, the model has {vocab} embeddings",
            f"train: {len(train)} prompts, the longest {longest} tokens (data.max_prompt_length="
            f"{cfg.data.max_prompt_length})",
            f"eval: {len(evals)} prompts" if evals else "eval: none"]


def _model_context(cfg: Config, model_folder: Path | None, tokenizer_tokens: int) -> tuple[int, int, str]:
    """(max_position_embeddings, vocab_size, where they were read); the initial model's vocab_size
    check (initial_vocab_size) raises here."""
    if model_folder is not None:
        path = model_folder / "config.json"
        hf = json.loads(path.read_text())
        return int(hf["max_position_embeddings"]), int(hf["vocab_size"]), str(path)
    from megatron_grpo.trainer.assembly.initial_model import (initial_config_source, initial_hf_config,
                                                              initial_vocab_size)

    hf = initial_hf_config(cfg)
    return int(hf.max_position_embeddings), initial_vocab_size(cfg, hf, tokenizer_tokens), initial_config_source(cfg)


def _model_folder(cfg: Config) -> Path:
    from megatron_grpo.trainer.assembly.model_path import local_model_folder

    folder = local_model_folder(cfg.model.path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path} is a `convert hf-to-megatron` checkpoint: --check-data "
                          "reads an HF folder's config.json (the trainer exports the checkpoint at its start)")
    return folder
