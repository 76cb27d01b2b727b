"""The package as a user installs it: a wheel built from the tracked files, installed (not
editable) into a fresh venv, run from a folder that is not the checkout. The venv borrows this
venv's dependencies (torch, megatron-core, ...) through a plain path line in a .pth file, which
adds that folder to sys.path without running its .pth files, so this checkout's editable install
stays out of it and `import megatron_grpo` can only find the wheel's copy."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the project's wheel installed; returns its bin folder."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # only what a clone has: the build must not depend on local leftovers
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (REPO / name).is_file() and not (REPO / name).is_symlink():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(root / "dist"), str(source)], check=True)
    target = root / "venv"
    venv.create(target, with_pip=False)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([target / "bin" / "python", "-c", purelib], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "_borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next((root / "dist").glob("megatron_grpo-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(target / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True)
    return target / "bin"


def test_the_wheel_carries_the_recipes_the_lock_and_the_licence(installed):
    wheel = next(installed.parent.parent.glob("dist/megatron_grpo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("megatron_grpo/recipes/"))
    assert shipped == sorted(p.name for p in (REPO / "megatron_grpo" / "recipes").glob("*.yaml"))
    assert "megatron_grpo/doctor/cluster-cu13.txt" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


def test_the_installed_package_trains_the_embedded_default_from_another_folder(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([installed / "python", "-c", "import megatron_grpo; print(megatron_grpo.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(installed.parent), where  # the wheel's copy, not the checkout

    doctor = subprocess.run([installed / "megatron-grpo", "doctor", "tiny_cpu"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=120)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "blocker:" not in doctor.stdout

    run = subprocess.run([installed / "megatron-grpo", "train", "tiny_cpu", "trainer.total_steps=2",
                          "logging.output_dir=run", "logging.console=false", "eval.interval=-1"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    steps = (elsewhere / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2
