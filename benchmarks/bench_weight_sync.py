"""Weight-sync throughput on CPU: GB/s of each transport and its ratio to a plain memory copy.

    python benchmarks/bench_weight_sync.py [--hidden 512 --layers 4 --vocab 16000 --repeats 3]

Measured in one run, for the same HF-named tensors (a random Qwen3 of the given size, fp32):
- memcpy: copy_ of every tensor into preallocated tensors of the same shapes (the baseline);
- local engine: LocalEngine.update_weights (strict name/shape checks + copy into the model);
- distributed / tensor (shared memory) / disk: the full update protocol (pause, begin session,
  push, end session, flush, continue) into an SGLang test server over localhost: SGLang 0.5.23's own
  HTTP app, tokenizer manager and scheduler-side weight-update code (receive, SafeUnpickler,
  load_weights), with the CPU scheduler of tests/sglang_harness (needs build/sglang-venv:
  `bash scripts/setup_sglang_venv.sh`). gloo broadcast, ForkingPickler shared memory, safetensors.
Prints a markdown table; best of --repeats per row.

    python benchmarks/bench_weight_sync.py --stages [--world-size 4 --pp 1 2 4 ...]

Per pipeline stage vs through rank 0 (trainer/sync/weight_sync.py's two routes): the same model trained
at PP=1, 2, 4 on --world-size gloo ranks (DP = world / PP), synced into the local engine in its own
process (rollout/engine_process.py, shared memory): seconds of one sync_weights call (export +
push + applied acknowledgement), best of --repeats."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_grpo.rollout.local import LocalEngine  # noqa: E402
from megatron_grpo.rollout.sglang.client import SGLangClient  # noqa: E402
from megatron_grpo.rollout.sglang.weight_sync import (DiskTransport, DistributedTransport, EngineTarget,  # noqa: E402
                                                      TensorTransport, update_weights)
from tests.sglang_harness.fixtures import launch_servers, server_settings  # noqa: E402
from tests.tiny_hf import char_tokenizer  # noqa: E402


def build_model(args):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=args.hidden // 8, intermediate_size=args.hidden * 3,
                         vocab_size=args.vocab, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def best_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _stage_sync_seconds(rank, world_size, pp, route, model_dir, repeats):
    import torch.distributed as torch_dist

    from megatron_grpo.convert.loader import load_hf_weights
    from megatron_grpo.convert.stage_export import StageRole
    from megatron_grpo.launch import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model as build_megatron
    from megatron_grpo.rollout.engine_process import EngineSpec, ProcessEngine
    from megatron_grpo.launch.collectives import all_gather_objects as all_gather
    from megatron_grpo.trainer.sync.stage_sync import StageSync
    from megatron_grpo.trainer.sync.weight_sync import sync_weights

    torch.set_num_threads(1)
    initialize_model_parallel(ParallelLayout(pipeline=pp), seed=0)
    cfg = ModelArchitecture.from_hf(model_dir, vocab_multiple=8)
    chunks = build_megatron(cfg)
    load_hf_weights(chunks, cfg, model_dir)
    engine = ProcessEngine(EngineSpec(model_dir=model_dir, threads=1)) if rank == 0 else None
    stage_sync = None
    if route == "per_stage":
        endpoint = all_gather(engine.stage_endpoint() if rank == 0 else None)[0]
        role = StageRole.current()
        stage_sync = StageSync(role=role, sink=endpoint.open(role, 64 * 2**20) if role.sends else None)
    run = type("Run", (), {"stage_sync": stage_sync, "engine": engine, "policy": chunks, "model_config": cfg})
    times = []
    for version in range(1, repeats + 1):
        torch_dist.barrier()
        start = time.perf_counter()
        sync_weights(run, version)
        torch_dist.barrier()
        times.append(time.perf_counter() - start)
    if stage_sync is not None:
        stage_sync.close()
    if engine is not None:
        engine.close()
    return min(times)


def stages_main(args) -> None:
    from megatron_grpo.testing.distributed import run_distributed

    model = build_model(args)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model.save_pretrained(model_dir)
        char_tokenizer().save_pretrained(model_dir)
        for pp in args.pp:
            seconds = {route: run_distributed(_stage_sync_seconds, args.world_size, timeout=1200,
                                              args=(pp, route, str(model_dir), args.repeats))[0]
                       for route in ("rank0", "per_stage")}
            rows.append((pp, seconds["rank0"], seconds["per_stage"]))
    print(f"\nWeight sync into the local engine process, {nbytes / 1e6:.1f} MB fp32 (hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}); {args.world_size} gloo ranks (DP = ranks / PP); best of "
          f"{args.repeats}; 1 torch thread per rank\n")
    print("| PP | rank0 route (s) | per_stage (s) | speed-up |")
    print("|---:|---:|---:|---:|")
    for pp, rank0, per_stage in rows:
        print(f"| {pp} | {rank0:.3f} | {per_stage:.3f} | {rank0 / per_stage:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--stages", action="store_true", help="rank0 route vs per_stage at each --pp")
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    if args.stages:
        return stages_main(args)
    torch.set_num_threads(1)

    model = build_model(args)
    source = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in source.values())
    rows = []

    targets = {k: torch.empty_like(v) for k, v in source.items()}
    memcpy_s = best_seconds(lambda: [targets[k].copy_(v) for k, v in source.items()], args.repeats)
    rows.append(("memcpy (baseline)", memcpy_s))

    engine = LocalEngine(build_model(args), char_tokenizer())
    rows.append(("local engine update_weights",
                 best_seconds(lambda: engine.update_weights(source.items(), version=1), args.repeats)))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model.save_pretrained(model_dir)
        char_tokenizer().save_pretrained(model_dir)
        settings = server_settings(model_dir)
        launcher = launch_servers(Path(tmp) / "logs", [settings], timeout_s=600)
        try:
            client = SGLangClient([settings.url])
            bucket = args.bucket_mb * 2**20
            target = EngineTarget(settings.url)
            dist = DistributedTransport(client, [target], "127.0.0.1", 0, backend="gloo",
                                        bucket_bytes=bucket, group_name="bench")
            dist.connect()
            version = iter(range(2, 10_000))
            for name, transport in (
                    ("SGLang code, distributed (gloo broadcast)", dist),
                    ("SGLang code, tensor (shared memory)", TensorTransport(client, [target], bucket_bytes=bucket)),
                    ("SGLang code, disk (safetensors)", DiskTransport(client, [target], Path(tmp) / "sync",
                                                                      side_files_from=model_dir))):
                rows.append((name, best_seconds(
                    lambda t=transport: update_weights(client, t, source.items(), next(version)), args.repeats)))
            dist.close()
        finally:
            launcher.shutdown(grace_s=5)

    print(f"\nWeight sync of {len(source)} tensors, {nbytes / 1e6:.1f} MB fp32 "
          f"(hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}); best of {args.repeats}; "
          f"1 torch thread\n")
    print("| path | seconds | GB/s | ratio to memcpy |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.4f} | {nbytes / 1e9 / seconds:.2f} | {memcpy_s / seconds:.3f} |")


if __name__ == "__main__":
    main()
