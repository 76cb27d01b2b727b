"""LoRA vs full fine-tuning, side by side in one run (CPU, fp32): the training state, peak memory and step
time of the same short GRPO run, and the bytes each weight sync moves.

    python benchmarks/bench_lora.py [--hidden 512 --layers 4 --ffn 1536 --rank 16 --steps 3 --json PATH]

Each mode trains the tiny_cpu recipe's task for --steps steps on a random Qwen3 of the given size, in its
own child process (one after the other, so the peaks do not mix):
- state bytes: the policy's weights, megatron's DDP gradient buffers and the optimizer's state tensors
  (read from the run: what is allocated, not estimated);
- peak RSS: the child's maximum resident set (torch, the local engine and the data included);
- sync bytes: what a weight sync moves: the merged model for both (model.lora.sync=merged), and what an
  adapter-only sync would move (the adapters: not built yet, the arithmetic of their tensors);
- seconds per step: the median of the steps after the first (context, not the point);
- planned on a GPU: `megatron-grpo plan` of the same shape in bf16 (fake tensors through the real model, DDP,
  optimizer and step code): the resident state and the step's peak, tensor by tensor. RSS on CPU moves by
  several hundred MiB from run to run (glibc keeps and returns freed memory at its own pace); the plan's
  figures do not.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _shape(args) -> list[str]:
    return [f"model.override_config.hidden_size={args.hidden}",
            f"model.override_config.num_hidden_layers={args.layers}",
            f"model.override_config.intermediate_size={args.ffn}", "model.override_config.head_dim=64",
            "model.override_config.num_attention_heads=8", "model.override_config.num_key_value_heads=4"]


def _lora(mode: str, args) -> list[str]:
    return [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}"] if mode == "lora" else []


def _plan(mode: str, args) -> dict:
    """megatron-grpo plan of the same shape on one simulated GPU (bf16, the trainer alone)."""
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "plan", "tiny_cpu", *_shape(args),
                              *_lora(mode, args), "trainer.device=cuda", "rollout.engine=sglang", "--trainer-gpus", "1",
                              "--json", f"{folder}/plan.json"], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"plan ({mode}) failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        stage = json.load(open(f"{folder}/plan.json"))["stages"][0]
    return {"planned_resident_bytes": stage["resident_bytes"], "planned_peak_bytes": stage["peak_bytes"],
            "planned_peak_phase": stage["peak_phase"]}


def _child(mode: str, args) -> dict:
    import torch

    from megatron_grpo.config import load_config
    from megatron_grpo.trainer import loop

    captured = {}
    build_run = loop.build_run

    def capture(cfg):
        captured["run"] = build_run(cfg)
        return captured["run"]

    loop.build_run = capture
    overrides = [*_shape(args), *_lora(mode, args), f"trainer.total_steps={args.steps}", "logging.console=false",
                 "logging.plot=false", "eval.interval=-1",
                 f"logging.output_dir={tempfile.mkdtemp(prefix=f'bench_lora_{mode}_')}"]
    loop.train(load_config("tiny_cpu", overrides))
    run = captured["run"]
    params = [p for chunk in run.policy for p in chunk.parameters()]
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for chunk in run.policy for b in chunk.buffers)
    inner = run.optimizer.inner
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    optimizer = sum(t.numel() * t.element_size() for state in inner.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    steps = [json.loads(line) for line in open(f"{run.config.logging.output_dir}/metrics.jsonl")]
    step_seconds = [s["time/step"] for s in steps[1:] if "time/step" in s] or [float("nan")]
    return {"mode": mode, "weight_bytes": weights, "trainable_bytes": trainable, "grad_buffer_bytes": grads,
            "optimizer_bytes": optimizer, "sync_bytes_merged": weights - trainable if mode == "lora" else weights,
            "sync_bytes_adapter_only": trainable if mode == "lora" else None,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "seconds_per_step": statistics.median(step_seconds)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--child", choices=("full", "lora"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("BENCH_LORA " + json.dumps(_child(args.child, args)), flush=True)
        return 0
    results = {}
    for mode in ("full", "lora"):
        start = time.time()
        out = subprocess.run([sys.executable, __file__, "--child", mode, *sys.argv[1:]], capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH_LORA ")), None)
        if out.returncode or line is None:
            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
            return 1
        results[mode] = json.loads(line.removeprefix("BENCH_LORA "))
        results[mode]["wall_seconds"] = time.time() - start
        results[mode].update(_plan(mode, args))
    full, lora = results["full"], results["lora"]
    mb = 2**20
    rows = [("weights (MiB)", "weight_bytes"), ("trainable (MiB)", "trainable_bytes"),
            ("DDP gradient buffers (MiB)", "grad_buffer_bytes"), ("optimizer state (MiB)", "optimizer_bytes"),
            ("peak RSS (MiB)", "peak_rss_bytes")]
    print(f"Qwen3-shaped, hidden {args.hidden}, {args.layers} layers, FFN {args.ffn}, fp32; LoRA rank {args.rank} "
          f"on every linear layer; {args.steps} GRPO steps of tiny_cpu's task\n")
    print("| | full | LoRA | LoRA / full |\n|---|---|---|---|")
    for label, key in rows:
        ratio = lora[key] / full[key] if full[key] else float("nan")
        print(f"| {label} | {full[key] / mb:.1f} | {lora[key] / mb:.1f} | {ratio:.3f} |")
    print(f"| bytes per weight sync, merged (MiB) | {full['sync_bytes_merged'] / mb:.1f} | "
          f"{lora['sync_bytes_merged'] / mb:.1f} | {lora['sync_bytes_merged'] / full['sync_bytes_merged']:.3f} |")
    print(f"| bytes per weight sync, adapters only (MiB; not built) | | {lora['sync_bytes_adapter_only'] / mb:.2f} | "
          f"{lora['sync_bytes_adapter_only'] / full['sync_bytes_merged']:.4f} |")
    gib = 2**30
    for label, key in (("parameters", "parameters"), ("gradient buffers", "gradient buffers"),
                       ("optimizer state", "optimizer state")):
        f, lo = full["planned_resident_bytes"].get(key, 0), lora["planned_resident_bytes"].get(key, 0)
        print(f"| planned on a GPU, bf16: {label} (GiB) | {f / gib:.2f} | {lo / gib:.2f} | "
              f"{lo / f if f else float('nan'):.3f} |")
    print(f"| planned on a GPU, bf16: peak of the step (GiB) | {full['planned_peak_bytes'] / gib:.2f} | "
          f"{lora['planned_peak_bytes'] / gib:.2f} | {lora['planned_peak_bytes'] / full['planned_peak_bytes']:.3f} |")
    print(f"| seconds per step (median) | {full['seconds_per_step']:.2f} | {lora['seconds_per_step']:.2f} | "
          f"{lora['seconds_per_step'] / full['seconds_per_step']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
