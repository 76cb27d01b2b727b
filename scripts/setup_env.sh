#!/usr/bin/env bash
# Creates a venv if missing: torch first (the CPU build where this machine has its wheel), then this
# project with the given extras, then an optional megatron-core pin.
# Usage: bash scripts/setup_env.sh [extras]   (default extras: dev)
# Settings (environment), defaults = CI's first lane:
#   MEGATRON_GRPO_VENV    venv folder                          [.venv]
#   MEGATRON_GRPO_PYTHON  interpreter that creates the venv    [python3]
#   MEGATRON_GRPO_TORCH   torch version                        [2.13.0]
#   MEGATRON_GRPO_MCORE   megatron-core version                [newest that pyproject.toml and the Python allow]
# e.g. CI's second lane: MEGATRON_GRPO_VENV=.venv312 MEGATRON_GRPO_TORCH=2.14.1 MEGATRON_GRPO_MCORE=0.19.2
#      MEGATRON_GRPO_PYTHON=/root/.pyenv/versions/3.12.1/bin/python3.12 bash scripts/setup_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
venv="${MEGATRON_GRPO_VENV:-.venv}"
python="${MEGATRON_GRPO_PYTHON:-python3}"
torch="${MEGATRON_GRPO_TORCH:-2.13.0}"
mcore="${MEGATRON_GRPO_MCORE:-}"
stamp="$venv/.installed-$extras-torch$torch-mcore${mcore:-any}-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
if [ ! -f "$stamp" ]; then
  "$venv/bin/pip" install -q --upgrade pip
  # torch first: a bare "torch" requirement would otherwise pull whatever build pip finds first.
  "$venv/bin/pip" install -q "torch==$torch"
  if [ -n "$mcore" ]; then
    "$venv/bin/pip" install -q -e ".[$extras]" "megatron-core==$mcore"
  else
    "$venv/bin/pip" install -q -e ".[$extras]"
  fi
  got_torch=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
  case "$got_torch" in
    "$torch"|"$torch+"*) ;;
    *) echo "ERROR: installing the project replaced torch $torch with $got_torch" >&2; exit 1 ;;
  esac
  # megatron-core's version may carry a build suffix (0.19.2+e6d286e)
  got_mcore=$("$venv/bin/python" -c "from importlib.metadata import version; print(version('megatron-core'))")
  if [ -n "$mcore" ] && [ "${got_mcore%%+*}" != "$mcore" ]; then
    echo "ERROR: $venv has megatron-core $got_mcore, expected $mcore" >&2; exit 1
  fi
  touch "$stamp"
fi
