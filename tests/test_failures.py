"""Failure handling, each reproduced with its message checked: data errors before any model is
built (exit 2), NaN / Inf updates skipped and counted then a stop, a full disk or unwritable folder
during a save (previous checkpoint intact), and SIGKILL at random moments (including during
saves): every restart resumes from the newest complete checkpoint and ends where an uninterrupted
run ends."""
import dataclasses
import errno
import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "rollout.n=4", "logging.console=false", "logging.plot=false"]


def _records(out_dir):
    with open(Path(out_dir) / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


# ----------------------------------------------------------------------------- data errors


def test_data_error_exits_2_before_any_model_is_built(tmp_path):
    from megatron_grpo.data.synthetic import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": [{"role": "user", "content": "1 2 3"}]}\n')  # no data_source
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", "data.task=null", f"data.train_files=[{bad}]",
         f"model.tokenizer_path={tokenizer}", "eval.interval=-1", f"logging.output_dir={tmp_path / 'out'}", *FAST],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: {bad}:1: 'data_source' must be a non-empty string" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Setting up optimizer" not in proc.stderr  # no megatron model / optimizer was built


def test_environment_error_exits_2_before_any_model_is_built(tmp_path):
    """A multi-turn environment that cannot load (here: a SyntaxError in its module) is a config
    error found at setup, not at the first rollout (where it exited 1 after the model was built)."""
    (tmp_path / "broken_env.py").write_text("def oops(:\n")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_grpo.train", "tiny_cpu_tool", "rollout.multi_turn.environment=broken_env:Env",
         "eval.interval=-1", f"logging.output_dir={tmp_path / 'out'}", *FAST],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)])))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("error: rollout.multi_turn.environment='broken_env:Env': cannot import module 'broken_env': "
            "SyntaxError: invalid syntax") in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "Setting up optimizer" not in proc.stderr  # no megatron model / optimizer was built


# ----------------------------------------------------------------------------- NaN / Inf updates


def _train_with_poisoned_steps(rank, world_size, overrides, poisoned_steps):
    """train() where the loss of the given steps is multiplied by NaN; returns the error text."""
    from megatron_grpo.config import load_config
    from megatron_grpo.errors import MegatronGRPOError
    from megatron_grpo.models.builder import unwrap
    from megatron_grpo.trainer import loop
    from megatron_grpo.trainer.step import train_step

    state = {"step": 0}
    grpo_step, compute_loss, build_run = loop.grpo_step, train_step.compute_grpo_loss, loop.build_run

    def tracking_step(run, step, pipeline=None, **kwargs):
        state["step"] = step
        return grpo_step(run, step, pipeline, **kwargs)

    def poisoned_loss(*args, **kwargs):
        output = compute_loss(*args, **kwargs)
        if state["step"] in poisoned_steps:
            output = dataclasses.replace(output, loss=output.loss * float("nan"))
        return output

    def capture_run(cfg):
        state["run"] = build_run(cfg)
        return state["run"]

    loop.grpo_step, train_step.compute_grpo_loss, loop.build_run = tracking_step, poisoned_loss, capture_run
    try:
        loop.train(load_config("tiny_cpu", overrides))
        error = None
    except MegatronGRPOError as exc:
        error = str(exc)
    params = [p.detach() for p in unwrap(state["run"].policy[0]).parameters()]
    return {"error": error, "finite": all(bool(torch.isfinite(p).all()) for p in params)}


def test_nan_updates_are_skipped_counted_and_stop_the_run(tmp_path):
    overrides = [*FAST, "trainer.total_steps=6", "trainer.max_consecutive_nan_steps=2",
                 f"logging.output_dir={tmp_path}"]
    result = run_distributed(_train_with_poisoned_steps, 1, (overrides, {2, 4, 5}), timeout=300)[0]
    assert result["error"] == (
        "stopping: 2 updates in a row had a non-finite gradient (grad norm nan) and were skipped "
        "(trainer.max_consecutive_nan_steps=2); check the rewards and data, or lower actor.optim.lr; "
        "resume from the last checkpoint after fixing it")
    assert result["finite"]  # no NaN reached the weights
    records = {r["step"]: r for r in _records(tmp_path)}
    assert sorted(records) == [1, 2, 3, 4]  # step 5's second skip stopped the run
    assert [records[s]["actor/updates_skipped"] for s in (1, 2, 3, 4)] == [0, 1, 0, 1]


