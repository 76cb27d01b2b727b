"""Metric sinks: metrics.jsonl (always), a console progress bar, TensorBoard and W&B when enabled.

Only the rank that owns the logger (global rank 0) writes; other ranks get a `NullLogger`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_grpo.optional import available, require
from megatron_grpo.trainer.console import console_may_be_gone

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

# What the progress bar shows, in order (short label -> metric key).
PROGRESS_FIGURES = {
    "reward": "reward/mean",
    "kl": "actor/kl",
    "clip": "actor/pg_clipfrac",
    "len": "response/length_mean",
    "tok/s": "perf/tokens_per_s",
}


@dataclass
class SinkOptions:
    output_dir: str
    console: bool = True
    tensorboard: bool = False
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    run_config: dict | None = None  # stored with W&B runs (the resolved config: it holds no secrets,
                                    # only the names of the environment variables that do)


class MetricsLogger:
    def __init__(self, options: SinkOptions, total_steps: int, start_step: int = 0):
        self.output_dir = Path(options.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / METRICS_FILE
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._jsonl_failed = False  # closing would flush the failed line again, hiding the first error
        self._bar = None
        if options.console:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="GRPO", unit="step", dynamic_ncols=True)
        self._tensorboard = None
        if options.tensorboard:
            tb = require("torch.utils.tensorboard", "logging.tensorboard=true")
            self._tensorboard = tb.SummaryWriter(str(self.output_dir / "tensorboard"))
        self._wandb = None
        if options.wandb_project:
            wandb = require("wandb", "logging.wandb_project")
            self._wandb = wandb.init(project=options.wandb_project, name=options.wandb_run_name,
                                     config=options.run_config, dir=str(self.output_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        try:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        except OSError as exc:  # a full disk: name the file (a flush's error does not)
            self._jsonl_failed = True
            raise OSError(exc.errno, exc.strerror, str(self.jsonl_path)) from None
        if self._bar is not None:
            shown = {label: metrics[key] for label, key in PROGRESS_FIGURES.items() if key in metrics}
            with console_may_be_gone():  # a closed terminal or pipe must not fail the run (console.py)
                self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
                self._bar.update(1)
        if self._tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def message(self, text: str) -> None:
        """A line printed above the progress bar (eval results, checkpoint notices)."""
        with console_may_be_gone():
            if self._bar is not None:
                self._bar.write(text)
            else:
                print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            with console_may_be_gone():
                self._bar.close()
        try:
            self._jsonl.close()
        except OSError:
            if not self._jsonl_failed:
                raise
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


class NullLogger:
    """Stands in for MetricsLogger on ranks that do not write."""

    def log(self, step, metrics):
        pass

    def message(self, text):
        pass

    def close(self):
        pass


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf
    return value


def read_metrics(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_reward_curve(out: Path) -> Path | None:
    """logging.plot: reward_curve.png beside metrics.jsonl. matplotlib is the `plot` extra, not a
    dependency (the plain wheel runs the embedded default): without it one line says how to get it."""
    if not available("matplotlib"):
        log.info("logging.plot: no reward_curve.png, matplotlib is not installed: pip install 'megatron-grpo[plot]'")
        return None
    return plot_reward_curve(out / METRICS_FILE, out / "reward_curve.png")


def plot_reward_curve(jsonl_path: str | os.PathLike, png_path: str | os.PathLike) -> Path:
    """Writes reward (mean, and eval pass@1 when logged) per step as a PNG beside metrics.jsonl,
    with a second panel of the engine-vs-trainer mismatch (p99 |delta log-prob| and the fraction of
    token ratios outside [0.9, 1.1]) when the run logged it."""
    matplotlib = require("matplotlib", "the reward-curve plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    steps = [r["step"] for r in records if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    mismatch = [r for r in records if "mismatch/abs_logp_diff_p99" in r]
    fig, axes = plt.subplots(2 if mismatch else 1, 1, figsize=(6, 6 if mismatch else 3.5), dpi=120, squeeze=False)
    ax = axes[0, 0]
    ax.plot(steps, rewards, label="train reward (mean)")
    evals = [(r["step"], r["eval/pass@1"]) for r in records if "eval/pass@1" in r]
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval pass@1")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if mismatch:
        _plot_mismatch(axes[1, 0], mismatch)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return Path(png_path)


def _plot_mismatch(ax, records: list[dict]) -> None:
    steps = [r["step"] for r in records]
    ax.plot(steps, [max(r["mismatch/abs_logp_diff_p99"], 1e-12) for r in records], color="C2",
            label="p99 |trainer - engine log-prob|")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("p99 |delta log-prob|")
    ax.grid(alpha=0.3)
    other = ax.twinx()
    other.plot(steps, [r["mismatch/ratio_outside_frac"] for r in records], color="C3",
               label="ratio outside [0.9, 1.1]")
    other.set_ylabel("fraction of tokens")
    lines = ax.get_legend_handles_labels()[0] + other.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right", fontsize="small")


def trim_metrics(path: str | os.PathLike, step: int) -> None:
    """Drops metrics.jsonl records after `step` (a resumed run logs them again), and lines a crash
    cut short; replaces the file atomically. Rank 0."""
    from megatron_grpo.checkpointing.layout import write_atomic

    path = Path(path)
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) > step:
                continue
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the crash
        kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept).encode("utf-8"))
