"""Interleaved pipeline (parallel.virtual_pipeline) vs plain 1F1B at PP=2 on gloo: update step time.

    python benchmarks/bench_pipeline.py            # the measured run (a few minutes)
    python benchmarks/bench_pipeline.py --quick    # seconds: a smoke run
    python benchmarks/bench_pipeline.py --json out.json

The step. Two gloo processes (PP=2, one core each), a 4-layer Qwen3 shape built from an HF config by
the trainer's own pieces (models.build_model, megatron DDP + distributed optimizer,
micro_batches.plan, train_step.train_on_mini_batch), fp32, packed micro-batches. Every update runs
the same 8 micro-batches of random tokens (a token budget that yields 8 on one data-parallel rank).
Shapes: `tiny` (hidden 64, the embedded default's width) and `small` (hidden 256, 8 heads, FFN
704: bench_e2e.py's small shape). Layouts: VPP 1 (megatron's 1F1B) and VPP 2 (two model chunks of
one layer per rank, the interleaved schedule).

Measured: median update time over the measured steps after warm-up; ratio = VPP 2 / VPP 1 in the
same run. Theory (Narayanan et al. 2021): the pipeline bubble is (p - 1) / m of the ideal time
with 1F1B and (p - 1) / (v m) interleaved, so at p = 2, m = 8 the ideal ratio is
(1 + 1/16) / (1 + 1/8) = 0.944 when the stages compute and communication is free. On CPU each
p2p message is a gloo TCP round trip and the interleaved schedule sends v times as many, so what
this machine shows is the bubble's gain minus that cost.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=32),
}
MICRO_BATCHES = 8
SEQUENCES = 64
THEORY = (1 + 1 / (2 * MICRO_BATCHES)) / (1 + 1 / MICRO_BATCHES)


def _steps(rank, world_size, policy_path, virtual_pipeline, warmup, measured):
    """Median update time on this rank (seconds) and the micro-batch count."""
    import random

    import torch

    from megatron_grpo.config import load_config
    from megatron_grpo.convert import load_hf_weights
    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.batches.batching import TrainSample
    from megatron_grpo.trainer.batches.micro_batches import plan_micro_batches
    from megatron_grpo.trainer.step_settings import global_batch_info, grpo_loss_config
    from megatron_grpo.trainer.step.train_step import train_on_mini_batch

    torch.set_num_threads(1)
    rng = random.Random(0)
    samples = [TrainSample(prompt_ids=[rng.randrange(200) for _ in range(32)],
                           response_ids=[rng.randrange(200) for _ in range(64)],
                           advantage=rng.uniform(-1, 1)) for _ in range(SEQUENCES)]
    budget = SEQUENCES * 96 // MICRO_BATCHES
    cfg = load_config("tiny_cpu", ["rollout.n=8", f"data.train_batch_size={SEQUENCES // 8}",
                                   f"actor.ppo_mini_batch_size={SEQUENCES // 8}",
                                   f"actor.max_tokens_per_micro_batch={budget}"])
    layout = ParallelLayout(pipeline=2, virtual_pipeline=virtual_pipeline)
    initialize_model_parallel(layout, seed=1)
    mc = ModelArchitecture.from_hf(policy_path, vocab_multiple=8)
    chunks = build_model(mc, layout)
    load_hf_weights(chunks, mc, policy_path)
    policy = wrap_with_ddp(chunks, use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(policy, OptimizerSettings(lr=1e-5, use_distributed_optimizer=True))
    (micro_batches,) = plan_micro_batches(samples, cfg, model_config=mc)
    times = []
    for step in range(warmup + measured):
        start = time.perf_counter()
        train_on_mini_batch(policy, optimizer, micro_batches, loss_config=grpo_loss_config(cfg),
                            batch_info=global_batch_info(micro_batches, cfg), temperature=1.0,
                            vocab_size=mc.vocab_size, device=torch.device("cpu"), need_entropy=False)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), len(micro_batches)


def measure(shape: str, folder: Path, warmup: int, measured: int) -> dict:
    from megatron_grpo.models.tiny import save_tiny_hf_model
    from megatron_grpo.testing.distributed import run_distributed

    path = str(save_tiny_hf_model("qwen3", folder / shape, seed=0, **SHAPES[shape], num_hidden_layers=4,
                                  vocab_size=256, tie_word_embeddings=False))
    row = {"shape": shape}
    for vpp in (None, 2):
        results = run_distributed(_steps, 2, args=(path, vpp, warmup, measured), timeout=900)
        row[f"vpp{vpp or 1}_s"] = max(seconds for seconds, _ in results)  # the pipeline ends with its slowest rank
        row["micro_batches"] = results[0][1]
    row["ratio"] = row["vpp2_s"] / row["vpp1_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny shape, 1 + 2 steps: a smoke run")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    import tempfile

    shapes, warmup, measured = (["tiny"], 1, 2) if args.quick else (list(SHAPES), 2, 7)
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(shape, Path(folder), warmup, measured) for shape in shapes]
    print(f"PP=2, {MICRO_BATCHES} micro-batches, gloo; ideal VPP2/VPP1 (bubble only) {THEORY:.3f}\n")
    print("| shape | VPP 1 update | VPP 2 update | VPP 2 / VPP 1 |\n|---|---|---|---|")
    for row in rows:
        vpp1_ms, vpp2_ms = row["vpp1_s"] * 1000, row["vpp2_s"] * 1000
        print(f"| {row['shape']} | {vpp1_ms:.0f} ms | {vpp2_ms:.0f} ms | {row['ratio']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"theory": THEORY, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
