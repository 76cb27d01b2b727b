"""`megatron-grpo doctor` on this machine and on deliberately broken environments: a venv without
sglang_router (./.venv has neither SGLang nor the router; build/sglang-venv has both), an unreadable
model folder, a read-only output folder, a taken port, a missing network interface, a full disk,
an unset API key. The broken runs are real processes; root, who reads and writes anything, runs
them without the capabilities that bypass file permissions (as a cluster user is)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from megatron_grpo.cli import main as cli_main
from megatron_grpo.doctor.needs import CHECKPOINT_BYTES_PER_PARAM
from megatron_grpo.launch.env import free_server_port
from tests.sglang_harness.fixtures import sglang_python

REPO = Path(__file__).resolve().parents[1]


def doctor(capsys, *args: str) -> tuple[int, list[str]]:
    """Exit code and the `blocker:` lines of `megatron-grpo doctor ARGS` in this process."""
    code = cli_main(["doctor", *args])
    out = capsys.readouterr().out
    return code, [line for line in out.splitlines() if line.startswith("blocker: ")]


def as_a_user(python: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m megatron_grpo.cli doctor ARGS` with file permissions enforced, even for root."""
    drop = (["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else [])
    return subprocess.run([*drop, python, "-m", "megatron_grpo.cli", "doctor", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine with a GPU")
def test_a_cuda_recipe_on_this_machine_says_there_is_no_gpu(capsys):
    code, blockers = doctor(capsys, "qwen3_8b_gsm8k", "--world-size", "8", "--ranks-per-node", "8", "--port",
                            str(free_server_port()))
    assert code == 1
    gpu = [b for b in blockers if b.startswith("blocker: GPUs:")]
    assert gpu == ["blocker: GPUs: needs CUDA, 8 GPU(s) on this node (trainer.device=cuda), "
                   "has none: a CPU build of torch"]


def test_broken_environments_give_one_line_each(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    model.chmod(0o000)
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    private = tmp_path / "private"  # a folder that cannot be entered: probes below it must not raise
    (private / "tokenizer").mkdir(parents=True)
    private.chmod(0o600)
    args = ("tiny_cpu", f"model.path={model}", f"model.tokenizer_path={private}/tokenizer",
            f"logging.output_dir={read_only}/run", "rollout.engine=sglang",
            "rollout.sglang.router=true", "--port", str(free_server_port()))
    try:
        without_router = as_a_user(str(REPO / ".venv" / "bin" / "python"), *args, cwd=REPO)
        with_sglang = as_a_user(sglang_python(), *args, cwd=REPO)
    finally:
        for folder in (model, read_only, private):
            folder.chmod(0o755)
    assert without_router.returncode == 1, without_router.stdout + without_router.stderr
    lines = [line for line in without_router.stdout.splitlines() if line.startswith("blocker: ")]
    assert lines == [
        "blocker: sglang: needs the rollout engines started here; tested 0.5.23, has absent",
        "blocker: sglang-router: needs rollout.sglang.router=true; tested 0.3.2, has absent",
        f"blocker: model.path: needs readable, has {model}: Permission denied",
        f"blocker: model.tokenizer_path: needs readable, has {private}/tokenizer: Permission denied",
        f"blocker: logging.output_dir: needs writable, has {read_only}/run: Permission denied (at {read_only})",
        "blocker: checkpoint.save_dir: needs writable (size unknown: no model folder to measure), "
        f"has {read_only}/run/checkpoints: Permission denied",
    ], without_router.stdout
    # the same recipe in the venv that has SGLang 0.5.23 and sglang-router 0.3.2: those rows pass
    assert with_sglang.returncode == 1
    assert [line for line in with_sglang.stdout.splitlines() if line.startswith("blocker: ")] == \
        [line for line in lines if not line.startswith(("blocker: sglang:", "blocker: sglang-router:"))]


def test_a_taken_port_a_missing_interface_and_an_unset_key(capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchif0")
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
        monkeypatch.delenv("DOCTOR_TEST_KEY", raising=False)
        code, blockers = doctor(capsys, "tiny_cpu", "--port", str(port), "rollout.sglang.api_key_env=DOCTOR_TEST_KEY",
                                "rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:1]")
    assert code == 1
    interfaces = ", ".join(sorted(socket.if_nameindex() and [n for _, n in socket.if_nameindex()]))
    assert blockers == [
        f"blocker: ports: needs {port} free on 127.0.0.1 (servers bind them), has {port}: Address already in use",
        "blocker: NCCL_SOCKET_IFNAME: needs nosuchif0: an interface that is up with an address, "
        f"has no such interface (this node has {interfaces})",
        "blocker: engine API key: needs $DOCTOR_TEST_KEY set (rollout.sglang.api_key_env), has unset",
    ]
    monkeypatch.setenv("DOCTOR_TEST_KEY", "k")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "l")  # Gloo takes exact names: no prefix
    code, blockers = doctor(capsys, "tiny_cpu", "rollout.sglang.api_key_env=DOCTOR_TEST_KEY", "rollout.engine=sglang",
                            "rollout.sglang.urls=[http://127.0.0.1:1]")
    assert code == 1 and [b.split(",")[0] for b in blockers] == [
        "blocker: NCCL_SOCKET_IFNAME: needs nosuchif0: an interface that is up with an address",
        "blocker: GLOO_SOCKET_IFNAME: needs l: an interface that is up with an address"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^lo")  # NCCL's syntax: every interface but lo
    assert doctor(capsys, "tiny_cpu", "rollout.sglang.api_key_env=DOCTOR_TEST_KEY", "rollout.engine=sglang",
                  "rollout.sglang.urls=[http://127.0.0.1:1]") == (0, [])


def test_a_checkpoint_larger_than_the_free_space_is_a_blocker(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    free = shutil.disk_usage(tmp_path).free
    params = 2 * free // CHECKPOINT_BYTES_PER_PARAM  # two checkpoints' worth: never fits
    with open(model / "model.safetensors", "wb") as sparse:  # a sparse file: its size costs no disk
        sparse.truncate(2 * params)
    code, blockers = doctor(capsys, "tiny_cpu", f"model.path={model}", f"logging.output_dir={tmp_path}/run")
    assert code == 1
    assert len(blockers) == 1 and blockers[0].startswith(
        f"blocker: checkpoint.save_dir: needs writable, {params * CHECKPOINT_BYTES_PER_PARAM / 2**30:.1f} GiB a "
        f"checkpoint ({params / 1e9:.2f}B params; every save kept), has "), blockers


def test_a_bad_recipe_exits_2(capsys):
    assert cli_main(["doctor", "tiny_cpu", "trainer.no_such_key=1"]) == 2
    assert "trainer.no_such_key" in capsys.readouterr().err
