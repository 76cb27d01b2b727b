#!/usr/bin/env bash
# Builds the cluster environment inside an image (docker/Dockerfile, docker/megatron-grpo.def):
# Python 3.12 from Ubuntu 24.04, a venv at /opt/venv with requirements/cluster-cu13.lock (--no-deps:
# exactly the tested set), TE's PyTorch extension built against that torch, then this package.
# Run from the copied source folder, as root, on the CUDA devel base (nvcc, for the TE build).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
apt-get update
# openmpi: mpi4py's library; git: HF hub downloads of code-free repos still want it
apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev git ca-certificates \
  openmpi-bin libopenmpi-dev
rm -rf /var/lib/apt/lists/*
python3.12 -m venv /opt/venv
pip=(/opt/venv/bin/pip install --no-cache-dir)
"${pip[@]}" --upgrade pip
"${pip[@]}" --no-deps -r requirements/cluster-cu13.lock
# transformer-engine-torch is source-only on PyPI: built here, against the torch just installed
# (no build isolation), at the version of TE's core in the lock; headers from the nvidia-* wheels.
te=$(sed -n 's/^transformer-engine==\([^ ]*\).*/\1/p' requirements/cluster-cu13.lock)
"${pip[@]}" ninja pybind11 "setuptools>=77" wheel
NVTE_FRAMEWORK=pytorch NVTE_BUILD_USE_NVIDIA_WHEELS=1 MAX_JOBS="${MAX_JOBS:-16}" \
  "${pip[@]}" --no-build-isolation --no-deps "transformer-engine-torch==$te"
"${pip[@]}" --no-deps .
# The table of what the image has (TE and the GPUs show as notes on a builder without a GPU).
/opt/venv/bin/megatron-grpo doctor tiny_cpu
