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
    from megatron_grpo.trainer.assembly.model_path import check_context_length, check_tokenizer_fits, load_tokenizer
    from megatron_grpo.trainer.assembly.prompt_data import load_prompts

    with tempfile.TemporaryDirectory(prefix="megatron-grpo-check-") as scratch:
        tokenizer_source, tokenizer_dir = _tokenizer_folder(cfg, Path(scratch))
        tokenizer = load_tokenizer(tokenizer_dir, tokenizer_source)
        context, vocab, where = _model_context(cfg, len(tokenizer))
        check_context_length(cfg, context, f"max_position_embeddings in {where}")
        if cfg.model.path:
            check_tokenizer_fits(vocab, tokenizer, Path(where).parent, tokenizer_source)
        elif vocab < len(tokenizer):  # as the initial model's build refuses it
            raise ConfigError(f"model.override_config.vocab_size={vocab} is smaller than the tokenizer's "
                              f"{len(tokenizer)} tokens")
        train, evals = load_prompts(cfg, tokenizer)
    longest = max((len(p.input_ids) for p in train), default=0)
    return [f"model context {context} tokens >= data.max_prompt_length + data.max_response_length = "
            f"{cfg.data.max_prompt_length + cfg.data.max_response_length} ({where})",
            f"tokenizer ({tokenizer_source}): {len(tokenizer)} tokens, the model has {vocab} embeddings",
            f"train: {len(train)} prompts, the longest {longest} tokens (data.max_prompt_length="
            f"{cfg.data.max_prompt_length})",
            f"eval: {len(evals)} prompts" if evals else "eval: none"]


def _tokenizer_folder(cfg: Config, scratch: Path) -> tuple[str, Path]:
    if cfg.model.tokenizer_path:
        return f"model.tokenizer_path={cfg.model.tokenizer_path}", Path(cfg.model.tokenizer_path)
    if cfg.model.path:
        return "model.path", _model_folder(cfg)
    if cfg.data.task:
        from megatron_grpo.data.synthetic import build_tokenizer

        return f"the synthetic task {cfg.data.task}'s", build_tokenizer(scratch / "tokenizer")
    raise ConfigError("model.path is not set: set model.path (an HF folder), or model.tokenizer_path / "
                      "data.task to initialise a model from model.config_path / model.override_config")


def _model_context(cfg: Config, tokenizer_tokens: int) -> tuple[int, int, str]:
    """(max_position_embeddings, vocab_size, where they were read)."""
    if cfg.model.path:
        path = _model_folder(cfg) / "config.json"
        hf = json.loads(path.read_text())
        return int(hf["max_position_embeddings"]), int(hf["vocab_size"]), str(path)
    from megatron_grpo.trainer.assembly.initial_model import initial_hf_config

    hf = initial_hf_config(cfg)
    vocab = cfg.model.override_config.get("vocab_size", tokenizer_tokens)  # sized to the tokenizer otherwise
    where = "model.config_path" if cfg.model.config_path else "model.override_config"
    return int(hf.max_position_embeddings), int(vocab), where


def _model_folder(cfg: Config) -> Path:
    from megatron_grpo.trainer.assembly.model_path import local_model_folder

    folder = local_model_folder(cfg.model.path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path} is a `convert hf-to-megatron` checkpoint: --check-data "
                          "reads an HF folder's config.json (the trainer exports the checkpoint at its start)")
    return folder
