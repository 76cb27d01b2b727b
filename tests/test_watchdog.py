"""The hang watchdog (launch/watchdog.py) and the restart decision (launch/restarts.py).

The watchdog's own processes (no torch, ~1 s each): a rank whose main thread stops making progress
dumps its stacks, names itself and its phase, exits 3; a SIGSTOPped rank, which can say nothing, is
named by the other one from its silent heartbeat. Then the real trainer under torchrun, 2 gloo ranks:
rank 1 SIGSTOPped during the steps; rank 0 names it and its phase within trainer.hang_timeout_s (its
gloo collective times out first, at 0.9 x, and is reported the same way) and exits 3."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from megatron_grpo.launch import restarts
from megatron_grpo.launch.watchdog import PeerView, is_collective_timeout, stuck_ranks

REPO = Path(__file__).resolve().parents[1]

RANK_SCRIPT = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from megatron_grpo.launch.watchdog import HangWatchdog
    run, rank, world, timeout = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    dog = HangWatchdog(run / "heartbeats/life", run / "hangs/life", rank, world, timeout, poll_s=0.2).start()
    dog.phase("train", 4, "mini-batch 1/1, micro-batch 2/3")
    print("ready", flush=True)
    while True:  # a step that makes no progress (rank 1 of the two-rank test is stopped instead)
        time.sleep(0.05)
        if rank == 0 and world == 2:
            dog.phase("train", 4, "mini-batch 1/1, micro-batch 2/3")  # keeps progressing
''')


def _rank(run: Path, rank: int, world: int, timeout: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(run), str(rank), str(world), str(timeout)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_rank_without_progress_dumps_its_stacks_names_itself_and_exits_3(tmp_path):
    start = time.monotonic()
    proc = _rank(tmp_path, 0, 1, timeout=2.0)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err
    assert time.monotonic() - start < 2.0 + 3.0
    summary = [line for line in err.splitlines() if line.startswith("error: hang:")]
    assert len(summary) == 1, err
    assert "rank 0 (" in summary[0] and "in train (step 4, mini-batch 1/1, micro-batch 2/3), no progress for 2 s" \
        in summary[0], summary[0]
    stacks = (tmp_path / "hangs/life/rank-0.txt").read_text()
    assert 'File "<string>"' in stacks and "watchdog.py" in stacks, stacks  # the stuck main thread, and ours
    assert "Thread" in err  # faulthandler's dump on stderr too
    record = json.loads((tmp_path / "hangs/life/summary.json").read_text())
    assert record["stuck_ranks"] == [0] and record["phases"]["0"]["phase"] == "train"


def test_a_stopped_rank_is_named_by_the_other_from_its_silent_heartbeat(tmp_path):
    ranks = [_rank(tmp_path, r, 2, timeout=3.0) for r in range(2)]
    try:
        time.sleep(0.5)
        ranks[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = ranks[0].communicate(timeout=30)
        assert ranks[0].returncode == 3, err
        assert time.monotonic() - stopped < 3.0 + 2.0
        summary = [line for line in err.splitlines() if line.startswith("error: hang:")]
        assert len(summary) == 1, err
        assert "rank 1 (" in summary[0] and f"pid {ranks[1].pid}) in train (step 4, mini-batch 1/1, micro-batch " \
            "2/3), silent for 3 s (stopped or frozen)" in summary[0], summary[0]
        assert "rank 0 waiting in train" in summary[0]
        assert not (tmp_path / "hangs/life/rank-1.txt").exists()  # a stopped process dumps nothing
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()


def _peer(rank, step, phase, silent=0.0):
    return PeerView(rank, "n", 100 + rank, step, phase, "", 30.0, silent)


def test_the_summary_names_the_silent_ranks_else_the_odd_phase_out():
    peers = {0: _peer(0, 3, "reward"), 1: _peer(1, 3, "rollout"), 2: _peer(2, 3, "rollout")}
    assert stuck_ranks(peers) == ([0], [])
    peers[2] = _peer(2, 3, "rollout", silent=9.0)
    assert stuck_ranks(peers) == ([2], [2])
    same = {r: _peer(r, 3, "train") for r in range(2)}
    assert stuck_ranks(same) == ([0, 1], [])


def test_only_a_torch_collective_timeout_counts_as_one():
    assert is_collective_timeout(RuntimeError("[gloo/transport/tcp/pair.cc:598] Timed out waiting 9000ms for recv"))
    assert is_collective_timeout(RuntimeError("Application timeout caused pair closure"))  # a peer's gloo timeout
    from megatron_grpo.errors import RolloutFailure

    assert not is_collective_timeout(RolloutFailure("http://n:30000/generate timed out after 600 s"))
    wrapped = RolloutFailure("rank 0 failed")
    wrapped.__cause__ = RuntimeError("Timed out waiting 9000ms for send operation to complete")
    assert is_collective_timeout(wrapped)


# ----------------------------------------------------------------------------- restarts


def _complete(save: Path, step: int) -> None:
    (save / f"step_{step}").mkdir(parents=True)
    (save / f"step_{step}/complete.json").write_text("{}")


def test_restarts_rows_and_the_stop_at_a_repeating_step(tmp_path):
    save = tmp_path / "checkpoints"
    _complete(save, 2)
    (save / ".tmp-step_3").mkdir()
    killed = restarts.classify(143, ["x", "srun: error: node1: task 2: Killed",
                                     "srun: error: node1: tasks 0-1,3: Terminated"], None)
    assert (killed.reason, killed.rank) == ("signal", "2")
    hang = restarts.classify(143, ["srun: error: node1: task 1: Exited with exit code 3"],
                             {"stuck_ranks": [3], "summary": "hang: stuck: rank 3 ..."})
    assert (hang.reason, hang.rank) == ("hang", "3")
    # srun printed the rank it terminated (143) before the one that reported the hang (CI, 2026-12-07)
    hang_after_143 = restarts.classify(143, ["srun: error: node1: task 2: Exited with exit code 143",
                                             "srun: error: node1: task 0: Exited with exit code 3"],
                                       {"stuck_ranks": [1], "summary": "hang: silent: rank 1 ..."})
    assert (hang_after_143.reason, hang_after_143.rank) == ("hang", "1")
    only_143 = restarts.classify(143, ["srun: error: node1: task 2: Exited with exit code 143"],
                                 {"stuck_ranks": [1], "summary": "hang: silent: rank 1 ..."})
    assert (only_143.reason, only_143.rank) == ("hang", "1")
    terminated = restarts.classify(143, ["srun: error: node1: tasks 0-3: Exited with exit code 143"], None)
    assert (terminated.reason, terminated.rank) == ("death", "0-3")
    died = restarts.classify(1, ["srun: error: node2: task 3: Exited with exit code 1"], None)
    assert (died.reason, died.rank) == ("death", "3")

    assert restarts.decide(tmp_path, save, killed, max_restarts=2, now=1.0)[:2] == (
        True, "restart 1 of the trainer (signal, rank 2, exit code 143) from step 2; 1 of 2 in a row at this step")
    assert restarts.decide(tmp_path, save, hang, max_restarts=2, now=2.0)[0]
    again, line, step = restarts.decide(tmp_path, save, died, max_restarts=2, now=3.0)
    assert (again, step) == (False, 2)
    assert line.startswith("not restarting the trainer: it failed 3 times in a row with no checkpoint after step 2 "
                           "(this time death, rank 3: srun: error: node2: task 3: Exited with exit code 1)"), line
    _complete(save, 4)  # progress between failures: the count starts again
    assert restarts.decide(tmp_path, save, died, max_restarts=2, now=4.0)[0]
    rows = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(r["restart"], r["reason"], r["rank"], r["last_complete_step"]) for r in rows] == [
        (1, "signal", "2", 2), (2, "hang", "3", 2), (3, "death", "3", 4)]


# ----------------------------------------------------------------------------- the trainer under torchrun


def _rank_pids(torchrun: psutil.Process) -> dict[int, int]:
    pids = {}
    for child in torchrun.children(recursive=True):
        try:
            env = child.environ()
        except (psutil.Error, OSError):
            continue
        if "RANK" in env and "megatron_grpo.train" in " ".join(child.cmdline()):
            pids[int(env["RANK"])] = child.pid
    return pids


@pytest.mark.slow
def test_a_stopped_rank_under_torchrun_is_named_with_its_phase_and_the_run_exits_3(tmp_path):
    """torchrun, 2 gloo ranks of the tiny recipe; rank 1 is SIGSTOPped after step 1 is logged.
    Rank 0's collective with it times out (0.9 x 10 s) and is reported as the watchdog reports:
    its summary names rank 1 as silent, with its phase; torchrun reports exit code 3 for rank 0."""
    out = tmp_path / "run"
    timeout_s = 10.0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--shutdown-timeout", "2",  # its SIGTERM does nothing to the stopped rank; SIGKILL does
           "-m", "megatron_grpo.train", "tiny_cpu", f"logging.output_dir={out}", "trainer.total_steps=200",
           f"trainer.hang_timeout_s={timeout_s}", "eval.interval=-1", "logging.console=false", "logging.plot=false",
           "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4"]
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.2)
        pids = _rank_pids(psutil.Process(proc.pid))
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        rc = proc.wait(timeout=timeout_s + 90)  # + torchrun's teardown of the stopped rank
        text = (tmp_path / "torchrun.log").read_text()
        summaries = [line for line in text.splitlines() if "error: hang: stuck: rank 1 (" in line]
        assert summaries, text[-5000:]
        assert f"pid {pids[1]}) in " in summaries[0] and "silent for" in summaries[0], summaries[0]
        record = json.loads(next((out / "hangs").glob("*/summary.json")).read_text())
        assert record["stuck_ranks"] == [1] and record["phases"]["1"]["phase"] in (
            "rollout", "logprob", "train", "sync", "metrics", "save"), record
        assert record["at"] - (time.time() - (time.monotonic() - stopped)) < timeout_s, record
        assert rc != 0 and "exitcode  : 3" in text, text[-3000:]
        assert "a collective timed out" in summaries[0] or "trainer.hang_timeout_s" in summaries[0]
        assert (next((out / "hangs").glob("*/rank-0.txt"))).read_text().count("File ") > 3
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in psutil.Process().children(recursive=True):
            if "megatron_grpo.train" in " ".join(child.cmdline()):
                child.kill()
        log.close()


def test_the_main_thread_and_the_watchdog_thread_write_the_heartbeat_at_once(tmp_path):
    """phase() writes from the main thread while the watchdog thread writes on its poll: both at once
    must leave a whole heartbeat and raise nothing (one temp file for both lost a replace)."""
    import threading

    from megatron_grpo.launch.watchdog import HangWatchdog

    dog = HangWatchdog(tmp_path / "beats", tmp_path / "hangs", rank=0, world_size=1, timeout_s=60)
    dog.folder.mkdir(parents=True)
    errors: list[BaseException] = []

    def hammer():
        try:
            for _ in range(3000):
                dog._write()
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert json.loads((dog.folder / "rank-0.json").read_text())["count"] == 6000
