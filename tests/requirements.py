"""What a test needs from the machine (SGLang's venv, Slurm, Open MPI, shellcheck, root).

A missing requirement skips the test on a developer's machine and fails it under scripts/test.sh,
which installs all of them and sets MEGATRON_GRPO_REQUIRE_TEST_DEPS=1: CI cannot pass with the
SGLang, Slurm or MPI tests silently skipped."""
from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

REQUIRE_ALL = "MEGATRON_GRPO_REQUIRE_TEST_DEPS"
INSTALL_HINT = "bash scripts/install_test_deps.sh installs it"


def missing(reason: str) -> NoReturn:
    """Skips the test with `reason`, or fails it where every requirement must be present."""
    if os.environ.get(REQUIRE_ALL) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ALL}=1: scripts/test.sh requires it)", pytrace=False)
    pytest.skip(reason)


def require_executable(name: str, what: str) -> str:
    """The path of `name` on PATH, or missing() naming what it is."""
    path = shutil.which(name)
    if path is None:
        missing(f"{what} is not installed ({INSTALL_HINT})")
    return path


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        missing(f"{what} needs root")


def require_local_slurm() -> None:
    """What scripts/start_local_slurm.sh needs: Slurm's daemons and client, and root (munged, slurmd)."""
    require_executable("slurmctld", "Slurm's slurmctld")
    require_executable("sbatch", "Slurm's sbatch")
    require_root("the local Slurm cluster (munged, slurmd)")


def require_module(name: str, install: str) -> None:
    """Imports `name` or calls missing() with how to install it."""
    try:
        __import__(name)
    except ImportError:
        missing(f"{name} is not installed ({install})")
