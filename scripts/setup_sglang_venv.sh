#!/usr/bin/env bash
# Creates build/sglang-venv for the SGLang tests: a venv that sees ./.venv's packages (torch,
# transformers, this project) through a .pth file and adds SGLang 0.5.23's Python code and
# sglang-router 0.3.2 (tests/sglang_harness/requirements.txt, all --no-deps: torch is never
# replaced). SGLang's GPU runtime does not run here; tests/sglang_harness supplies the CPU part.
# Idempotent: a stamp of the requirements file skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
base_python=".venv/bin/python"
venv="build/sglang-venv"
reqs="tests/sglang_harness/requirements.txt"
stamp="$venv/.installed-$(sha1sum "$reqs" | cut -c1-12)"
[ -f "$stamp" ] && exit 0
"$base_python" -m venv "$venv"
base_site=$("$base_python" -c "import site; print(site.getsitepackages()[0])")
child_site=$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
echo "import site; site.addsitedir('$base_site')" > "$child_site/_mgrpo_base_venv.pth"
"$venv/bin/pip" install -q --no-deps -r "$reqs"
expected=$("$base_python" -c "import torch; print(torch.__version__)")
got=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
if [ "$expected" != "$got" ]; then
  echo "ERROR: build/sglang-venv sees torch $got, expected .venv's $expected" >&2
  exit 1
fi
touch "$stamp"
