"""No process outlives the run, also when the trainer is killed by SIGKILL (launch/lifetime.py).

Fast tests: a reward worker in the middle of a call, and a process forked after the trainer's
stop-signal handlers were installed (as megatron-core forks its checkpoint writers), die with a
parent killed by SIGKILL; the forked one also takes SIGTERM instead of inheriting the trainer's
flag-only handler. Slow test: the tiny recipe, checkpointing every step with reward workers, is
killed with SIGKILL at 3 moments (2 random ones during training, 1 while megatron's checkpoint
writer processes exist; 5 moments before CI's time budget got tight, none ever left a process);
10 s later no process that carries the run's environment marker (every
descendant inherits it) is alive.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "MEGATRON_GRPO_LIFETIME_TEST"
GRACE_S = 10.0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids, seconds: float = GRACE_S) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [pid for pid in pids if _alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


def _start(script: str, tmp_path: Path) -> subprocess.Popen:
    path = tmp_path / "parent.py"  # guarded: spawned children import it again
    path.write_text('if __name__ == "__main__":\n' + textwrap.indent(textwrap.dedent(script), "    "))
    return subprocess.Popen([sys.executable, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))


def _kill_leftovers(pids) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_reward_worker_mid_call_dies_with_killed_parent(tmp_path):
    started = tmp_path / "started"
    (tmp_path / "slow_reward.py").write_text(textwrap.dedent(f"""
        import pathlib, time
        def score(prompt, response, ground_truth, extra):
            pathlib.Path({str(started)!r}).write_text("x")
            time.sleep(120)
            return 1.0
    """))
    parent = _start(f"""
        from megatron_grpo.rewards.runner import RewardRequest, RewardRunner
        runner = RewardRunner({str(tmp_path / 'slow_reward.py') + ':score'!r}, num_workers=1, timeout_s=600)
        print(runner._workers[0].process.pid, flush=True)
        runner.score([RewardRequest("p", "r", None)])
    """, tmp_path)
    worker = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the reward call never started"
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        assert _wait_gone([worker]) == [], "the reward worker outlived its killed parent"
    finally:
        _kill_leftovers([worker])


def test_forked_child_takes_sigterm_and_dies_with_killed_parent(tmp_path):
    """The first child's SIGTERM arrives at the worst moment: right after the fork, before the
    product's after-fork hook resets the handlers (a hook registered earlier runs first and sends
    it), as a SIGTERM sent to a just-started child can on a loaded machine."""
    parent = _start("""
        import multiprocessing, os, signal, time
        early_sigterm = [True]
        os.register_at_fork(after_in_child=lambda: early_sigterm[0] and os.kill(os.getpid(), signal.SIGTERM))
        from megatron_grpo.trainer.signals import StopSignals
        stop = StopSignals().install()  # the trainer's flag-only SIGTERM / SIGUSR1 handlers
        fork = multiprocessing.get_context("fork")
        children = [fork.Process(target=time.sleep, args=(120,)) for _ in range(2)]
        children[0].start()
        early_sigterm[0] = False
        children[1].start()
        print(children[0].pid, children[1].pid, flush=True)
        time.sleep(120)
    """, tmp_path)
    first, second = map(int, parent.stdout.readline().split())
    try:
        assert _wait_gone([first], 5.0) == [], "a forked child inherited the flag-only SIGTERM handler"
        assert _alive(second)
        parent.kill()
        parent.wait()
        assert _wait_gone([second]) == [], "a forked child outlived its killed parent"
    finally:
        _kill_leftovers([first, second])
        if parent.poll() is None:
            parent.kill()


def test_exec_child_with_preexec_hook_dies_with_killed_parent(tmp_path):
    parent = _start("""
        import signal, subprocess, time
        from megatron_grpo.launch.lifetime import preexec_die_with_parent
        child = subprocess.Popen(["sleep", "120"], preexec_fn=preexec_die_with_parent(signal.SIGTERM))
        print(child.pid, flush=True)
        time.sleep(120)
    """, tmp_path)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()
        parent.wait()
        assert _wait_gone([child]) == [], "a program started with preexec_die_with_parent outlived its parent"
    finally:
        _kill_leftovers([child])


# ----------------------------------------------------------------------------- kill -9 the trainer


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARKER) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _kind(proc: psutil.Process, trainer_cmdline: list[str]) -> str:
    try:
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "gone"
    if cmdline == trainer_cmdline:
        return "forked (checkpoint writer)"
    text = " ".join(cmdline)
    if "resource_tracker" in text:
        return "resource tracker"
    if "multiprocessing.spawn" in text:
        return "spawned (reward worker / checkpoint Manager)"
    return text[:60]


def _tree(trainer: psutil.Process, trainer_cmdline: list[str]) -> list[tuple[int, str]]:
    """(pid, kind) of the trainer's descendants, right now."""
    try:
        return [(c.pid, _kind(c, trainer_cmdline)) for c in trainer.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _writers(trainer: psutil.Process, trainer_cmdline: list[str]) -> list[psutil.Process]:
    try:
        return [c for c in trainer.children() if _kind(c, trainer_cmdline).startswith("forked")]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
def test_kill_9_of_the_trainer_leaves_no_process(tmp_path):
    rng = random.Random(14)
    out = tmp_path / "run"
    overrides = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
                 "rollout.n=4", "trainer.total_steps=500", "checkpoint.save_interval=1", "checkpoint.keep_last=2",
                 "reward.num_workers=2", "eval.interval=-1", "logging.console=false", "logging.plot=false",
                 f"logging.output_dir={out}"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    plans = ["random", "save", "random"]
    report, seen_kinds = [], set()
    for trial, plan in enumerate(plans):
        marker = uuid.uuid4().hex
        cmd = [sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", *overrides]
        log = open(tmp_path / f"trial{trial}.log", "w")
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env, MARKER: marker, "OMP_NUM_THREADS": "1"},
                                stdout=log, stderr=subprocess.STDOUT)
        trainer = psutil.Process(proc.pid)
        trainer_cmdline = trainer.cmdline()
        started, during_save = time.monotonic(), False
        try:
            if plan == "random":  # a moment of training: once the reward workers exist, 0-8 s later
                while not _tree(trainer, trainer_cmdline) and proc.poll() is None and time.monotonic() - started < 240:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 8.0))
                before = _tree(trainer, trainer_cmdline)
            else:  # kill while megatron's forked writers exist, after skipping 0-2 saves
                skip, in_save, before = rng.randint(0, 2), False, []
                while time.monotonic() - started < 240 and proc.poll() is None:
                    writing = bool(_writers(trainer, trainer_cmdline))
                    if writing and not in_save and skip <= 0:
                        before = _tree(trainer, trainer_cmdline)
                        if any(kind.startswith("forked") for _, kind in before):
                            during_save = True
                            break
                    if in_save and not writing:
                        skip -= 1
                    in_save = writing
                    time.sleep(0.002)
                assert during_save, f"trial {trial}: no save caught in 240 s\n" + \
                    (tmp_path / f"trial{trial}.log").read_text()[-3000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed_at = time.monotonic()
            left = _wait_gone([pid for pid, _ in before] + [p.pid for p in _marked(marker)])
            left = sorted(set(left) | {p.pid for p in _marked(marker)})
            gone_s = time.monotonic() - killed_at
            left_kinds = [_kind(psutil.Process(pid), trainer_cmdline) for pid in left if _alive(pid)]
        finally:
            log.close()
            _kill_leftovers([p.pid for p in _marked(marker)])
        kinds = sorted({k for _, k in before})
        seen_kinds.update(kinds)
        report.append(f"trial {trial} ({plan}, {killed_at - started:.1f} s in): {len(before)} processes "
                      f"{kinds}; left after {gone_s:.1f} s: {left_kinds}")
        assert not left, "\n".join(report)
    print("\n" + "\n".join(report))
    assert {"forked (checkpoint writer)", "resource tracker",
            "spawned (reward worker / checkpoint Manager)"} <= seen_kinds, seen_kinds
