"""The engine-trainer mismatch against SGLang's own kernels: recipes/tiny_cpu_sglang.yaml (one real
SGLang 0.5.23 engine on the CPU, its torch-native attention, sampler and LM head) trained side by
side in one run under each combination of

    dtype           float32 | bfloat16      the trainer's model.dtype; launched engines serve in it (--dtype)
    fp32 LM head    off | on                model.fp32_lm_head (the engine gets --enable-fp32-lm-head)
    replay          off | on                rollout.sampling_replay, with top-p 0.9 / top-k 20 sampling

Per configuration, from the trainer's mismatch/* metrics (trainer log-probs of the step's start
weights against the engine's behaviour log-probs, docs/mismatch.md): p99 |delta log p| and the
fraction of token ratios outside [0.9, 1.1], at step 1 and over the run's steps, with the reward
over the last 5 steps and the peak RSS of the trainer with its engine. Run it in the runtime venv:

    build/sglang-runtime-venv/bin/python benchmarks/bench_sglang_mismatch.py --out build/bench_sglang_mismatch \\
        [--steps 20] [--json PATH]
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRUNCATION = ["rollout.top_p=0.9", "rollout.top_k=20"]


@dataclass(frozen=True)
class Config:
    dtype: str
    fp32_lm_head: bool
    replay: bool

    @property
    def name(self) -> str:
        return f"{self.dtype}_head{'32' if self.fp32_lm_head else 'off'}_replay{'on' if self.replay else 'off'}"

    def overrides(self) -> list[str]:
        return [*TRUNCATION, f"model.dtype={self.dtype}", f"model.fp32_lm_head={str(self.fp32_lm_head).lower()}",
                f"rollout.sampling_replay={'on' if self.replay else 'off'}"]


CONFIGS = [Config(dtype, head, replay) for dtype, head, replay in
           itertools.product(("float32", "bfloat16"), (False, True), (False, True))]


def _peak_rss(pid: int, peak: list[float], stop: threading.Event) -> None:
    import psutil

    root = psutil.Process(pid)
    while not stop.wait(0.5):
        try:
            tree = [root, *root.children(recursive=True)]
            peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass


def run(config: Config, steps: int, out: Path) -> Path:
    """One training run through the real CLI; returns its folder."""
    run_dir = out / config.name
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", str(REPO / "recipes" / "tiny_cpu_sglang.yaml"),
           f"trainer.total_steps={steps}", f"logging.output_dir={run_dir}", "logging.console=false",
           "logging.plot=false", "checkpoint.resume=never", "logging.overwrite=true", "eval.interval=-1",
           *config.overrides()]
    peak, stop = [0.0], threading.Event()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watcher = threading.Thread(target=_peak_rss, args=(proc.pid, peak, stop), daemon=True)
    watcher.start()
    _, err = proc.communicate()
    stop.set()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{config.name} failed with exit {proc.returncode}:\n{err[-3000:]}")
    (run_dir / "peak_rss_mib").write_text(f"{peak[0] / 2**20:.0f}\n")
    return run_dir


def summarise(config: Config, run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "mismatch/abs_logp_diff_p99" in r]
    p99 = [r["mismatch/abs_logp_diff_p99"] for r in steps]
    outside = [r["mismatch/ratio_outside_frac"] for r in steps]
    rss = run_dir / "peak_rss_mib"
    return {**asdict(config), "name": config.name, "steps": len(steps), "p99_step1": p99[0],
            "p99_mean": sum(p99) / len(p99), "p99_max": max(p99), "outside_step1": outside[0],
            "outside_mean": sum(outside) / len(outside),
            "reward_last5": sum(r["reward/mean"] for r in steps[-5:]) / min(5, len(steps)),
            "peak_rss_mib": float(rss.read_text()) if rss.exists() else None}


def table(rows: list[dict]) -> str:
    lines = ["| dtype | fp32 LM head | replay | p99 abs log-prob diff: step 1 / mean / max | "
             "ratio outside [0.9, 1.1]: step 1 / mean | reward, last 5 steps | peak RSS (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {'on' if r['fp32_lm_head'] else 'off'} | {'on' if r['replay'] else 'off'} | "
                     f"{r['p99_step1']:.2e} / {r['p99_mean']:.2e} / {r['p99_max']:.2e} | "
                     f"{r['outside_step1']:.2%} / {r['outside_mean']:.2%} | {r['reward_last5']:.3f} | "
                     f"{r['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "build" / "bench_sglang_mismatch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--configs", nargs="+", default=[c.name for c in CONFIGS],
                        choices=[c.name for c in CONFIGS])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for config in (c for c in CONFIGS if c.name in args.configs):
        rows.append(summarise(config, run(config, args.steps, args.out)))
        print(f"{config.name}: p99 {rows[-1]['p99_mean']:.2e}, outside {rows[-1]['outside_mean']:.2%}", flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
