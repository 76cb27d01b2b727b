#!/usr/bin/env bash
# Qwen's BPE ranks (qwen.tiktoken, 151,643 ranks) for tests and benchmarks that need Qwen's real
# tokenizer offline (megatron_grpo/testing/qwen_tokenizer.py builds the HF tokenizer from them):
# taken from the dashscope wheel, which ships the file, into build/qwen-vocab/. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
target=build/qwen-vocab/qwen.tiktoken
sha256=b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186  # the file in dashscope 2.0.2
[ -f "$target" ] && exit 0
mkdir -p "$(dirname "$target")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m pip download -q --no-deps dashscope==2.0.2 -d "$tmp"
.venv/bin/python - "$tmp"/dashscope-*.whl "$target.tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, open(sys.argv[2], "wb") as out:
    out.write(wheel.read("dashscope/resources/qwen.tiktoken"))
PY
echo "$sha256  $target.tmp" | sha256sum -c --quiet
mv "$target.tmp" "$target"
