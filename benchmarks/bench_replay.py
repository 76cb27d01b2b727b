"""Sampling-support replay on and off, side by side in one run: the embedded default sampling with
top-p 0.9 and top-k 20 (same seed, same steps, through the real CLI).

    replay on    rollout.sampling_replay=on: the trainer's log-probs over each token's support
    replay off   rollout.sampling_replay=off: over the full vocabulary (the engine still reports the
                 truncated distribution's log-probs, so mismatch/* shows the bias)

Reports, per configuration: the fraction of token ratios outside [0.9, 1.1] and the p99
|trainer - engine log-prob| at step 1 and averaged over the run, the reward at fixed steps, steps
and wall-clock to a 5-step moving average of reward >= --target, the mean step time and the
peak RSS of the process. The curves (reward, outside fraction) go to one PNG.

    python benchmarks/bench_replay.py --out build/bench_replay [--steps 150] [--seed 1]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import WINDOW, run_dir_of, run_one  # noqa: E402

TRUNCATION = ["rollout.top_p=0.9", "rollout.top_k=20"]
CONFIGS = {"replay on": [*TRUNCATION, "rollout.sampling_replay=on"],
           "replay off": [*TRUNCATION, "rollout.sampling_replay=off"]}
REWARD_STEPS = (1, 25, 50, 75, 100, 125, 150)


def _records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "reward/mean" in r and "time/step" in r]


def _steps_to(train: list[dict], target: float) -> int | None:
    for i in range(WINDOW - 1, len(train)):
        if sum(r["reward/mean"] for r in train[i - WINDOW + 1:i + 1]) / WINDOW >= target:
            return train[i]["step"]
    return None


def summarise(name: str, run_dir: Path, result, target: float) -> dict:
    train = _records(run_dir)
    outside = [r["mismatch/ratio_outside_frac"] for r in train]
    p99 = [r["mismatch/abs_logp_diff_p99"] for r in train]
    rewards = {r["step"]: r["reward/mean"] for r in train}
    return dict(name=name, outside_step1=outside[0], outside_mean=sum(outside) / len(outside), p99_step1=p99[0],
                p99_mean=sum(p99) / len(p99), rewards={s: rewards[s] for s in REWARD_STEPS if s in rewards},
                steps_to_target=_steps_to(train, target), time_to_target_s=result.time_to_target_s,
                step_s=sum(r["time/step"] for r in train) / len(train), peak_rss_mib=result.peak_rss_mib,
                final_reward=result.final_reward)


def table(rows: list[dict], target: float) -> str:
    base = rows[-1]  # replay off
    steps = [s for s in REWARD_STEPS if s in rows[0]["rewards"]]
    lines = ["| | ratio outside [0.9, 1.1]: step 1 / mean | p99 abs log-prob diff: step 1 / mean | "
             + " | ".join(f"reward @{s}" for s in steps)
             + f" | steps to {target} | step time vs off | peak RSS vs off |",
             "|---" * (5 + len(steps)) + "|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['outside_step1']:.1%} / {r['outside_mean']:.1%} "
                     f"| {r['p99_step1']:.2g} / {r['p99_mean']:.2g} | "
                     + " | ".join(f"{r['rewards'][s]:.2f}" for s in steps)
                     + f" | {r['steps_to_target'] or 'not reached'} | {r['step_s'] / base['step_s']:.2f}x "
                     f"| {r['peak_rss_mib'] / base['peak_rss_mib']:.2f}x |")
    return "\n".join(lines)


def plot(out: Path, runs: dict[str, Path]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward, outside, p99) = plt.subplots(3, 1, figsize=(6, 7.5), sharex=True)
    for name, run_dir in runs.items():
        train = _records(run_dir)
        steps = [r["step"] for r in train]
        reward.plot(steps, [r["reward/mean"] for r in train], label=name)
        outside.plot(steps, [r["mismatch/ratio_outside_frac"] for r in train], label=name)
        p99.plot(steps, [max(r["mismatch/abs_logp_diff_p99"], 1e-9) for r in train], label=name)
    reward.set_ylabel("reward/mean")
    outside.set_ylabel("ratios outside [0.9, 1.1]")
    p99.set_ylabel("p99 |log-prob diff|")
    p99.set_yscale("log")
    p99.set_xlabel("step")
    for ax in (reward, outside, p99):
        ax.grid(alpha=0.3)
        ax.legend(loc="center right", fontsize="small")
    fig.suptitle("embedded default, top-p 0.9 / top-k 20: sampling replay on vs off")
    fig.tight_layout()
    path = out / "replay_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "build" / "bench_replay")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.8)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, runs = [], {}
    for name, overrides in CONFIGS.items():
        result = run_one(name, overrides, args.seed, args.steps, args.out, args.target)
        runs[name] = run_dir_of(args.out, name, args.seed)
        rows.append(summarise(name, runs[name], result, args.target))
    text = table(rows, args.target)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    plot(args.out, runs)
    print(text)


if __name__ == "__main__":
    main()
