"""Local path or hub id (config/model_paths.py): one rule for every model path key; a local path that
does not exist is named at the start in one line (exit 2), never sent to the Hugging Face hub, whose
retries took about a minute before they failed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_grpo.config.model_paths import local_path_reason
from megatron_grpo.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value, reason", [
    ("/models/qwen", "it starts with /"), ("./rm", "it starts with ./"), ("../rm", "it starts with ../"),
    ("~/rm", "it starts with ~"), (".cache/rm", "it starts with ."), ("..", "it starts with ."),
    ("shared/models/qwen", "it has more than one '/' (a hub id is org/name)"),
    ("outputs/rm", "./outputs is a folder here"),  # ./outputs exists in the test's folder
    ("Qwen/Qwen3-8B", None), ("gpt2", None), ("runs/rm", None),  # hub ids: no ./Qwen, ./runs here
])
def test_one_rule_tells_a_local_path_from_a_hub_id(value, reason, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    assert local_path_reason(value) == reason


def test_train_names_every_missing_local_model_path_at_once(tmp_path):
    """The CLI, before torch is imported: each missing local path by its key, a hub id left alone;
    nothing built (no initial_model/)."""
    (tmp_path / "outputs").mkdir()
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", "logging.output_dir=run",
                           "model.tokenizer_path=./tok", "ref.model_path=outputs/ref", "reward.models.rm.path=a/b/rm",
                           "reward.models.hub.path=Org/Model"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (
        "error: 3 missing model paths: model.tokenizer_path=./tok: no such file or folder (a local path: it starts "
        "with ./; a Hugging Face hub id is written org/name); ref.model_path=outputs/ref: no such file or folder (a "
        "local path: ./outputs is a folder here; a Hugging Face hub id is written org/name); reward.models.rm.path="
        "a/b/rm: no such file or folder (a local path: it has more than one '/' (a hub id is org/name); a Hugging "
        "Face hub id is written org/name)\n")
    assert not (tmp_path / "run").exists()


def test_model_path_under_a_local_folder_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    from megatron_grpo.trainer.assembly.model_path import local_model_folder

    asked = []

    def no_hub(repo_id, **kwargs):
        asked.append(repo_id)
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    with pytest.raises(ConfigError, match=r"^model.path=outputs/policy: no such folder"):
        local_model_folder("outputs/policy")
    assert asked == []
