"""Synchronous vs asynchronous GRPO on the embedded default, side by side in one run.

Each configuration trains `recipes/tiny_cpu.yaml` (same seed, same steps) through the real CLI:
    sync             rollout.max_staleness=0 (the on-policy loop: generate, train, sync)
    sync, engine process   the same loop with the local engine in its own process (control)
    async K=1, K=2   rollout.max_staleness=K: the engine's process generates the next batches while
                     the trainer trains (trainer/rollouts/rollout_pipeline.py), with the default
                     off-policy correction (actor.off_policy.is_level=auto: token TIS when K > 0)
    ..., no correction   the same with actor.off_policy.is_level=null
and reports wall-clock and samples until the mean reward reaches --target (a 5-step moving average of
reward/mean, so one lucky batch does not count), tokens/s over the run, the peak RSS of the
process tree (trainer + engine process), and the engine-vs-trainer mismatch of the samples one
version stale (mismatch/staleness_1/*: p99 |log-prob difference| and the fraction of ratios
outside [0.9, 1.1], averaged over steps). The reward curves go to one PNG.

    python benchmarks/bench_async.py --out build/bench_async [--seeds 1 2] [--steps 150]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "sync": ["rollout.max_staleness=0"],
    "sync, engine process": ["rollout.max_staleness=0", "rollout.local.process=true"],
    # the default correction at K > 0 (actor.off_policy.is_level=auto): token-level truncated IS
    "async K=1": ["rollout.max_staleness=1"],
    "async K=1, no correction": ["rollout.max_staleness=1", "actor.off_policy.is_level=null"],
    "async K=2": ["rollout.max_staleness=2"],
    "async K=2, no correction": ["rollout.max_staleness=2", "actor.off_policy.is_level=null"],
    "async K=1, token mask": ["rollout.max_staleness=1", "actor.off_policy.rs_level=token"],
}
WINDOW = 5


@dataclass
class Result:
    name: str
    seed: int
    wall_s: float  # first step's start to the last step's end
    time_to_target_s: float | None
    samples_to_target: int | None
    tokens_per_s: float
    final_reward: float  # mean of the last 10 steps
    peak_rss_mib: float
    dropped_stale: float
    staleness_mean: float
    stale_p99: float | None  # mean over steps of mismatch/staleness_1/abs_logp_diff_p99 (None: no such samples)
    stale_outside: float | None  # ... of mismatch/staleness_1/ratio_outside_frac


def _peak_rss(proc: subprocess.Popen, peak: list[float], stop: threading.Event) -> None:
    root = psutil.Process(proc.pid)
    while not stop.is_set():
        try:
            tree = [root, *root.children(recursive=True)]
            peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        stop.wait(0.2)


def run_with_peak_rss(cmd: list[str], name: str) -> float:
    """Runs `cmd` in the repository; the peak RSS of its process tree, in MiB. A failed run ends the
    benchmark naming `name` and the end of its stderr."""
    peak, stop = [0.0], threading.Event()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watcher = threading.Thread(target=_peak_rss, args=(proc, peak, stop), daemon=True)
    watcher.start()
    _, err = proc.communicate()
    stop.set()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed with exit {proc.returncode}:\n{err[-3000:]}")
    return peak[0] / 2**20


def run_dir_of(out: Path, name: str, seed: int) -> Path:
    return out / f"{name.replace(' ', '_').replace(',', '').replace('=', '')}_seed{seed}"


def run_one(name: str, overrides: list[str], seed: int, steps: int, out: Path, target: float) -> Result:
    run_dir = run_dir_of(out, name, seed)
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", str(REPO / "recipes" / "tiny_cpu.yaml"),
           f"trainer.seed={seed}", f"trainer.total_steps={steps}", f"logging.output_dir={run_dir}",
           "logging.console=false", "checkpoint.resume=never", "eval.interval=-1", *overrides]
    peak_mib = run_with_peak_rss(cmd, f"{name} (seed {seed})")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward/mean" in r and "time/step" in r]
    start = train[0]["time"] - train[0]["time/step"]
    per_step = _samples_per_step(overrides)
    time_to, samples_to = None, None
    for i in range(WINDOW - 1, len(train)):
        if sum(r["reward/mean"] for r in train[i - WINDOW + 1:i + 1]) / WINDOW >= target:
            time_to, samples_to = train[i]["time"] - start, (i + 1) * per_step
            break
    wall = train[-1]["time"] - start
    tokens = sum(r["response/length_mean"] * per_step for r in train)
    return Result(name=name, seed=seed, wall_s=wall, time_to_target_s=time_to, samples_to_target=samples_to,
                  tokens_per_s=tokens / wall, final_reward=sum(r["reward/mean"] for r in train[-10:]) / 10,
                  peak_rss_mib=peak_mib,
                  dropped_stale=sum(r.get("rollout/dropped_stale", 0.0) for r in train),
                  staleness_mean=sum(r.get("staleness/mean", 0.0) for r in train) / len(train),
                  stale_p99=_mean_of(train, "mismatch/staleness_1/abs_logp_diff_p99"),
                  stale_outside=_mean_of(train, "mismatch/staleness_1/ratio_outside_frac"))


def _mean_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else None


def _samples_per_step(overrides: list[str]) -> int:
    from megatron_grpo.config import load_config

    cfg = load_config(str(REPO / "recipes" / "tiny_cpu.yaml"), overrides)
    return cfg.data.train_batch_size * cfg.rollout.n


def _table(results: list[Result], target: float) -> str:
    sync = {r.seed: r for r in results if r.name == "sync"}
    lines = [f"| configuration | seed | time to {target} | speed vs sync | samples to {target} | vs sync "
             "| tokens/s | vs sync "
             "| last-10 reward | peak RSS | mean staleness | dropped stale "
             "| staleness 1: p99 abs log-prob diff | staleness 1: ratio outside [0.9, 1.1] |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = sync[r.seed]
        speed = (f"{base.time_to_target_s / r.time_to_target_s:.2f}x"
                 if r.time_to_target_s and base.time_to_target_s else "-")
        samples = (f"{r.samples_to_target / base.samples_to_target:.2f}x"
                   if r.samples_to_target and base.samples_to_target else "-")
        lines.append(
            f"| {r.name} | {r.seed} | {f'{r.time_to_target_s:.1f} s' if r.time_to_target_s else 'not reached'} "
            f"| {speed} "
            f"| {r.samples_to_target or 'not reached'} | {samples} | {r.tokens_per_s:,.0f} "
            f"| {r.tokens_per_s / base.tokens_per_s:.2f}x | {r.final_reward:.3f} | {r.peak_rss_mib:,.0f} MiB "
            f"({r.peak_rss_mib / base.peak_rss_mib:.2f}x) | {r.staleness_mean:.2f} | {r.dropped_stale:.0f} "
            f"| {'-' if r.stale_p99 is None else f'{r.stale_p99:.3f}'} "
            f"| {'-' if r.stale_outside is None else f'{r.stale_outside:.1%}'} |")
    return "\n".join(lines)


def _plot(out: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4))
    for run_dir in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists()):
        train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        train = [r for r in train if "reward/mean" in r and "time/step" in r]
        start = train[0]["time"] - train[0]["time/step"]
        smooth = [sum(r["reward/mean"] for r in train[max(0, i - WINDOW + 1):i + 1]) / min(i + 1, WINDOW)
                  for i in range(len(train))]
        by_time.plot([r["time"] - start for r in train], smooth, label=run_dir.name)
        by_step.plot([r["step"] for r in train], smooth, label=run_dir.name)
    for ax, xlabel in ((by_time, "wall-clock (s)"), (by_step, "step (= samples / 512)")):
        ax.axhline(target, color="grey", linestyle=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"reward/mean ({WINDOW}-step moving average)")
    by_step.legend(fontsize=7)
    fig.suptitle("embedded default: synchronous vs asynchronous GRPO (2 CPU cores)")
    fig.tight_layout()
    fig.savefig(out / "async_reward_curves.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "build" / "bench_async")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS)[:4], choices=list(CONFIGS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = []
    for seed in args.seeds:
        for name in args.configs:
            began = time.perf_counter()
            results.append(run_one(name, CONFIGS[name], seed, args.steps, args.out, args.target))
            print(f"{name}, seed {seed}: {time.perf_counter() - began:.0f} s", file=sys.stderr)
    table = _table(results, args.target)
    (args.out / "results.md").write_text(table + "\n")
    (args.out / "results.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    _plot(args.out, args.target)
    print(table)


if __name__ == "__main__":
    main()
