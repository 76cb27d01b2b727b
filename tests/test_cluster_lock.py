"""The GPU cluster's environment resolves: requirements/cluster-cu13.txt (the tested pins, with
transformer-engine-torch, which the images build from source) and the committed full lock, for
Linux x86_64 / CPython 3.12 / glibc 2.34, with uv reading the wheels' metadata from pypi.org
(scripts/lock_cluster_env.sh): a bump that breaks the set fails here. Also: the pins the doctor
compares against are the lock's, this package's own ranges admit them, and both images install
the lock."""
from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from megatron_grpo.doctor.tested import canonical, pinned_versions

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "cluster-cu13.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", re.M)


def pins(text: str) -> dict[str, str]:
    return {canonical(name): version for name, version in PIN.findall(text)}


def resolve(*files: Path) -> dict[str, str]:
    result = subprocess.run(["bash", "scripts/lock_cluster_env.sh", "--print", *map(str, files)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return pins(result.stdout)


@pytest.fixture(scope="module")
def locked() -> dict[str, str]:
    return pins(LOCK.read_text())


def test_the_tested_pins_resolve_with_the_te_extension(tmp_path, locked):
    te = pinned_versions()["transformer-engine"]
    request = tmp_path / "with-te-torch.txt"
    request.write_text(f"-r {REPO / 'requirements' / 'cluster-cu13.txt'}\ntransformer-engine-torch=={te}\n")
    resolved = resolve(request)
    assert resolved["transformer-engine-torch"] == te
    for name, version in pinned_versions().items():
        assert resolved[name] == version == locked[name], name
    assert resolved["nvidia-nccl-cu13"] == locked["nvidia-nccl-cu13"]  # torch's CUDA 13 build


def test_the_committed_lock_resolves_as_it_is(locked):
    assert resolve(LOCK) == locked


def test_this_package_admits_the_locked_versions(locked):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        assert requirement.specifier.contains(locked[canonical(requirement.name)], prereleases=True), line


def test_both_images_install_the_lock():
    install = (REPO / "docker" / "install.sh").read_text()
    assert "--no-deps -r requirements/cluster-cu13.lock" in install
    assert 'transformer-engine-torch==$te' in install
    for image in ("docker/Dockerfile", "docker/megatron-grpo.def"):
        assert "bash /opt/megatron-grpo/docker/install.sh" in (REPO / image).read_text(), image
