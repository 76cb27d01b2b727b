"""The tiny CPU recipe through slurm/grpo_tiny_cpu.sh -- the same launcher (slurm/lib/grpo_common.sh)
as the GPU scripts -- on a REAL local Slurm (scripts/start_local_slurm.sh: munged, slurmctld and one
slurmd per emulated node on this machine): `sbatch --wait` on one node with 2 tasks, and on 2
emulated nodes with fake GPUs and 2 stand-in SGLang servers (a tiny HTTP /health_generate stub), which
checks engine steps, the health wait, the URLs handed to the trainer and that the exit trap stops
every server. Asserts the job's exit code and that metrics.jsonl has every step.

Needs root and the Slurm packages (scripts/install_test_deps.sh); skips with the reason otherwise,
fails under scripts/test.sh (tests/requirements.py).
The cluster is (re)started with the settings each test needs; if it was not running before this
module, it is stopped afterwards (scripts/stop_local_slurm.sh, by pid)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_grpo.launch.env import free_server_port
from tests.requirements import require_local_slurm

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = os.environ.get("SLURM_LOCAL_DIR", "/tmp/megatron-grpo-slurm")
SLURM_CONF = f"{SLURM_DIR}/etc/slurm.conf"
STEPS = 2

pytestmark = [pytest.mark.slurm, pytest.mark.slow]




def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "OMPI_", "PMI")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DRY_RUN", "GRPO_RUN_DIR")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["SLURM_CONF"] = SLURM_CONF
    env["SLURM_LOCAL_DIR"] = SLURM_DIR
    env.update(extra)
    return env


def _cluster_running() -> bool:
    result = subprocess.run(["scontrol", "ping"], env=_env(), capture_output=True, text=True, timeout=30)
    return result.returncode == 0 and "UP" in result.stdout


@pytest.fixture(scope="module")
def slurm():
    require_local_slurm()
    was_running = os.path.exists(SLURM_CONF) and _cluster_running()

    def start(nodes: int, gpus: int = 0, cpus: int | None = None) -> None:
        settings = dict(SLURM_LOCAL_NODES=str(nodes), SLURM_LOCAL_GPUS=str(gpus))
        if cpus is not None:
            settings["SLURM_LOCAL_CPUS"] = str(cpus)  # what each node claims (the real cores are shared)
        result = subprocess.run(["timeout", "180", "bash", str(REPO / "scripts/start_local_slurm.sh")],
                                env=_env(**settings), capture_output=True, text=True)
        assert result.returncode == 0, f"start_local_slurm.sh failed:\n{result.stdout}\n{result.stderr}"

    yield start
    if not was_running:
        subprocess.run(["timeout", "60", "bash", str(REPO / "scripts/stop_local_slurm.sh")], env=_env(),
                       capture_output=True, text=True)


def _sbatch(tmp_path: Path, sbatch_args: list[str], overrides: list[str], script: str = "grpo_tiny_cpu.sh",
            expect_rc: int = 0, **env: str) -> Path:
    """Runs slurm/<script> with sbatch --wait; returns the run folder."""
    cmd = ["timeout", "600", "sbatch", "--wait", f"--output={tmp_path}/slurm-%j.out", *sbatch_args,
           str(REPO / "slurm" / script), f"trainer.total_steps={STEPS}", "logging.console=false",
           "logging.plot=false", *overrides]
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(OUTPUT_ROOT=str(tmp_path / "runs"), **env),
                            capture_output=True, text=True)
    runs = sorted((tmp_path / "runs").glob("grpo-*"))
    details = [result.stdout, result.stderr] + [p.read_text() for p in tmp_path.glob("slurm-*.out")]
    for run in runs:
        details += [f"---- {p}\n{p.read_text()[-3000:]}" for p in sorted((run / "logs").glob("*.log"))]
    assert result.returncode == expect_rc, "job ended with rc %d:\n%s" % (result.returncode, "\n".join(details))
    assert len(runs) == 1, details
    return runs[0]


def _assert_every_step(run: Path) -> None:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))


def test_sbatch_tiny_cpu_one_node_two_tasks(slurm, tmp_path: Path) -> None:
    slurm(nodes=1)
    run = _sbatch(tmp_path, [], [])
    _assert_every_step(run)
    batch_log = (run / "logs/batch.log").read_text()
    assert "trainer 1 node(s) x 2 task(s), 0 engine(s)" in batch_log
    assert "--ntasks-per-node=2 --ntasks=2" in batch_log
    assert (run / "logs/trainer-0.log").exists() and (run / "logs/trainer-1.log").exists()
    assert "done: exit code 0" in batch_log
    assert "rank 0/2 (local 0/2, slurm)" in (run / "logs/trainer-0.log").read_text()  # DP=2 via srun
    assert "doctor: every node has what the recipe needs" in batch_log
    assert "blocker:" not in (run / f"logs/doctor-{socket.gethostname().split('.')[0]}.log").read_text()


def test_the_doctor_stops_the_job_before_anything_starts(slurm, tmp_path: Path) -> None:
    """A node without what the recipe needs (here: an unreadable tokenizer path) stops the job with
    the node's blocker line, before any engine or trainer task starts."""
    slurm(nodes=1)
    run = _sbatch(tmp_path, [], [f"model.tokenizer_path={tmp_path}/missing"], expect_rc=1)
    batch_log = (run / "logs/batch.log").read_text()
    node = socket.gethostname().split(".")[0]  # one local node is named after the host (start_local_slurm.sh)
    assert (f"  {node}: model.tokenizer_path: needs readable, has {tmp_path}/missing: "
            "No such file or directory") in batch_log, batch_log
    assert not list((run / "logs").glob("trainer-*.log")) and "trainer:" not in batch_log


