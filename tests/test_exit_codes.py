"""Every run ends with its own exit code, never SIGABRT (134, "terminate called without an active
exception").

The abort: a gloo worker thread releases a finished collective's tensors a moment after the
caller's wait() returned; that release takes the GIL, and once the interpreter has begun finalizing
Python ends the thread, whose unwinding through gloo's noexcept destructor calls std::terminate
(or, when it had the GIL and lost it, a fatal "GIL is released" error): SIGABRT either way.

First the race made certain: a collective, on a group something still references (so destroying
the groups does not join its workers, as with megatron-core's), whose tensor only the worker still
holds and whose release is slow, while finalization takes long: the exit must wait for the
release, on both exit paths (sys.exit, and launch.distributed.shutdown() as the trainer calls
it). The first test is the proof: it makes the race certain, so it fails on every run of a build
that exits without waiting. Then the real thing, whose timing depends on the machine (seen in 1 run
in 4 to 1 in 15 on a loaded 2-core machine, and in none of 60 on another day), twice back to back
each, as short as a run can be: one step of 2 rollouts x 2 tokens under torchrun (2 ranks, exit 0),
and a one-line data error (exit 2). These are smoke checks that the trainer's exit path is the
waiting one (8 runs each cost ~6 minutes of CI and added nothing the proof does not show); the
mpirun runs of tests/test_mpi.py check exit 0 and the abort message too.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNS = 2
SHORT = ["trainer.total_steps=1", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2",
         "data.max_response_length=2", "eval.interval=-1", "logging.console=false", "logging.plot=false"]
ABORT = "terminate called without an active exception"



def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI", "PMIX_", "TORCHELASTIC_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run_many(make_cmd, expected: int, tmp_path: Path, check=None) -> None:
    codes, aborted = Counter(), []
    for i in range(RUNS):
        result = subprocess.run(make_cmd(tmp_path / f"run{i}"), cwd=REPO, env=_clean_env(), capture_output=True,
                                text=True, timeout=300)
        output = result.stdout + result.stderr
        codes[result.returncode] += 1
        if result.returncode != expected or ABORT in output:
            aborted.append(f"run {i}: exit {result.returncode}\n{output[-2500:]}")
        elif check is not None:
            check(i, output)
    assert not aborted, f"exit codes {dict(codes)} (expected {expected} x {RUNS}); first bad run:\n{aborted[0]}"


SLOW_RELEASE = textwrap.dedent("""
    import sys, time
    import torch
    import torch.distributed as dist
    import megatron.core.parallel_state  # imported, as in the trainer (shutdown() uses it)
    from megatron_grpo.launch.distributed import init_distributed, shutdown

    class SlowToFree(torch.Tensor):
        def __del__(self):  # runs in the gloo worker thread; the sleep gives up the GIL
            time.sleep(0.5)

    class SlowFinalization:
        def __del__(self):  # runs when finalization clears this module
            time.sleep(2.0)

    init_distributed()  # one process, gloo
    group = dist.new_group([0])  # kept referenced, as megatron-core's modules keep theirs: never joined
    work = dist.broadcast(torch.zeros(4).as_subclass(SlowToFree), src=0, group=group, async_op=True)
    del work  # from here on only the worker holds the work and its tensor
    finalizer = SlowFinalization()
    if sys.argv[1] == "shutdown":
        shutdown()
    sys.exit(2)
""")


@pytest.mark.parametrize("exit_path", ["sys.exit", "shutdown"])
def test_exit_waits_for_a_gloo_worker_still_releasing_a_collective(tmp_path, exit_path):
    script = tmp_path / "slow_release.py"
    script.write_text(SLOW_RELEASE)
    result = subprocess.run([sys.executable, str(script), exit_path], cwd=REPO,
                            env={**_clean_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, f"exit {result.returncode}:\n{result.stderr[-3000:]}"


def _metrics_written(out: Path) -> None:
    assert (out / "metrics.jsonl").read_text().count("\n") == 1


@pytest.mark.slow
def test_torchrun_runs_exit_0(tmp_path):
    def cmd(out):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "megatron_grpo.train", "tiny_cpu", *SHORT, f"logging.output_dir={out}"]

    _run_many(cmd, 0, tmp_path, check=lambda i, _: _metrics_written(tmp_path / f"run{i}"))


@pytest.mark.slow
def test_one_line_data_errors_exit_2(tmp_path):
    from megatron_grpo.data.synthetic import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": [{"role": "user", "content": "1 2 3"}]}\n')  # no data_source

    def cmd(out):
        return [sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", "data.task=null", f"data.train_files=[{bad}]",
                f"model.tokenizer_path={tokenizer}", *SHORT, f"logging.output_dir={out}"]

    def one_line(i, output):
        assert f"error: {bad}:1: 'data_source' must be a non-empty string" in output, output[-2000:]
        assert "Traceback" not in output

    _run_many(cmd, 2, tmp_path, check=one_line)
