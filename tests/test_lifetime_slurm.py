"""The local Slurm cluster of scripts/start_local_slurm.sh ends with its owner process
(SLURM_LOCAL_OWNER_PID), also when the owner is killed by SIGKILL: its daemons detach, so the
script leaves a watcher that runs stop_local_slurm.sh.

A second, private cluster (own folder and ports) is started, so a cluster the test run already
uses is not touched; it is purged at the end. Needs root and the Slurm packages; skips otherwise.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.requirements import require_local_slurm

from megatron_grpo.launch.env import free_server_port

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cluster_stops_when_its_owner_is_killed(tmp_path):
    require_local_slurm()
    folder = Path("/tmp") / f"megatron-grpo-slurm-owner-test-{os.getpid()}"  # short: daemons' socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(SLURM_LOCAL_DIR=str(folder), SLURM_LOCAL_CTLD_PORT=str(free_server_port()),
               SLURM_LOCAL_SLURMD_PORT=str(free_server_port()), SLURM_LOCAL_PURGE="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    owner = subprocess.Popen(["sleep", "600"])
    daemons: dict[str, int] = {}
    try:
        result = subprocess.run(["timeout", "180", "bash", str(REPO / "scripts/start_local_slurm.sh")],
                                env={**env, "SLURM_LOCAL_OWNER_PID": str(owner.pid)}, capture_output=True,
                                text=True)
        assert result.returncode == 0, f"start_local_slurm.sh failed:\n{result.stdout}\n{result.stderr}"
        assert f"the cluster stops when process {owner.pid} ends" in result.stdout
        for pid_file in (folder / "run").glob("*.pid"):
            daemons[pid_file.stem] = int(pid_file.read_text().strip())
        assert "slurmctld" in daemons and "watcher" in daemons and any(n.startswith("slurmd-") for n in daemons)
        assert all(_alive(pid) for pid in daemons.values()), daemons
        time.sleep(2)  # the watcher looks once a second: it must not stop a cluster whose owner lives
        assert all(_alive(pid) for pid in daemons.values()), daemons

        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in daemons.values()):
            time.sleep(0.2)
        left = {name: pid for name, pid in daemons.items() if _alive(pid)}
        assert not left, f"still running after the owner was killed: {left}"
        assert not folder.exists(), "SLURM_LOCAL_PURGE=1 reached the watcher's stop_local_slurm.sh"
    finally:
        if owner.poll() is None:
            owner.kill()
        if folder.exists():
            subprocess.run(["timeout", "60", "bash", str(REPO / "scripts/stop_local_slurm.sh")], env=env,
                           capture_output=True, text=True)
