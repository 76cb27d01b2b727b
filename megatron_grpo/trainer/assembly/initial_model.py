"""<output_dir>/initial_model: the HF folder a run without model.path starts from, initialised from
trainer.seed by `transformers` (config from model.config_path and/or model.override_config,
tokenizer from model.tokenizer_path or the synthetic task), so every later step (Megatron loading,
the rollout engine, conversion) works on real HF files. Rebuilt when what it was built from
changes (run_folder.initial_model_record)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError

log = logging.getLogger(__name__)


def ensure_initial_model(cfg: Config, target: Path) -> None:
    """Rank 0: builds `target` unless it exists and was built from what this config asks for
    (config, override_config, tokenizer, trainer.seed)."""
    from megatron_grpo.trainer.state.run_folder import differences, initial_model_record, read_initial_model_record

    wanted, found = initial_model_record(cfg), read_initial_model_record(target)
    if found == wanted and (target / "config.json").is_file():
        return
    if target.exists():
        changed = "; ".join(differences(found, wanted)) if found else "it records nothing"
        log.info("initial model: rebuilding %s (%s)", target, changed)
    _write_initial_model(cfg, target, wanted)


def initial_hf_config(cfg: Config):
    """The HF config a model built from scratch gets (model.config_path + model.override_config);
    cheap: no weights, so the settings it decides can be checked before the model is written."""
    from transformers import AutoConfig

    overrides = dict(cfg.model.override_config)
    if cfg.model.config_path:
        return AutoConfig.from_pretrained(cfg.model.config_path, **overrides)
    model_type = overrides.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model.override_config.model_type is required when neither model.path nor "
                          "model.config_path is set")
    return AutoConfig.for_model(model_type, **overrides)


def initial_config_source(cfg: Config) -> str:
    """The key the initial model's config comes from, for messages."""
    return "model.config_path" if cfg.model.config_path else "model.override_config"


def initial_tokenizer_folder(cfg: Config, synthetic_dir: Path) -> tuple[str, Path]:
    """(the key it comes from, the folder) of the initial model's tokenizer: model.tokenizer_path,
    or the synthetic task's, built into `synthetic_dir`."""
    if cfg.model.tokenizer_path:
        return f"model.tokenizer_path={cfg.model.tokenizer_path}", Path(cfg.model.tokenizer_path)
    if cfg.data.task:
        from megatron_grpo.data.synthetic import build_tokenizer

        return f"the synthetic task {cfg.data.task}'s", build_tokenizer(synthetic_dir)
    raise ConfigError("model.path is not set: set model.path (an HF folder), or model.tokenizer_path / "
                      "data.task to initialise a model from model.config_path / model.override_config")


def initial_vocab_size(cfg: Config, hf_config, tokenizer_tokens: int) -> int:
    """The initial model's embedding rows. The architecture's default vocabulary (151,936 for Qwen3)
    would dwarf a tiny model: the tokenizer's size, unless the recipe sets vocab_size itself (which
    must cover the tokenizer)."""
    if "vocab_size" not in cfg.model.override_config:
        return tokenizer_tokens
    if hf_config.vocab_size < tokenizer_tokens:
        raise ConfigError(f"model.override_config.vocab_size={hf_config.vocab_size} is smaller than the "
                          f"tokenizer's {tokenizer_tokens} tokens")
    return hf_config.vocab_size


def _write_initial_model(cfg: Config, target: Path, record: dict) -> None:
    from transformers import AutoModelForCausalLM

    from megatron_grpo.trainer.assembly.tokenizer import load_tokenizer
    from megatron_grpo.trainer.state.run_folder import INIT_RECORD

    source, folder = initial_tokenizer_folder(cfg, target.with_name("synthetic_tokenizer"))
    tokenizer = load_tokenizer(folder, source)
    hf_config = initial_hf_config(cfg)
    hf_config.vocab_size = initial_vocab_size(cfg, hf_config, len(tokenizer))
    hf_config.pad_token_id = tokenizer.pad_token_id
    hf_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(cfg.trainer.seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tmp = target.with_name(target.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted earlier run
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / INIT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)  # left by an interrupted earlier rebuild
    if target.exists():
        target.rename(old)  # derived from the config alone: rebuilt, so the old copy can go
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