# ----------------------------------------------------------------------------- save failures


def _train_with_failing_save(rank, world_size, overrides, fail_at_step, error=errno.ENOSPC, where="trainer_state"):
    """Saves every step; writing checkpoint `fail_at_step` raises OSError(error) (default ENOSPC:
    disk full): in our trainer_state.json, or (where="shards") in megatron's checkpoint writer
    process, whose error reaches the trainer wrapped by megatron and torch DCP."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_grpo.config import load_config
    from megatron_grpo.errors import CheckpointError
    from megatron_grpo.checkpointing import layout
    from megatron_grpo.trainer import loop

    write_file, write_item = layout.write_file, filesystem_async._write_item

    def full_disk(path, data):
        if f"step_{fail_at_step}" in str(path) and path.name == "trainer_state.json":
            raise OSError(error, os.strerror(error), str(path))
        return write_file(path, data)

    @functools.wraps(write_item)  # megatron reads its signature
    def full_disk_in_writer(*args, **kwargs):  # megatron's forked writer: (transforms..., stream, data, item, key)
        stream = next(a for a in args if isinstance(getattr(a, "name", None), str))
        if f".tmp-step_{fail_at_step}" in stream.name:
            raise OSError(error, os.strerror(error), stream.name)
        return write_item(*args, **kwargs)

    if where == "shards":
        filesystem_async._write_item = full_disk_in_writer
    else:
        layout.write_file = full_disk
    try:
        loop.train(load_config("tiny_cpu", overrides))
    except CheckpointError as exc:
        return str(exc)
    return None


def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path):
    """The device fills up while megatron's writer process writes the model shards: the error
    reached us as torch DCP's CheckpointException around megatron's "Worker failure: [Errno 28]
    ..." text (the OSError itself stays in the writer process), and the message was that
    exception's multi-line traceback dump. It is one line naming the folder and the full device."""
    from megatron_grpo.checkpointing.layout import validate_checkpoint

    root = tmp_path / "ckpt"
    overrides = [*FAST, "trainer.total_steps=3", "checkpoint.save_interval=1", f"checkpoint.save_dir={root}",
                 f"logging.output_dir={tmp_path}"]
    message = run_distributed(_train_with_failing_save, 1, (overrides, 2, errno.ENOSPC, "shards"), timeout=300)[0]
    # megatron's writer runs two workers; whichever hits the full device first is named (__0_0 or __0_1)
    assert re.fullmatch(re.escape(f"saving checkpoint step 2 to {root} failed: no space left on the device ([Errno "
                                  f"28] No space left on device: '{root}/.tmp-step_2/model_optim/__0_") + r"[01]"
                        + re.escape(f".distcp'); the previous checkpoint {root}/step_1 is intact"), message), message
    assert sorted(p.name for p in root.iterdir()) == [".run.lock", "latest", "step_1"]  # the partial save is gone
    assert (root / "latest").read_text().strip() == "step_1"
    assert validate_checkpoint(root / "step_1") is None


