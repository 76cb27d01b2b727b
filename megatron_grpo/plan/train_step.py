"""The GPU kit's check of the simulator: one train step (the trainer's train_on_mini_batch on a
1-GPU layout, fixed-length rows, as benchmarks/bench_gpu.py's train section runs it) simulated on
fake tensors; its peak is compared there with torch.cuda.max_memory_allocated of the real step.

    python -m megatron_grpo.plan.train_step --hf-config '{...}' --rows 8 --micro-batches 4 \\
        --prompt-length 256 --response-length 768 --backend local     # prints {"peak_bytes": ...}
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def simulate_train_step(hf: dict, *, rows: int, micro_batches: int, prompt_length: int, response_length: int,
                        backend: str = "local", dtype: torch.dtype = torch.bfloat16) -> dict:
    """The peak of a train step once the model, DDP and Adam's state exist (an optimizer step on zero
    gradients creates the state, as the benchmark's warm-up step does), as the benchmark's peak
    counts it (reset after the build). Micro-batches of one shape run one after another and their
    gradients accumulate in DDP's preallocated buffer, so the first one reaches the step's peak:
    only it is simulated (the simulation's time grows with the micro-batches, not its peak)."""
    from megatron_grpo.algo import GlobalBatchInfo, GRPOLossConfig
    from megatron_grpo.launch.parallel import ParallelLayout
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.plan.fake_rank import fake_rank
    from megatron_grpo.plan.tracker import MemoryTracker
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.batches.batching import TrainSample, collate
    from megatron_grpo.trainer.step.train_step import train_on_mini_batch

    start = time.perf_counter()
    layout = ParallelLayout()
    arch = ModelArchitecture.from_hf(hf)
    samples = [TrainSample(prompt_ids=[1] * prompt_length, response_ids=[1] * response_length,
                           advantage=1.0 if i % 2 else -1.0) for i in range(rows)]
    batches = [collate(samples, list(range(rows)))]
    with fake_rank(1, 0, layout):
        tracker = MemoryTracker(answer_scalar_reads=True)
        with tracker:
            with tracker.phase("build", "parameters"):
                chunks = build_model(arch, layout, dtype=dtype, backend=backend)
                policy = wrap_with_ddp(chunks, use_distributed_optimizer=True)
                optimizer, _ = build_optimizer(policy, OptimizerSettings(
                    lr=1e-6, grad_clip=1.0, use_distributed_optimizer=True, bf16=dtype == torch.bfloat16))
            with tracker.phase("optimizer state"):
                optimizer.step()
            batch_info = GlobalBatchInfo.from_row_token_counts([mb.row_token_counts for mb in batches] * micro_batches,
                                                               num_micro_batches=micro_batches,
                                                               loss_scale_factor=response_length)
            with tracker.phase("step"):
                train_on_mini_batch(policy, optimizer, batches, loss_config=GRPOLossConfig(), batch_info=batch_info,
                                    temperature=1.0, vocab_size=arch.vocab_size, device=torch.device("cpu"),
                                    need_entropy=True)
    steps = [p for p in tracker.phases if p.phase != "build"]
    return {"peak_bytes": max(p.peak_bytes for p in steps), "seconds": round(time.perf_counter() - start, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-config", required=True, help="the model's config.json fields, as JSON")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--micro-batches", type=int, required=True)
    parser.add_argument("--prompt-length", type=int, required=True)
    parser.add_argument("--response-length", type=int, required=True)
    parser.add_argument("--backend", default="local", choices=["local", "memory-model"])
    args = parser.parse_args(argv)
    from megatron_grpo.plan.cli import quiet_third_party

    quiet_third_party()
    print(json.dumps(simulate_train_step(json.loads(args.hf_config), rows=args.rows, micro_batches=args.micro_batches,
                                         prompt_length=args.prompt_length, response_length=args.response_length,
                                         backend=args.backend)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
