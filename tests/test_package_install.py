"""The package as a user installs it: a wheel built from the tracked files, installed (not editable)
with its declared dependencies and no extras into a fresh venv, run from a folder that is not the
checkout. torch goes in first at this venv's version (pip finds it where this one came from: a local
wheel here), then the wheel with its dependencies from the package index (pip's cache makes a rerun
fast), which must leave torch as it is. Nothing of this venv is visible there, so a module the
default run imports that the wheel does not declare fails here. Also the setup.py stub."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with torch and the project's wheel with its dependencies; returns its bin folder."""
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
    venv.create(target, with_pip=False)  # this venv's pip installs into it (--python)
    # --no-compile: a run compiles only the modules it imports (this file: 69 s, against 75 s with all of
    # torch and transformers compiled at install, on the 2-core machine)
    pip = [sys.executable, "-m", "pip", "--python", str(target / "bin" / "python"), "install", "-q", "--no-compile"]
    torch = version("torch")
    subprocess.run([*pip, f"torch=={torch}"], check=True)
    wheel = next((root / "dist").glob("megatron_grpo-*.whl"))
    subprocess.run([*pip, str(wheel)], check=True)
    got = subprocess.run([target / "bin" / "python", "-c", "from importlib.metadata import version as v; "
                          "print(v('torch'))"], capture_output=True, text=True, check=True).stdout.strip()
    assert got == torch, f"installing the wheel replaced torch {torch} with {got}"
    return target / "bin"


@pytest.mark.slow
def test_the_wheel_carries_the_recipes_the_lock_and_the_licence(installed):
    wheel = next(installed.parent.parent.glob("dist/megatron_grpo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("megatron_grpo/recipes/"))
    assert shipped == sorted(p.name for p in (REPO / "megatron_grpo" / "recipes").glob("*.yaml"))
    assert "megatron_grpo/doctor/cluster-cu13.txt" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


@pytest.mark.slow
def test_the_installed_package_trains_the_embedded_default_from_another_folder(installed, tmp_path):
    """No extras: tiny_cpu's reward-curve plot (logging.plot, matplotlib: the `plot` extra) is
    skipped with one line saying how to get it; the run succeeds."""
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
    assert "logging.plot: no reward_curve.png, matplotlib is not installed: pip install 'megatron-grpo[plot]'" \
        in run.stderr, run.stderr[-2000:]
    assert not (elsewhere / "run" / "reward_curve.png").exists()


def test_setup_py_defers_to_pyproject():
    """setup.py is a stub (`setup()`): the version it reports is pyproject.toml's."""
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert proc.stdout.strip().splitlines()[-1] == declared