def test_full_disk_under_the_output_folder_is_one_line_exit_1(tmp_path):
    """metrics.jsonl on a full device (/dev/full answers every write with ENOSPC): one line naming
    the file, exit 1 (a runtime failure), no traceback."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", "trainer.total_steps=1",
                           "eval.interval=-1", f"logging.output_dir={out}", *FAST], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"error: no space left on the device writing {out}/metrics.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unwritable_save_folder_is_a_clear_error(tmp_path):
    """A save folder that stops being writable during the run (permissions, a remount)."""
    root = tmp_path / "ckpt"
    overrides = [*FAST, "trainer.total_steps=1", "checkpoint.save_interval=1", f"checkpoint.save_dir={root}",
                 f"logging.output_dir={tmp_path}"]
    message = run_distributed(_train_with_failing_save, 1, (overrides, 1, errno.EACCES), timeout=300)[0]
    assert message.startswith(f"saving checkpoint step 1 to {root} failed: folder not writable ([Errno 13]")
    assert message.endswith("no earlier checkpoint exists")


def test_save_folder_under_a_file_is_refused_before_training(tmp_path):
    from megatron_grpo.testing.distributed import DistributedChildError

    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the checkpoint folder should be")
    overrides = [*FAST, "trainer.total_steps=1", "checkpoint.save_interval=1",
                 f"checkpoint.save_dir={blocker / 'ckpt'}", f"logging.output_dir={tmp_path}"]
    with pytest.raises(DistributedChildError) as info:
        run_distributed(_train_with_failing_save, 1, (overrides, 99), timeout=300)
    assert (f"RunFolderError: checkpoint.save_dir={blocker / 'ckpt'} is under {blocker}, which is a file, not a "
            f"folder") in str(info.value)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before the first step


# ----------------------------------------------------------------------------- SIGKILL crash test


def _crash_trial(log_path, overrides):
    """One trainer life in its own process group (so its checkpoint writer processes die with it)."""
    import logging

    os.setpgrp()
    logging.basicConfig(filename=log_path, level=logging.INFO, force=True)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # one process, no launcher: it binds its own rendezvous port (port 0)
    torch.set_num_threads(1)
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.loop import train

    train(load_config("tiny_cpu", overrides))


def _newest_complete(root: Path):
    from megatron_grpo.checkpointing.layout import list_checkpoints, validate_checkpoint

    for step, path in list_checkpoints(root):
        if validate_checkpoint(path) is None:
            return step
    return None


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes_from_newest_complete(tmp_path):
    from megatron_grpo.testing.distributed import _get_context

    ctx = _get_context()  # forkserver with torch + megatron imported: a trial starts in ~1 s
    rng = random.Random(8)
    total_steps = 20
    root = tmp_path / "ckpt"
    overrides = [*FAST, f"trainer.total_steps={total_steps}", "checkpoint.save_interval=1", "checkpoint.keep_last=2",
                 f"checkpoint.save_dir={root}", f"logging.output_dir={tmp_path / 'out'}"]
    trials, killed_during_save, resumed_from = 0, 0, []
    restored = re.compile(r"checkpoint: (resumed from|no complete checkpoint)")
    while trials < 6:
        expected = _newest_complete(root)
        log_path = tmp_path / f"trial{trials}.log"
        proc = ctx.Process(target=_crash_trial, args=(str(log_path), overrides))
        started = time.time()
        proc.start()
        # The random moment counts from the restore, not from the start: how long startup takes
        # depends on the machine's load, and a life killed before it restored tests nothing.
        while not (log_path.exists() and restored.search(log_path.read_text())):
            assert proc.is_alive(), f"trial {trials}: exited with {proc.exitcode} before restoring"
            assert time.time() - started < 300, f"trial {trials}: no restore within 300 s"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 5.0))
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its checkpoint writer processes
        except ProcessLookupError:  # killed before it made its own process group
            proc.kill()
        proc.join(30)
        assert not proc.is_alive()
        # a save this life had begun and not finished: the next life must not load it
        saving = root.is_dir() and any(p.name.startswith(".tmp-") and p.stat().st_mtime >= started
                                       for p in root.iterdir())
        text = log_path.read_text()
        trials += 1
        killed_during_save += saving
        match = re.search(r"resumed from (\S+) \(step (\d+)\)", text)
        got = int(match.group(2)) if match else None
        assert got == expected, f"trial {trials}: resumed from {got}, newest complete was {expected}\n{text[-2000:]}"
        if match:
            assert Path(match.group(1)).name == f"step_{expected}"
        resumed_from.append(got)
        assert "Traceback" not in text, text[-3000:]
    # A last life runs to the end; it must match an uninterrupted run step for step.
    final_log = tmp_path / "final.log"
    proc = ctx.Process(target=_crash_trial, args=(str(final_log), overrides))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0, final_log.read_text()[-3000:]
    reference = tmp_path / "reference"
    proc = ctx.Process(target=_crash_trial, args=(str(tmp_path / "ref.log"), [
        *FAST, f"trainer.total_steps={total_steps}", f"logging.output_dir={reference}"]))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0
    crashed = {r["step"]: r for r in _records(tmp_path / "out")}
    uninterrupted = {r["step"]: r for r in _records(reference)}
    assert sorted(crashed) == list(range(1, total_steps + 1))
    for step, record in uninterrupted.items():
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/lr"):
            assert crashed[step][key] == record[key], (step, key)
    print(f"\ncrash test: {trials} kills, {killed_during_save} during a save; resumed from {resumed_from}")
    assert killed_during_save >= 1  # the seed and delays were chosen so that some kills hit a save
