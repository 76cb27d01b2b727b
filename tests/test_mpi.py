"""`mpirun -np 2 python -m megatron_grpo.train tiny_cpu` (Open MPI, as root with
--allow-run-as-root): rank discovery from OMPI_COMM_WORLD_*; rank 0's address shared through
mpi4py, or, without mpi4py (hidden from the ranks), from exported MASTER_ADDR / MASTER_PORT.
Skips with the reason when mpirun (scripts/install_test_deps.sh) or mpi4py is missing (fails under
scripts/test.sh)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_grpo.launch.env import free_server_port
from tests.requirements import require_executable, require_module
from tests.test_exit_codes import ABORT

REPO = Path(__file__).resolve().parents[1]
STEPS = 2

pytestmark = pytest.mark.slow


def _mpirun(tmp_path: Path, extra_env: dict[str, str], export: list[str]) -> Path:
    require_executable("mpirun", "Open MPI's mpirun")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI", "PMIX_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **extra_env)
    exports = [arg for name in ["PATH", "PYTHONPATH", *export] if name in env for arg in ("-x", name)]
    cmd = ["timeout", "300", "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
           "--mca", "btl", "self,tcp", *exports,
           sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", f"trainer.total_steps={STEPS}",
           f"logging.output_dir={out}", "logging.console=false", "logging.plot=false"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, (f"mpirun failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-5000:]}")
    assert ABORT not in result.stderr, result.stderr[-3000:]  # tests/test_exit_codes.py: the exit waits
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert "rank 0/2 (local 0/2, mpi)" in result.stdout + result.stderr
    return out


def test_mpirun_with_mpi4py(tmp_path: Path) -> None:
    require_module("mpi4py", "pip install 'megatron-grpo[mpi]'; scripts/install_test_deps.sh does")
    _mpirun(tmp_path, {}, [])


def test_mpirun_without_mpi4py(tmp_path: Path) -> None:
    # A module named mpi4py that fails to import stands first on the ranks' path: the run must
    # not need it when MASTER_ADDR / MASTER_PORT are exported.
    hidden = tmp_path / "hide_mpi4py"
    (hidden / "mpi4py").mkdir(parents=True)
    (hidden / "mpi4py" / "__init__.py").write_text('raise ImportError("mpi4py hidden by test_mpi.py")\n')
    pythonpath = os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])
    _mpirun(tmp_path, {"PYTHONPATH": pythonpath, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_server_port())},
            ["MASTER_ADDR", "MASTER_PORT"])
