"""Checkpoint / resume: exactness (uninterrupted vs stop + resume), the atomic layout, skipping of
incomplete / corrupt checkpoints, and weights_only loading. Resuming on other layouts (TP / PP /
DP): tests/test_resume_layouts.py."""
import io
import json
import logging
import os
import pickle
import signal
from pathlib import Path

import pytest
import torch

from megatron_grpo.errors import CheckpointError
from megatron_grpo.testing.distributed import run_distributed

FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "rollout.n=4", "logging.console=false", "logging.plot=false", "trainer.total_steps=4"]
TIMING = ("time/", "perf/")


def _comparable(record):
    return {k: v for k, v in record.items() if k != "time" and not k.startswith(TIMING)}


def _metrics(out_dir):
    """metrics.jsonl records by step (a resumed run appends; the last record of a step wins)."""
    by_step = {}
    with open(Path(out_dir) / "metrics.jsonl") as handle:
        for line in handle:
            record = json.loads(line)
            by_step[record["step"]] = _comparable(record)
    return by_step


def _train(rank, world_size, overrides, signal_at_step=None, signal_rank=0, sig=signal.SIGUSR1):
    """train() in this process; returns the policy and engine weights it ended with. With
    signal_at_step, `sig` (SIGUSR1) is sent to this process (on signal_rank) right after that step."""
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.models.builder import unwrap
    from megatron_grpo.trainer import loop

    captured = {}
    build_run, grpo_step = loop.build_run, loop.grpo_step

    def capture_run(cfg):
        captured["run"] = build_run(cfg)
        return captured["run"]

    def step_then_signal(run, step, pipeline=None, **kwargs):
        metrics = grpo_step(run, step, pipeline, **kwargs)
        if step == signal_at_step and rank == signal_rank:
            os.kill(os.getpid(), sig)
        return metrics

    class CapturingCheckpointer(loop.Checkpointer):
        def restore(self):
            restored = super().restore()
            captured["at_resume"] = {n: p.detach().clone() for n, p in unwrap(self.run.policy[0]).named_parameters()}
            return restored

    loop.build_run, loop.grpo_step, loop.Checkpointer = capture_run, step_then_signal, CapturingCheckpointer
    cfg = load_config("tiny_cpu", overrides)
    validate(cfg, world_size=world_size)
    loop.train(cfg)
    run = captured["run"]
    params = {name: p.detach().clone() for name, p in unwrap(run.policy[0]).named_parameters()}
    engine = {k: v.detach().clone() for k, v in run.engine.model.state_dict().items()} if run.is_main else None
    return {"params": params, "engine": engine, "at_resume": captured["at_resume"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run_distributed(_train, 1, ([*FAST, f"logging.output_dir={out}"],), timeout=300)[0]
    return {**result, "metrics": _metrics(out)}


def test_stop_signal_then_resume_is_bitwise_exact(tmp_path, uninterrupted):
    args = [*FAST, f"logging.output_dir={tmp_path}"]
    first = run_distributed(_train, 1, (args, 2), timeout=300)[0]
    root = tmp_path / "checkpoints"
    # SIGUSR1 after step 2: a checkpoint, then a clean stop (save_interval is off in the recipe).
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]
    assert (root / "latest").read_text().strip() == "step_2"
    assert max(_metrics(tmp_path)) == 2
    assert not torch.equal(first["params"]["embedding.word_embeddings.weight"],
                           uninterrupted["params"]["embedding.word_embeddings.weight"])

    second = run_distributed(_train, 1, (args,), timeout=300)[0]
    resumed = _metrics(tmp_path)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert resumed[step] == uninterrupted["metrics"][step], step
    for name, value in uninterrupted["params"].items():
        assert torch.equal(second["params"][name], value), name
    # The rollout engine got the restored weights (step 3's rollout matches), and ends identical.
    for name, value in uninterrupted["engine"].items():
        assert torch.equal(second["engine"][name], value), name
    state = json.loads((root / "step_2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["sampler"]["batch_in_epoch"] == 2 and state["engine_weight_version"] == 2


def _terminal_signals(rank, world_size, stderr_path):
    """StopSignals as a terminal meets them, in a child: a SIGHUP that `nohup` ignores stays ignored;
    SIGHUP and the first SIGINT set the stop flag (the first also says so); a second SIGINT ends the
    process at once (the caller sees exit code -SIGINT)."""
    from megatron_grpo.trainer.signals import StopSignals

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts us
    ignored = StopSignals().install()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == ignored._handle
    ignored.uninstall()
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    hangup = StopSignals().install()
    os.kill(os.getpid(), signal.SIGHUP)  # the handler runs here, in this (main) thread
    assert hangup.requested() and hangup.name == "SIGHUP"
    hangup.uninstall()
    with open(stderr_path, "wb") as handle:
        os.dup2(handle.fileno(), 2)
    stop = StopSignals().install()
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested() and stop.name == "SIGINT" and signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    assert "SIGINT: stopping after the step in progress, with a checkpoint; Ctrl-C again aborts at once" in \
        Path(stderr_path).read_text()
    os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C: gone, without reaching the next line
    return "survived a second SIGINT"


def test_first_ctrl_c_saves_and_stops_like_sigterm(tmp_path):
    """Ctrl-C once exited 130 with a traceback and saved nothing (with the default save_interval=-1,
    the whole run). The first SIGINT now stops the run after the step in progress with a checkpoint,
    exit 0, as SIGTERM does (the loop, its message and the all-reduce are SIGTERM's)."""
    args = [*FAST, "trainer.total_steps=3", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2",
            "data.max_response_length=2", f"logging.output_dir={tmp_path}"]
    run_distributed(_train, 1, (args, 1, 0, signal.SIGINT), timeout=300)  # SIGINT right after step 1
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"] and max(_metrics(tmp_path)) == 1


def test_sighup_stops_too_and_a_second_ctrl_c_aborts_at_once(tmp_path):
    """SIGHUP (the terminal closed) exited 129 in silence: it sets the same stop flag now (unless the
    trainer was started under nohup); the first SIGINT says what happens next, and a second one ends
    the process at once, by SIGINT, without a checkpoint."""
    from megatron_grpo.testing.distributed import DistributedChildError

    with pytest.raises(DistributedChildError, match=f"exited with code {-signal.SIGINT} before reporting"):
        run_distributed(_terminal_signals, 1, (str(tmp_path / "stderr"),), init_group=False, timeout=60)


def _second_ctrl_c_inside_a_collective(rank, world_size, second, stderr_path):
    """Rank 0 waits in a broadcast that rank 1 never joins (as the ranks wait for one another in
    every step); Ctrl-C reaches it there, then `second`: SIGINT (Ctrl-C again) or SIGTERM
    (torchrun's answer to a second Ctrl-C, its ranks being in sessions of their own)."""
    import threading
    import time

    import torch.distributed as dist

    from megatron_grpo.trainer.signals import StopSignals

    StopSignals().install()
    if rank == 1:
        time.sleep(60)  # never joins
        return "rank 1 waited"
    with open(stderr_path, "wb") as handle:
        os.dup2(handle.fileno(), 2)

    def ctrl_c_twice():
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        os.kill(os.getpid(), second)

    threading.Thread(target=ctrl_c_twice, daemon=True).start()
    dist.broadcast(torch.zeros(1), src=1)  # the main thread waits in gloo, where Python runs no handler
    return "the broadcast returned"


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_ctrl_c_ends_a_rank_waiting_inside_a_collective(tmp_path, second):
    """Two Ctrl-C under torchrun left the ranks running until torchrun's SIGKILL 30 s later: a rank
    waiting inside a gloo collective runs no Python signal handler, so the first SIGINT had not
    given SIGINT its default action yet, and torchrun turns the second Ctrl-C into SIGTERM, which
    only set the stop flag again. Now the second one (SIGINT, or SIGTERM after SIGINT) ends the
    rank at once, exit 130, with one line on rank 0."""
    import time

    from megatron_grpo.testing.distributed import DistributedChildError

    stderr = tmp_path / "stderr"
    start = time.monotonic()
    with pytest.raises(DistributedChildError, match="exited with code 130 before reporting"):
        run_distributed(_second_ctrl_c_inside_a_collective, 2, (second, str(stderr)), timeout=30)
    assert time.monotonic() - start < 20
    why = "SIGINT again" if second == signal.SIGINT else "SIGTERM after SIGINT (torchrun's answer to a second Ctrl-C)"
    assert stderr.read_text() == f"megatron-grpo: {why}: aborting at once, without a checkpoint\n"


def _console_gone(rank, world_size, out_dir, how):
    """The trainer's console writes (metrics logger with its progress bar, the loop's closing
    lines) as `megatron-grpo train ... 2>log` meets a console that goes away: stderr goes to a
    file; stdout is a terminal (a pty made here) that closes, the kernel hanging it up, then
    SIGHUP arrives (how="hangup"); or a pipe whose reader exits (how="pipe": `| tee` closed).
    Returns the steps in metrics.jsonl and what the stop flag says."""
    import sys

    from megatron_grpo.trainer.metrics import MetricsLogger, SinkOptions
    from megatron_grpo.trainer.signals import StopSignals

    out = Path(out_dir)
    if how == "hangup":
        reader, console = os.openpty()
    else:
        reader, console = os.pipe()
    os.dup2(console, 1)
    os.close(console)
    sys.stdout.reconfigure(line_buffering=True)  # as Python sets it up on a terminal
    with open(out / "stderr", "wb") as handle:
        os.dup2(handle.fileno(), 2)
    stop = StopSignals().install()
    logger = MetricsLogger(SinkOptions(output_dir=str(out), console=True), total_steps=3)
    logger.log(1, {"reward/mean": 0.25})
    logger.message("eval after step 1")
    os.close(reader)  # the terminal window closes / tee exits
    if how == "hangup":
        os.kill(os.getpid(), signal.SIGHUP)
    stopping = stop.requested()
    logger.log(2, {"reward/mean": 0.5})
    logger.message("stopped by SIGHUP after step 2; checkpoint step_2")
    logger.close()
    print("done: metrics in metrics.jsonl", flush=True)  # main's last line
    stop.uninstall()
    return [json.loads(line)["step"] for line in open(out / "metrics.jsonl")], stopping


@pytest.mark.parametrize("how", ["hangup", "pipe"])
def test_a_console_that_goes_away_does_not_fail_the_run(tmp_path, how):
    """A closed terminal (SIGHUP) with stderr to a file saved the checkpoint, then the loop's
    "stopped by SIGHUP" line raised EIO and the run exited 1: a hung-up terminal no longer says it
    is one, so SIGHUP's detaching of the terminal missed it. stdout / stderr that were a terminal
    or are gone now write to /dev/null after SIGHUP, and a console write that fails with EIO /
    EPIPE (a pipe's reader exited; no signal) detaches the console instead of failing the run."""
    steps, stopping = run_distributed(_console_gone, 1, (str(tmp_path), how), init_group=False, timeout=60)[0]
    assert steps == [1, 2] and stopping == (how == "hangup")
    assert "Traceback" not in (tmp_path / "stderr").read_text()


# ----------------------------------------------------------------------------- layout / skipping


def _fake_checkpoint(root: Path, step: int, marker: bool = True) -> Path:
    from megatron_grpo.checkpointing.layout import COMPLETE_MARKER

    path = root / f"step_{step}"
    (path / "model_optim").mkdir(parents=True)
    (path / "model_optim" / "__0_0.distcp").write_bytes(b"x" * 100)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    if marker:
        files = {"model_optim/__0_0.distcp": 100, "trainer_state.json": len(json.dumps({"step": step}))}
        (path / COMPLETE_MARKER).write_text(json.dumps({"format": 1, "step": step, "files": files}))
    return path


class _Cfg:
    def __init__(self, root, resume="auto"):
        from types import SimpleNamespace

        self.checkpoint = SimpleNamespace(save_dir=str(root), resume=resume)
        self.logging = SimpleNamespace(output_dir=str(root))


def test_auto_resume_skips_incomplete_and_corrupt_with_warnings(tmp_path, caplog):
    from megatron_grpo.checkpointing.layout import complete_checkpoints

    _fake_checkpoint(tmp_path, 1)
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 3, marker=False)                               # crashed before the marker
    (_fake_checkpoint(tmp_path, 4) / "model_optim" / "__0_0.distcp").write_bytes(b"x" * 10)  # truncated
    (_fake_checkpoint(tmp_path, 5) / "complete.json").write_text("{not json")  # corrupt marker
    (tmp_path / ".tmp-step_6").mkdir()                                         # interrupted save
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.checkpointing.layout"):
        found = complete_checkpoints(_Cfg(tmp_path))
    assert [f.step for f in found] == [2, 1]
    text = caplog.text
    assert "step_5: complete.json is unreadable" in text
    assert "step_4: model_optim/__0_0.distcp has 10 bytes, 100 were written" in text
    assert "step_3: no complete.json (the save did not finish)" in text
    assert ".tmp-step_6 (an interrupted save" in text


def test_explicit_resume_path_must_be_complete(tmp_path):
    from megatron_grpo.checkpointing.layout import complete_checkpoints

    path = _fake_checkpoint(tmp_path, 3, marker=False)
    with pytest.raises(CheckpointError, match="step_3: not a complete checkpoint: no complete.json"):
        complete_checkpoints(_Cfg(tmp_path, resume=str(path)))
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        complete_checkpoints(_Cfg(tmp_path, resume=str(tmp_path / "missing")))
    assert complete_checkpoints(_Cfg(tmp_path, resume="never")) == []


def test_latest_pointer_is_replaced_atomically(tmp_path):
    from megatron_grpo.checkpointing.layout import write_atomic

    write_atomic(tmp_path / "latest", b"step_1\n")
    write_atomic(tmp_path / "latest", b"step_2\n")
    assert (tmp_path / "latest").read_text() == "step_2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temp file left


def test_a_full_device_is_named_through_megatron_and_torch_dcp_wrapping():
    """A save that filled the device inside megatron's writer process reported torch DCP's
    CheckpointException: its str is every failing rank's traceback, and the OSError itself never
    reaches the trainer (megatron re-raises it as "Worker failure: [Errno 28] ...", and DCP's
    gather pickles that, dropping its __cause__). The reason is one line naming the full device,
    found through the wrapping, with or without the cause; other failures stay one line."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from megatron_grpo.trainer.state.checkpoint import save_failure_reason

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/.tmp-step_2/model_optim/__0_0.distcp")
    try:  # megatron's FileSystemWriterAsync.retrieve_write_results
        raise RuntimeError(f"Worker failure: {full}") from full
    except RuntimeError as exc:
        wrapped = _wrap_exception(exc)
    expected = f"no space left on the device ({full})"
    gathered = pickle.loads(pickle.dumps(wrapped))  # as DCP's gather sends it: the cause is gone
    assert gathered[0].__cause__ is None
    assert save_failure_reason(CheckpointException("write", {0: gathered})) == expected
    assert save_failure_reason(CheckpointException("write", {1: wrapped})) == expected
    assert save_failure_reason(full) == expected
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/ckpt/.tmp-step_2/trainer_state.json")
    try:
        raise ValueError("save failed") from quota
    except ValueError as exc:
        assert save_failure_reason(exc) == f"no space left on the device ({quota})"
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), "/ckpt")
    assert save_failure_reason(denied) == f"folder not writable ({denied})"
    try:
        raise KeyError("model.decoder")
    except KeyError as exc:
        other = CheckpointException("write", {0: _wrap_exception(exc)})
    assert save_failure_reason(other) == "rank 0: KeyError: 'model.decoder'"


# ----------------------------------------------------------------------------- security


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_rng_files_load_weights_only(tmp_path):
    """A checkpoint file carrying an arbitrary pickle is refused, not executed."""
    bad = tmp_path / "rng.pt"
    torch.save({"torch": torch.get_rng_state(), "payload": _Evil()}, bad)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(bad, weights_only=True)


def test_megatron_byte_objects_load_weights_only():
    """torch DCP unpickles non-tensor entries with weights_only=False; we switch that off."""
    from torch.distributed.checkpoint import default_planner

    from megatron_grpo.launch.safe_dcp import dcp_bytes_weights_only

    buffer = io.BytesIO()
    torch.save(_Evil(), buffer)
    planner = default_planner.DefaultLoadPlanner()
    planner.flatten_state_dict = False
    planner.state_dict = {}

    class Item:
        class dest_index:
            fqn = "x"

    with dcp_bytes_weights_only():
        buffer.seek(0)
        with pytest.raises(pickle.UnpicklingError):
            planner.load_bytes(Item, buffer)
        buffer = io.BytesIO()
        torch.save({"step": 3, "groups": [1, 2]}, buffer)
        buffer.seek(0)
        planner.load_bytes(Item, buffer)
    assert planner.state_dict["x"] == {"step": 3, "groups": [1, 2]}
    assert default_planner.DefaultLoadPlanner.load_bytes.__module__ == "torch.distributed.checkpoint.default_planner"
