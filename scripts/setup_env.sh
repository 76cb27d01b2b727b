#!/usr/bin/env bash
# Creates ./.venv if missing: torch 2.13.0 (CPU build) first, then this project with the given extras.
# Usage: bash scripts/setup_env.sh [extras]   (default extras: dev)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
venv="${MEGATRON_GRPO_VENV:-.venv}"
stamp="$venv/.installed-$extras-$(sha1sum setup.py | cut -c1-12)"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ]; then
  "$venv/bin/pip" install -q --upgrade pip
  # torch first: a bare "torch" requirement would otherwise pull a multi-GB CUDA build.
  "$venv/bin/pip" install -q "torch==2.13.0"
  "$venv/bin/pip" install -q -e ".[$extras]"
  torch_version=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
  case "$torch_version" in
    2.13.0*) ;;
    *) echo "ERROR: installing the project replaced torch 2.13.0 with $torch_version" >&2; exit 1 ;;
  esac
  touch "$stamp"
fi