STUB_SERVER = textwrap.dedent('''
    """Stands in for sglang.launch_server: records its pid and argv, answers GET /health_generate
    (what the batch script waits on: SGLang's /health may answer before the model can serve)."""
    import argparse, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    parser = argparse.ArgumentParser()
    parser.add_argument("--host"); parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()
    with open(os.path.join(os.environ["STUB_PID_DIR"], f"{os.getpid()}.pid"), "w") as f:
        f.write(" ".join(sys.argv[1:]))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health_generate" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    HTTPServer((args.host, args.port), Handler).serve_forever()
''')


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_sbatch_two_nodes_with_engines_and_trap(slurm, tmp_path: Path) -> None:
    slurm(nodes=2, gpus=2)
    stub_dir, pid_dir = tmp_path / "stub", tmp_path / "pids"
    stub_dir.mkdir(), pid_dir.mkdir()
    (stub_dir / "stub_sglang_server.py").write_text(STUB_SERVER)
    port = free_server_port(count=2, stride=10)  # engine j listens on port + 10 j
    run = _sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=2"],
                  ["rollout.sglang.num_engines=2", "rollout.sglang.tp_size=1"],
                  TASKS_PER_NODE="1", ENGINE_PLACEMENT="colocated", SGLANG_MODULE="stub_sglang_server",
                  SGLANG_MODEL_PATH="/unused", SGLANG_PORT=str(port), SGLANG_STARTUP_TIMEOUT_S="120",
                  STUB_PID_DIR=str(pid_dir),
                  PYTHONPATH=os.pathsep.join([str(stub_dir), os.environ.get("PYTHONPATH", "")]))
    _assert_every_step(run)
    batch_log = (run / "logs/batch.log").read_text()
    assert "on node1 node2" in batch_log and "trainer 2 node(s) x 1 task(s), 2 engine(s)" in batch_log
    urls = [f"http://node1:{port}", f"http://node1:{port + 10}"]
    assert f"healthy: {' '.join(urls)}" in batch_log
    assert "rollout.sglang.urls=" in batch_log and all(u in batch_log for u in urls)
    assert "stopped servers: sglang-0 sglang-1" in batch_log
    servers = {int(p.stem): p.read_text() for p in pid_dir.glob("*.pid")}
    assert len(servers) == 2, servers
    assert sorted(a.split("--base-gpu-id ")[1].split()[0] for a in servers.values()) == ["0", "1"]
    assert not [pid for pid in servers if _alive(pid)], "a server outlived the job"
    ranks = sorted((run / "logs").glob("trainer-*.log"))
    assert [p.name for p in ranks] == ["trainer-0.log", "trainer-1.log"]
    assert "rank 0/2 (local 0/1, slurm)" in ranks[0].read_text()  # one task on each node


