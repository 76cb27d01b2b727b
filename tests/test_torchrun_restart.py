"""`torchrun --max-restarts 1`: a rank killed by SIGKILL after the step-4 checkpoint, torchrun starts
both ranks again, they form their process groups afresh (launch/distributed.py: torchrun keeps its
store across restarts, so each attempt joins it under its own prefix) and the run continues from
step 4 to its last step, each step's metrics row once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_rank_killed_under_torchrun_max_restarts_resumes_from_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "megatron_grpo.train", "tiny_cpu", "trainer.total_steps=8",
           "checkpoint.save_interval=2", "eval.interval=-1", "logging.console=false", "logging.plot=false",
           f"logging.output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    log = tmp_path / "torchrun.log"
    with open(log, "w") as sink:
        torchrun = subprocess.Popen(cmd, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, stdout=sink,
                                    stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while not (out / "checkpoints" / "step_4" / "complete.json").exists():
                assert torchrun.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            [rank1] = [p for p in psutil.Process(torchrun.pid).children()  # the workers, not their children
                       if p.environ().get("RANK") == "1"]
            rank1.send_signal(signal.SIGKILL)
            assert torchrun.wait(timeout=300) == 0, log.read_text()[-3000:]
        finally:
            if torchrun.poll() is None:
                torchrun.kill()
    text = log.read_text()
    resumed = [line for line in text.splitlines() if "resume: start: step" in line]
    assert resumed and "start: step 0 " in resumed[0], resumed
    assert any(f"start: step {n} " in resumed[-1] for n in (4, 6)), resumed  # from a checkpoint
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == list(range(1, 9)), steps
