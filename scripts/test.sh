#!/usr/bin/env bash
# The test command: sets up ./.venv if missing, installs the system packages the Slurm/MPI tests
# use (slurm, munge, openmpi, shellcheck; root only), TRL for the benchmark test and SGLang's
# Python code + sglang-router for the SGLang tests (each in a venv layered on .venv), starts a real
# single-node Slurm on localhost, runs the whole suite (slow tests included), and stops the daemons.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`; MEGATRON_GRPO_TEST_WORKERS
# sets the number of pytest-xdist workers (2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
# Independent installs, at once (each is mostly downloads): the system packages (+ mpi4py in
# .venv); TRL, for the side-by-side benchmark test, in its own venv layered on .venv (never changes
# .venv); SGLang 0.5.23's own code (--no-deps) and the sglang-router binary for tests/sglang_harness;
# verl 0.9.1's code (--no-deps) for its reward scorers (tests/test_verl_scorers.py); Qwen's BPE ranks
# for Qwen's real tokenizer (tests/test_qwen_tokenizer.py).
bash scripts/install_test_deps.sh & system_deps=$!
.venv/bin/python benchmarks/bench_e2e.py --setup-trl > /dev/null & trl_venv=$!
bash scripts/setup_sglang_venv.sh & sglang_venv=$!
bash scripts/install_verl_code.sh & verl_code=$!
bash scripts/install_qwen_vocab.sh & qwen_vocab=$!
wait "$system_deps"; wait "$trl_venv"; wait "$sglang_venv"; wait "$verl_code"; wait "$qwen_vocab"
# The SGLang, Slurm, MPI and shellcheck tests fail, not skip, if what they need is missing.
export MEGATRON_GRPO_REQUIRE_TEST_DEPS=1
export SLURM_LOCAL_OWNER_PID=$$  # the local Slurm stops with this script, even if it is killed
bash scripts/start_local_slurm.sh || echo "local Slurm not started: the Slurm tests will fail"
trap 'bash scripts/stop_local_slurm.sh >/dev/null 2>&1 || true' EXIT
# Most tests wait on processes they spawned (servers, ranks, launchers): two workers keep the two
# cores busier (three peaked at 22 of 24 GiB). One file per worker (--dist loadfile), so a module's
# fixtures (servers, references) are built once.
.venv/bin/python -m pytest -n "${MEGATRON_GRPO_TEST_WORKERS:-2}" --dist loadfile "$@"
