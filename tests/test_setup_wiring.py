"""Recipe keys that trainer/setup.py hands on: model.tokenizer_path with model.path set, and
reward.signature / reward.max_error_frac to the reward runner."""
from __future__ import annotations

import pytest

from megatron_grpo.testing.distributed import run_distributed

FAST = ["trainer.total_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
        "logging.console=false", "logging.plot=false"]


def _built(rank, world_size, overrides):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.setup import build_run

    run = build_run(load_config("tiny_cpu", overrides))
    try:
        return {"vocab": run.tokenizer.get_vocab(), "engine_vocab": run.engine.tokenizer.get_vocab(),
                "signature": run.rewards.signature, "max_error_frac": run.rewards.max_error_frac}
    finally:
        run.close()


@pytest.mark.slow
def test_tokenizer_path_is_used_with_model_path(tmp_path):
    """The model folder's tokenizer (character-level, no chat template) is not the one asked for:
    model.tokenizer_path's synthetic tokenizer formats and encodes the prompts, in the trainer and
    in the rollout engine."""
    from megatron_grpo.data.synthetic import build_tokenizer
    from tests.tiny_hf import save_tiny_model

    model = save_tiny_model(tmp_path / "model", seed=0)
    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    built = run_distributed(_built, 1, ([*FAST, f"model.path={model}", "model.override_config={}",
                                         f"model.tokenizer_path={tokenizer}",
                                         f"logging.output_dir={tmp_path / 'run'}"],),
                            timeout=300)[0]
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(tokenizer).get_vocab()
    assert built["vocab"] == expected and built["engine_vocab"] == expected


@pytest.mark.slow
def test_reward_signature_and_max_error_frac_reach_the_runner(tmp_path):
    built = run_distributed(_built, 1, ([*FAST, "reward.signature=verl", "reward.max_error_frac=0.9",
                                         f"logging.output_dir={tmp_path / 'run'}"],), timeout=300)[0]
    assert (built["signature"], built["max_error_frac"]) == ("verl", 0.9)


def test_override_config_with_model_path_is_named_as_not_applied(tmp_path, caplog):
    """model.override_config shapes a model built from scratch; with model.path the folder's
    config.json is used as it is, and the keys that differ from it are named, not dropped silently."""
    import json
    import logging

    from megatron_grpo.trainer.assembly.model_path import _warn_unapplied_overrides

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.trainer.assembly.model_path"):
        _warn_unapplied_overrides({"hidden_size": 64, "num_hidden_layers": 4, "rope_theta": 1e6}, tmp_path)
        assert "these keys differ from it: num_hidden_layers, rope_theta" in caplog.text
        caplog.clear()
        _warn_unapplied_overrides({"hidden_size": 64}, tmp_path)  # what the folder has already
        assert caplog.text == ""


@pytest.mark.slow
def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line_before_any_model_is_built(tmp_path):
    from megatron_grpo.data.synthetic import build_tokenizer
    from megatron_grpo.models.tiny import save_tiny_hf_model

    folder = tmp_path / "hf"
    save_tiny_hf_model("qwen3", folder, seed=0, num_hidden_layers=1, vocab_size=8)
    size = len(__import__("transformers").AutoTokenizer.from_pretrained(build_tokenizer(folder)))
    assert size > 8
    with pytest.raises(Exception) as info:
        run_distributed(_built, 1, ([*FAST, f"model.path={folder}", "model.make_vocab_size_divisible_by=8",
                                     f"logging.output_dir={tmp_path / 'out'}"],))
    assert (f"ConfigError: the tokenizer (model.path) has {size} tokens but the model has embeddings for 8 "
            f"(vocab_size in {folder / 'config.json'})" in str(info.value)), str(info.value)[-1500:]
    assert "Setting up optimizer" not in str(info.value)
