#!/usr/bin/env bash
# One prepared command proves the CUDA path on one GPU (scripts/gpu_check.py says what it runs).
#   bash scripts/gpu_check.sh --prepare   here (CPU, PyPI): the cp312 wheels the GPU machine lacks ->
#                                         .gpu_wheels/ (git-ignored, < 60 MiB); prints the device call
#   bash scripts/gpu_check.sh             on the GPU machine (no network): installs those wheels into
#                                         a target folder (PYTHONPATH), then in at most 8 minutes
#                                         writes gpu_check.json + gpu_check.md to $OUT (else
#                                         outputs/gpu_check/)
#   bash scripts/gpu_check.sh --dry-run   CPU, tiny shapes, this environment: the same code paths
# Extra arguments go to `gpu_check.py run` (e.g. --out DIR, --budget-s 300).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in
  --prepare)
    shift
    exec "${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}" \
      scripts/gpu_check.py prepare "$@" ;;
  --dry-run)
    shift
    exec "${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}" \
      scripts/gpu_check.py run --dry-run "$@" ;;
  --help|-h)
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
# The device: its image's python3 holds torch; the pinned wheels go to a fresh target folder.
python="${PYTHON:-python3}"
"$python" scripts/gpu_check.py check-wheels
site="${GPU_CHECK_SITE:-/tmp/megatron_grpo_gpu_site}"
rm -rf "$site"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  .gpu_wheels/*.whl
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/gpu_check.py run --python "$python" "$@"
