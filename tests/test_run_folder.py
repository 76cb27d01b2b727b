"""Run folders through the real CLI (`megatron-grpo train recipes/tiny_cpu.yaml ...` in a fresh
process): another run's folder, a run folder reused with checkpoint.resume=never, unusable
output folders, unusable model paths and an over-long context each end with ONE `error:` line
and exit code 2, before anything in the folder changes; changed hyperparameters resume and are
logged; initial_model/ follows what it is built from."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_cpu.yaml"
FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "rollout.n=4", "logging.console=false", "logging.plot=false", "eval.interval=-1"]


def train(*overrides: str, env: dict | None = None, recipe: Path = RECIPE) -> subprocess.CompletedProcess:
    """`megatron-grpo train RECIPE FAST... overrides...` in a fresh process."""
    script = Path(sys.executable).with_name("megatron-grpo")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "megatron_grpo.cli"]
    return subprocess.run([*command, "train", str(recipe), *FAST, *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def one_error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The process failed with `code` and its stderr ends with exactly one `error:` line (no
    traceback); returns that line."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


def snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under folder."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run folder of the tiny recipe: 2 steps, checkpoint step_2. Tests copy it before changing it."""
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = train("trainer.total_steps=2", "checkpoint.save_interval=2", f"logging.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def copy_of(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


# ----------------------------------------------------------------------------- another run's folder


def test_run_folder_records_what_defines_the_run(trained):
    record = json.loads((trained / "run.json").read_text())
    assert record == json.loads((trained / "checkpoints" / "step_2" / "run.json").read_text())
    definition = record["definition"]
    assert definition["data.task"] == "reverse" and definition["trainer.seed"] == 1
    assert definition["model.override_config.hidden_size"] == 64 and definition["reward.function"] == "synthetic"
    assert record["shapes"] == {"architecture": "qwen3", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                                "num_attention_heads": 4, "num_query_groups": 2, "head_dim": 16, "vocab_size": 24,
                                "tie_word_embeddings": True, "qkv_bias": False, "qk_norm": True}


def test_another_recipes_run_folder_is_one_line_naming_the_keys(trained, tmp_path):
    out = copy_of(trained, tmp_path)
    before = snapshot(out)
    other = tmp_path / "other.yaml"  # another recipe: other model size, other task
    other.write_text(f"defaults: [{RECIPE}]\nmodel:\n  override_config:\n    hidden_size: 32\n"
                     f"data:\n  task: copy\n")
    line = one_error_line(train(f"logging.output_dir={out}", "trainer.total_steps=3", recipe=other))
    assert f"error: {out / 'checkpoints' / 'step_2'} was written by another run (" in line
    assert 'data.task: "reverse" -> "copy"' in line and "model.override_config.hidden_size: 64 -> 32" in line
    assert "checkpoint.resume=force" in line
    assert snapshot(out) == before  # nothing restored, rebuilt or overwritten


def test_force_cannot_load_weights_of_other_shapes(trained, tmp_path):
    out = copy_of(trained, tmp_path)
    checkpoints = snapshot(out / "checkpoints")
    line = one_error_line(train(f"logging.output_dir={out}", "trainer.total_steps=3", "checkpoint.resume=force",
                                "model.override_config.hidden_size=32"))
    assert ("holds a model of other shapes (hidden_size: 64 -> 32)" in line
            and "even with checkpoint.resume=force" in line)
    assert snapshot(out / "checkpoints") == checkpoints


@pytest.mark.slow
def test_other_data_and_lr_are_refused_before_anything_is_restored(trained, tmp_path):
    """The issue's reproduction: other data and another lr into the same folder. Before, model,
    optimizer and scheduler were restored, the sampler check then failed, the run 'started from
    step 0' with the old weights and old lr, and overwrote step_2."""
    out = copy_of(trained, tmp_path)
    before = snapshot(out)
    line = one_error_line(train(f"logging.output_dir={out}", "trainer.total_steps=2", "checkpoint.save_interval=2",
                                "data.task=sort", "actor.optim.lr=1e-3"))
    assert 'data.task: "reverse" -> "sort"' in line and "actor.optim.lr" not in line  # lr may change
    assert snapshot(out) == before

    forced = train(f"logging.output_dir={out}", "trainer.total_steps=3", "data.task=sort", "actor.optim.lr=1e-3",
                   "checkpoint.resume=force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "checkpoint.resume=force: continuing from" in forced.stderr
    assert f"resumed from {out / 'checkpoints' / 'step_2'} (step 2)" in forced.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[2]["actor/lr"] == 1e-3


# ----------------------------------------------------------------------------- changed settings


@pytest.mark.slow
def test_changed_hyperparameters_resume_apply_and_are_logged(trained, tmp_path):
    out = copy_of(trained, tmp_path)
    step_2 = snapshot(out / "checkpoints" / "step_2")
    proc = train(f"logging.output_dir={out}", "trainer.total_steps=3", "actor.optim.lr=1e-3", "actor.grad_clip=0.5",
                 "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "actor.clip_ratio_high=0.28")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_2'} (step 2)" in proc.stderr
    logged = next(line for line in proc.stderr.splitlines() if "changed since that checkpoint" in line)
    for change in ("actor.optim.lr: 0.0015 -> 0.001", "actor.grad_clip: 1.0 -> 0.5", "data.train_batch_size: 8 -> 16",
                   "actor.ppo_mini_batch_size: 8 -> 16", "actor.clip_ratio_high: 0.2 -> 0.28",
                   "sampler: epoch 0 had 16 prompts drawn in batches of 8; continues with batch 1 of size 16"):
        assert change in logged, change
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["actor/lr"] for r in records] == [1.5e-3, 1.5e-3, 1e-3]
    assert snapshot(out / "checkpoints" / "step_2") == step_2


# ----------------------------------------------------------------------------- resume=never


@pytest.mark.slow
def test_resume_never_refuses_an_earlier_run_unless_overwrite_moves_it_aside(trained, tmp_path):
    out = copy_of(trained, tmp_path)
    before = snapshot(out)
    line = one_error_line(train(f"logging.output_dir={out}", "trainer.total_steps=1", "checkpoint.resume=never"))
    assert f"checkpoint.resume=never, but {out} holds an earlier run (checkpoints step_2" in line
    assert "logging.overwrite=true" in line
    assert snapshot(out) == before

    proc = train(f"logging.output_dir={out}", "trainer.total_steps=1", "checkpoint.resume=never",
                 "logging.overwrite=true", "checkpoint.save_interval=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    moved = tmp_path / "run.old-1"
    assert f"moved the earlier run {out} to {moved}" in proc.stderr
    assert snapshot(moved) == before  # renamed, nothing deleted
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_1"]


# ----------------------------------------------------------------------------- unusable folders and paths


def test_output_dir_under_a_file_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    line = one_error_line(train(f"logging.output_dir={blocker / 'run'}", "trainer.total_steps=1"))
    assert line == f"error: logging.output_dir={blocker / 'run'} is under {blocker}, which is a file, not a folder"


def test_unwritable_output_dir_is_one_line(tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits; /sys is read-only for everyone
        readonly = Path("/sys/kernel")
        if not readonly.is_dir():
            pytest.skip("no read-only folder for root on this system")
    else:
        readonly = tmp_path / "readonly"
        readonly.mkdir()
        readonly.chmod(0o555)
    line = one_error_line(train(f"logging.output_dir={readonly}", "trainer.total_steps=1"))
    assert line.startswith(f"error: logging.output_dir={readonly} is not writable (")
    line = one_error_line(train(f"logging.output_dir={readonly / 'run'}", "trainer.total_steps=1"))
    assert line.startswith(f"error: logging.output_dir={readonly / 'run'}: cannot create the folder (")


@pytest.mark.parametrize("kind", ["empty folder", "missing path", "offline hub id"])
def test_unusable_model_path_is_one_line(tmp_path, kind):
    value = {"empty folder": tmp_path / "empty", "missing path": tmp_path / "no" / "such" / "model",
             "offline hub id": "megatron-grpo-tests/no-such-model"}[kind]
    if kind == "empty folder":
        value.mkdir()
    line = one_error_line(train(f"model.path={value}", f"logging.output_dir={tmp_path / 'out'}",
                                "trainer.total_steps=1", env={"HF_HUB_OFFLINE": "1"}))
    expected = {"empty folder": f"error: model.path={value}: the folder is empty; expected an HF model folder",
                # named before anything starts (config/model_paths.py), as every missing local model path
                "missing path": f"error: model.path={value}: no such file or folder (a local path: it starts with /;",
                "offline hub id": f"error: model.path={value}: no such local folder, and the Hugging Face hub could "
                                  f"not provide it (HF_HUB_OFFLINE=1 and it is not in the cache "}[kind]
    assert line.startswith(expected), line


def test_a_training_checkpoint_as_model_path_is_one_line(trained, tmp_path):
    step = trained / "checkpoints" / "step_2"
    line = one_error_line(train(f"model.path={step}", f"logging.output_dir={tmp_path / 'out'}",
                                "trainer.total_steps=1"))
    assert line == (f"error: model.path={step} is a training checkpoint: continue it with checkpoint.resume={step}, "
                    f"or make an HF folder of it with `megatron-grpo export {step} --out HF_DIR`")


def test_prompt_beyond_the_models_context_fails_at_setup(tmp_path):
    start = time.monotonic()
    line = one_error_line(train("data.max_prompt_length=125", f"logging.output_dir={tmp_path / 'out'}",
                                "trainer.total_steps=1"))
    assert line == ("error: data.max_prompt_length + data.max_response_length = 125 + 8 = 133 tokens exceed the "
                    "model's context of 128 (max_position_embeddings of model.override_config)")
    assert not (tmp_path / "out" / "initial_model").exists()  # checked before the model is written
    assert time.monotonic() - start < 60


# ----------------------------------------------------------------------------- initial_model/


def test_initial_model_is_rebuilt_when_what_it_is_built_from_changes(tmp_path):
    """Rank-0 code of prepare_model_folder, without a process group: trainer.seed and
    model.override_config change the initial weights; an unchanged config reuses them."""
    from safetensors.torch import load_file

    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.state.run_folder import INIT_RECORD
    from megatron_grpo.trainer.assembly.initial_model import ensure_initial_model

    def build(folder: Path, *overrides: str) -> dict:
        ensure_initial_model(load_config(str(RECIPE), list(overrides)), folder / "initial_model")
        return load_file(folder / "initial_model" / "model.safetensors")

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

    run = tmp_path / "run"
    seed_1 = build(run)
    written = (run / "initial_model" / "model.safetensors").stat().st_mtime_ns
    assert same(build(run), seed_1)
    assert (run / "initial_model" / "model.safetensors").stat().st_mtime_ns == written  # reused, not rewritten
    seed_2 = build(run, "trainer.seed=2")
    assert not same(seed_2, seed_1) and same(seed_2, build(tmp_path / "fresh", "trainer.seed=2"))
    assert json.loads((run / "initial_model" / INIT_RECORD).read_text())["seed"] == 2
    wider = build(run, "trainer.seed=2", "model.override_config.intermediate_size=64")
    assert wider["model.layers.0.mlp.up_proj.weight"].shape[0] == 64
    (run / "initial_model" / INIT_RECORD).unlink()  # a folder from before the record existed
    assert same(build(run), seed_1)


def test_a_folder_without_a_complete_checkpoint_is_refused_unless_told(tmp_path, caplog):
    """A restart into a folder whose checkpoints all lack complete.json once warned, started from
    step 0 and overwrote that run's metrics and checkpoints. It is another run's folder now: one
    line (exit 2) naming the folder, what it holds and the ways out; checkpoint.resume=force
    starts over it with a warning; resume=never + logging.overwrite moves it aside. In-process:
    the check runs before any model is built."""
    import logging

    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.state.resume_plan import check_definitions
    from megatron_grpo.trainer.state.run_folder import RunFolderError, prepare_output_dir

    def check_run_folder(cfg):  # trainer.setup.check_run_folder, without importing torch for it
        prepare_output_dir(cfg)
        return check_definitions(cfg)

    out = tmp_path / "run"
    step = out / "checkpoints" / "step_40"
    (step / "model_optim").mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 40}')  # a copy cut short: no complete.json
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(out)
    config = lambda *more: load_config(RECIPE, [f"logging.output_dir={out}", *more])  # noqa: E731
    with pytest.raises(RunFolderError) as info:
        check_run_folder(config())
    line = str(info.value)
    assert line.startswith(f"{out} holds an earlier run (checkpoints step_40 in {out / 'checkpoints'} and "
                           f"{out / 'metrics.jsonl'}) but no checkpoint it can continue from (step_40: no "
                           f"complete.json") and "\n" not in line and info.value.exit_code == 2
    assert "checkpoint.resume=force" in line and "checkpoint.resume=never logging.overwrite=true" in line
    assert snapshot(out) == before
    with caplog.at_level(logging.WARNING, logger="megatron_grpo"):
        assert check_run_folder(config("checkpoint.resume=force")) == []
    assert "checkpoint.resume=force: " in caplog.text and "starting from step 0" in caplog.text
    assert check_run_folder(config("checkpoint.resume=never", "logging.overwrite=true")) == []
    assert snapshot(tmp_path / "run.old-1") == before


# ----------------------------------------------------------------------------- one run at a time

HOLDER = """
import sys, time
from pathlib import Path
from megatron_grpo.trainer.state.run_lock import lock_folder
lock = lock_folder("logging.output_dir", Path(sys.argv[1]))
print("held", flush=True)
time.sleep(300)
"""


def hold_in_another_process(folder: Path) -> subprocess.Popen:
    """A process that holds `folder`'s run lock until killed (as rank 0 of a training run does)."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_held_run_folder_is_refused_naming_its_holder_and_free_once_the_holder_is_killed(tmp_path):
    """Two runs into one folder interleaved their metrics.jsonl rows and overwrote each other's
    run.json and checkpoints. The folder's lock names its holder to a second start (one line,
    exit 2), and the kernel drops it when the holder dies, kill -9 included: an in-job restart
    is never refused by its own dead life."""
    import signal
    import socket

    from megatron_grpo.trainer.state.run_lock import LOCK_FILE, RunFolderBusy, lock_folder

    out = tmp_path / "run"
    holder = hold_in_another_process(out)
    try:
        with pytest.raises(RunFolderBusy) as info:
            lock_folder("logging.output_dir", out)
        line = str(info.value)
        assert line.startswith(f"logging.output_dir={out} is in use by another run (pid {holder.pid} on host "
                               f"{socket.gethostname()}, started {time.strftime('%Y-%m-%d')}")
        assert f"its lock {out / LOCK_FILE}" in line and "\n" not in line and info.value.exit_code == 2
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = lock_folder("logging.output_dir", out)  # the dead holder's lock is gone with it
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (out / LOCK_FILE).read_text() == ""  # a later holder never shows this one's details


def test_a_second_training_run_into_a_held_folder_stops_before_writing_there(tmp_path):
    """The trainer's start path takes the lock: a second `megatron-grpo train` into a folder a live
    run holds stops with one line naming that run, exit 2, and writes nothing into the folder."""
    import signal

    out = tmp_path / "run"
    holder = hold_in_another_process(out)
    before = snapshot(out)
    try:
        line = one_error_line(train(f"logging.output_dir={out}", "trainer.total_steps=1"))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert line.startswith(f"error: logging.output_dir={out} is in use by another run (pid {holder.pid} on host ")
    assert snapshot(out) == before
