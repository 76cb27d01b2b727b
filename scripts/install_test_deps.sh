#!/usr/bin/env bash
# install_test_deps.sh - system packages and Python extras for the Slurm / MPI / shellcheck tests
# (tests/test_slurm.py, tests/test_mpi.py, tests/test_slurm_scripts.py).
#
#   apt (Debian/Ubuntu): slurmctld slurmd slurm-client munge libpmix-dev   (a real local Slurm)
#                        openmpi-bin libopenmpi-dev                         (mpirun, libmpi for mpi4py)
#                        ShellCheck                                         (lint of slurm/*.sh, scripts/*.sh)
#   pip (into .venv):    mpi4py
#
# Idempotent and fast when everything is there (dpkg/import checks only, no network).
# libpmix-dev matters: Slurm's mpi/pmix plugin dlopen()s the unversioned libpmix.so that only the
# -dev package ships; without it `srun --mpi=pmix` hangs the node.
#
# Settings (environment):
#   INSTALL_TEST_DEPS_PYTHON   python whose environment gets mpi4py   [<repo>/.venv/bin/python]
#   INSTALL_TEST_DEPS_SKIP_APT 1: do not touch apt (report what is missing and go on)   [0]
# Not root / no apt-get: prints what is missing and exits 0, so the tests that need the
# tools skip with a reason instead of the whole suite failing here.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${INSTALL_TEST_DEPS_PYTHON:-$REPO/.venv/bin/python}
SKIP_APT=${INSTALL_TEST_DEPS_SKIP_APT:-0}
say() { echo "[install_test_deps] $*"; }

pkgs=(slurmctld slurmd slurm-client munge libpmix-dev openmpi-bin libopenmpi-dev shellcheck)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
    say "apt packages present: ${pkgs[*]}"
elif [ "$SKIP_APT" = 1 ] || [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "WARNING: missing ${missing[*]} and cannot install (needs root + apt-get, INSTALL_TEST_DEPS_SKIP_APT=$SKIP_APT); the Slurm/MPI tests will skip"
else
    say "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Try without an update first (the lists may be fresh enough); update once on failure.
    if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    say "installed: ${missing[*]}"
fi

if [ -x "$PY" ]; then
    if "$PY" -c "import mpi4py" >/dev/null 2>&1; then
        say "mpi4py present in $PY"
    elif command -v mpicc >/dev/null 2>&1 || [ -e /usr/lib/x86_64-linux-gnu/libmpi.so ] || ldconfig -p 2>/dev/null | grep -q 'libmpi\.so'; then
        "$PY" -m pip install -q mpi4py && say "mpi4py installed into $PY"
    else
        say "WARNING: no libmpi: not installing mpi4py (tests that need it will skip)"
    fi
else
    say "WARNING: $PY not found: mpi4py not installed"
fi
