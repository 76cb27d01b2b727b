#!/usr/bin/env bash
# The cluster environment's resolution, for its platform (Linux x86_64, CPython 3.12, glibc 2.34),
# from any machine: uv reads the wheels' metadata without installing (or downloading) them.
#   bash scripts/lock_cluster_env.sh                  rewrites requirements/cluster-cu13.lock from
#                                                     requirements/cluster-cu13.txt
#   bash scripts/lock_cluster_env.sh --print FILE...  prints the resolution of the requirement files
#                                                     (tests/test_cluster_lock.py)
# uv: MEGATRON_GRPO_UV, else .venv's (a dev requirement), else uv on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
uv=${MEGATRON_GRPO_UV:-.venv/bin/uv}
[ -x "$uv" ] || uv=$(command -v uv) || { echo "uv not found: bash scripts/setup_env.sh dev installs it" >&2; exit 1; }
resolve() {
  # --no-config: a developer's uv.toml must not change the answer; pypi.org, as a cluster sees it.
  UV_PYTHON_DOWNLOADS=never "$uv" pip compile --no-config --quiet --no-header \
    --python-platform x86_64-manylinux_2_34 --python-version 3.12 --index-url https://pypi.org/simple "$@"
}
if [ "${1:-}" = --print ]; then
  shift
  resolve "$@"
  exit
fi
lock=requirements/cluster-cu13.lock
resolved=$(resolve requirements/cluster-cu13.txt)
{
  echo "# The full resolution of requirements/cluster-cu13.txt: every package, pinned, for Linux x86_64,"
  echo "# CPython 3.12, glibc >= 2.34. Install it with --no-deps for an environment that cannot drift;"
  echo "# remade by scripts/lock_cluster_env.sh (tests/test_cluster_lock.py checks that it still resolves"
  echo "# as it is and agrees with cluster-cu13.txt)."
  printf '%s\n' "$resolved"
} > "$lock"
echo "wrote $lock ($(grep -c '==' "$lock") packages)"
