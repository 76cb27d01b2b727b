#!/usr/bin/env bash
# One GPU, one command: train-step MFU (Qwen3-1.7B shape), log-prob kernel bandwidth, local-engine
# generation tokens/s; prints one markdown table (and writes outputs/bench_gpu.json). About 3-5
# minutes on an H100/H200; capped at 10. Extra arguments go to bench_gpu.py (e.g. --model qwen3-0.6b).
set -euo pipefail; cd "$(dirname "$0")/.."; mkdir -p outputs
exec timeout 600 "${PYTHON:-python}" benchmarks/bench_gpu.py --json outputs/bench_gpu.json "$@"
