"""Cutting the long tail of generation, side by side in one run (rollout.long_tail, docs/long-tail.md).

Each mode trains the embedded default's task (`recipes/tiny_cpu.yaml`, or with --engine sglang
`recipes/tiny_cpu_sglang.yaml`: SGLang's own runtime on CPU; same seed, same steps) through the real
CLI with longer responses (data.max_response_length, default 128). The fresh policy stops only when it
samples its end-of-sequence token, so response lengths are geometric with a long right tail up to
the cap, and a step's rollout lasts as long as its slowest group (the longest of its n samples).
Modes:
    plain          every group runs to its end
    over_sampling  rollout.long_tail.over_sampling_groups = a quarter of the batch; once the batch's
                   groups are complete the rest are aborted and discarded
    partial        the same, and what the abort left is carried and continued next step
                   (partial_rollout, allow_off_policy: synchronous steps, carried tokens one version old)
Per mode: rollout wall time per step (time/rollout, mean over steps), the engine's busy fraction
(rollout/busy_frac: tokens generated over sequences x the call's longest, mean over steps), the reward
after N steps (mean of reward/mean over the last 5), the mismatch cost (the fraction of trainer /
engine ratios outside [0.9, 1.1] over every trained token, mismatch/*), the share of trained tokens
one version old, and the peak RSS of the run's process tree. `rollout_speedup` is plain's rollout
time per step over partial's.

    python benchmarks/bench_long_tail.py --json build/bench_long_tail.json [--engine local|sglang] [--steps 40]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench_async import run_with_peak_rss

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = REPO / "build" / "sglang-runtime-venv" / "bin" / "python"  # scripts/setup_sglang_runtime.sh
LAST = 5  # steps averaged for the reward after N steps


def modes(extra_groups: int) -> dict[str, list[str]]:
    over = [f"rollout.long_tail.over_sampling_groups={extra_groups}"]
    return {"plain": [], "over_sampling": over,
            "partial": [*over, "rollout.long_tail.partial_rollout=true", "rollout.long_tail.allow_off_policy=true"]}


def run_mode(name: str, overrides: list[str], args) -> dict:
    out = args.out / name
    shutil.rmtree(out, ignore_errors=True)  # the benchmark's own folder: each run starts fresh
    python, recipe = ((str(SGLANG_PYTHON), "tiny_cpu_sglang.yaml") if args.engine == "sglang"
                      else (sys.executable, "tiny_cpu.yaml"))
    cmd = [python, "-m", "megatron_grpo.cli", "train", str(REPO / "recipes" / recipe),
           f"trainer.seed={args.seed}", f"trainer.total_steps={args.steps}", f"logging.output_dir={out}",
           f"data.max_response_length={args.max_response_length}", f"data.train_batch_size={args.batch}",
           # the tiny model's positions: tiny_cpu's 32 prompt tokens + the longer responses
           f"model.override_config.max_position_embeddings={32 + args.max_response_length}",
           f"actor.ppo_mini_batch_size={args.batch}", f"rollout.n={args.n}", "logging.console=false",
           "logging.plot=false", "checkpoint.resume=never", "eval.interval=-1", *overrides]
    peak_mib = run_with_peak_rss(cmd, name)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in steps if "reward/mean" in r]
    outside = tokens = lagged = 0.0
    for record in steps:  # every trained token's trainer / engine ratio (mismatch/*: the step's first pass)
        outside += record["mismatch/ratio_outside_frac"] * record["mismatch/tokens"]
        tokens += record["mismatch/tokens"]
        lagged += record.get("rollout/token_lag_1_frac", 0.0)
    return {"rollout_s_per_step": mean(steps, "time/rollout"), "busy_frac": mean(steps, "rollout/busy_frac"),
            "reward": sum(r["reward/mean"] for r in steps[-LAST:]) / min(LAST, len(steps)),
            "ratio_outside_frac": outside / tokens if tokens else 0.0,
            "tokens_one_version_old_frac": lagged / len(steps),
            "response_length_mean": mean(steps, "response/length_mean"),
            "peak_rss_mib": peak_mib, "steps": len(steps)}


def mean(records: list[dict], key: str) -> float:
    return sum(r[key] for r in records) / len(records)


def table(results: dict[str, dict], speedup: float) -> str:
    lines = ["| mode | rollout s/step | vs plain | busy fraction | reward (last 5) | ratios outside [0.9, 1.1] "
             "| tokens 1 version old | peak RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    plain = results["plain"]["rollout_s_per_step"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['rollout_s_per_step']:.3f} | {plain / r['rollout_s_per_step']:.2f}x | "
                     f"{r['busy_frac']:.2f} | {r['reward']:.3f} | {r['ratio_outside_frac']:.4f} | "
                     f"{r['tokens_one_version_old_frac']:.3f} | {r['peak_rss_mib']:.0f} |")
    return "\n".join(lines) + f"\n\nrollout_speedup (plain / partial): {speedup:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="where the figures go")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "bench_long_tail", help="the runs' folders")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8, help="prompt groups per step")
    parser.add_argument("--n", type=int, default=4, help="samples per group")
    parser.add_argument("--max-response-length", type=int, default=128)
    parser.add_argument("--engine", choices=["local", "sglang"], default="local",
                        help="sglang: SGLang's own runtime on CPU (recipes/tiny_cpu_sglang.yaml, its venv)")
    args = parser.parse_args()
    if args.engine == "sglang" and not SGLANG_PYTHON.exists():
        parser.error(f"--engine sglang needs {SGLANG_PYTHON}: run `bash scripts/setup_sglang_runtime.sh`")
    for name, value in (("--steps", args.steps), ("--batch", args.batch), ("--n", args.n),
                        ("--max-response-length", args.max_response_length)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    results = {name: run_mode(name, overrides, args) for name, overrides in modes(max(1, args.batch // 4)).items()}
    speedup = results["plain"]["rollout_s_per_step"] / results["partial"]["rollout_s_per_step"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**results, "rollout_speedup": speedup, "settings": vars(args) | {
        "json": str(args.json), "out": str(args.out)}}, indent=1) + "\n")
    print(table(results, speedup))


if __name__ == "__main__":
    main()