def test_sbatch_qwen3_8b_colocated_with_harness_engines(slurm, tmp_path: Path) -> None:
    """The mission's first command, `sbatch slurm/grpo_qwen3_8b.sh` with its own recipe, on one
    emulated node of 4 GPUs: the script starts 4 SGLang engines (SGLang's own server code, the
    tests' CPU scheduler) on the trainer's node with --base-gpu-id 0..3 and --enable-memory-saver,
    waits for them, hands their URLs to a TP2 x DP2 trainer of 4 srun tasks, which feeds each engine
    from the rank on its GPU (weight_sync=tensor) for 2 steps. Shrunk as
    tests/test_shipped_recipes.py shrinks the recipe (CpuShrink), and 4 GPUs instead of 8."""
    from tests.sglang_harness.fixtures import HARNESS_FLAGS, SERVER_MODULE, harness_env, sglang_python
    from tests.test_shipped_recipes import cpu_overrides, tiny_policy

    slurm(nodes=1, gpus=4, cpus=8)
    policy = tiny_policy("qwen3", tmp_path / "qwen3")
    port = free_server_port(count=4, stride=10)
    overrides = [o for o in cpu_overrides("qwen3_8b_gsm8k", policy, tmp_path / "unused")
                 if not o.startswith(("logging.output_dir=", "trainer.total_steps=", "model.path="))]
    overrides.append("rollout.sglang.num_engines=4")
    harness = harness_env()
    run = _sbatch(tmp_path, ["--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=1"], overrides,
                  script="grpo_qwen3_8b.sh", HF_MODEL=str(policy), GRPO_PYTHON=sglang_python(),
                  SGLANG_MODULE=SERVER_MODULE, SGLANG_EXTRA_ARGS=" ".join(HARNESS_FLAGS), SGLANG_PORT=str(port),
                  SGLANG_STARTUP_TIMEOUT_S="300",
                  **{k: v for k, v in harness.items() if k != "PYTHONPATH"},
                  PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    _assert_every_step(run)
    batch_log = (run / "logs/batch.log").read_text()
    assert "placement colocated, trainer 1 node(s) x 4 task(s), 4 engine(s)" in batch_log
    commands = [(run / f"logs/launch-sglang-{k}.log").read_text().splitlines()[0] for k in range(4)]
    for k, command in enumerate(commands):
        assert f"--base-gpu-id {k * 1} " in command and "--enable-memory-saver" in command, command
        # the job's key reached every engine from the environment: none on a command line
        assert "api_key_exec GRPO_SGLANG_API_KEY " in command and "--api-key" not in command, command
    assert "doctor: every node has what the recipe needs" in batch_log
    assert "stopped servers: sglang-0 sglang-1 sglang-2 sglang-3" in batch_log
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # step 2 sampled (spread over the 4 engines) with the weights each engine got from the
    # rank on its GPU after step 1; the step moved the weights, so a stale engine would show here
    assert records[1]["rollout/weight_version_min"] == records[1]["rollout/weight_version_max"] == 1
    assert records[1]["actor/logprob_abs_diff_max"] < 1e-4, records[1]["actor/logprob_abs_diff_max"]
    assert records[0]["actor/grad_norm"] > 0
    trainer_log = (run / "logs/trainer-0.log").read_text()
    assert "rank 0/4 (local 0/4, slurm)" in trainer_log
