"""Peak memory and time of target-token log-probs, forward + backward, side by side in one run.

    python benchmarks/bench_logprob.py                 # T in {4096, 16384}, V=151936, bf16, TP 1 and 2
    python benchmarks/bench_logprob.py --quick         # small T and V: a CI smoke run
    python benchmarks/bench_logprob.py --json out.json # also write the rows as JSON

Methods (each: logp of random targets, loss = sum, backward to the inputs):
  (a)   dense      torch.log_softmax(logits.float(), -1).gather(...); at TP>1 the shards are first
                   all-gathered to the full vocabulary (the naive way to get it)
  (b)   megatron   -megatron.core.tensor_parallel.vocab_parallel_cross_entropy(logits, targets)
  (c)   ours       ops.vocab_parallel.vocab_parallel_logprobs
  (c+H) ours+ent   ops.vocab_parallel.vocab_parallel_logprobs_and_entropy (loss = sum logp + sum H)
  (d0)  head+ours  logits = hidden @ weight.T, then (c): the unfused reference for (d)
  (d)   fused      ops.fused_head.fused_head_logprobs (hidden [T, H], weight shard [V/tp, H])
  (r20), (r4k)     sampling replay: ops.support_logprobs.vocab_parallel_support_logprobs_and_entropy
                   over a support of 20 ids per token (top_k=20) or 4096 (SGLang's largest mask);
                   compare with (c+H), the full-vocabulary pass it replaces
  (h16), (h32)     the LM head + (c+H): logits = hidden @ weight.T in bf16, or in fp32
                   (model.fp32_lm_head: hidden and weight upcast, fp32 logits)
(a)-(c+H), (r*) take a bf16 logit shard [T, V/tp] as input; (d0), (d), (h*) take hidden and weight,
so their times include the head matmuls (forward, recompute and two backward matmuls for (d)).

How memory is measured: every (method, T, TP) runs in fresh processes (one per TP rank, forked
from a server that only imported torch/megatron). After the inputs exist, a rank records its
resident set size, resets the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`), runs
forward + backward once and reads the peak (VmHWM in /proc/self/status). "Peak extra" is
peak - before: every byte the method touched beyond its inputs, gradients included, as the kernel
counts it (torch's CPU allocator does not cache, so freed tensors are really freed). On CUDA it is
torch.cuda.max_memory_allocated() minus memory_allocated() before the run. With TP>1 the column
shows the largest rank. Times: the median of `--repeats` further runs (after the measured one),
the slowest rank. Configurations whose predicted memory does not fit in the available memory are
skipped and listed as such, never estimated.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_grpo.ops.fused_head import fused_head_logprobs  # noqa: E402
from megatron_grpo.ops.support_logprobs import vocab_parallel_support_logprobs_and_entropy  # noqa: E402
from megatron_grpo.ops.vocab_parallel import (vocab_parallel_logprobs,  # noqa: E402
                                              vocab_parallel_logprobs_and_entropy)
from megatron_grpo.testing.distributed import run_distributed  # noqa: E402

METHODS = {
    "a": "(a) dense log_softmax(float).gather",
    "b": "(b) megatron vocab_parallel_cross_entropy",
    "c": "(c) ours: vocab_parallel_logprobs",
    "cH": "(c+H) ours: logprobs_and_entropy",
    "d0": "(d0) head matmul + (c)",
    "d": "(d) fused head",
    "r20": "(r20) replay: support of 20 (+H)",
    "r4k": "(r4k) replay: support of 4096 (+H)",
    "h16": "(h16) bf16 head + (c+H)",
    "h32": "(h32) fp32 head + (c+H)",
}
SUPPORT = {"r20": 20, "r4k": 4096}
GIB = 1 << 30


@dataclass
class Config:
    method: str
    tokens: int
    vocab: int
    tp: int
    hidden: int
    device: str
    repeats: int
    chunk_size: Optional[int]


@dataclass
class Result:
    config: Config
    peak_extra: Optional[int] = None  # bytes, largest rank
    seconds: Optional[float] = None  # median, slowest rank
    skipped: Optional[str] = None


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of 128 * TP."""
    multiple = 128 * tp
    return -(-vocab // multiple) * multiple


# ---------------------------------------------------------------- memory probes (per process)

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


class PeakMemory:
    """Peak bytes allocated beyond what existed at __enter__ (CPU: RSS high-water; CUDA: allocator)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.extra = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.base = _rss_bytes()
            _reset_peak_rss()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.extra = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.extra = _peak_rss_bytes() - self.base
        return False


# ---------------------------------------------------------------- the methods (run on each rank)

def _make_inputs(cfg: Config, tp_rank: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(1234)
    local = padded_vocab(cfg.vocab, cfg.tp) // cfg.tp
    targets = torch.randint(0, cfg.vocab, (cfg.tokens,), generator=gen, device=device)
    if cfg.method in SUPPORT:
        # distinct ids per token (a random offset, stride 37 < V / K), the target among them
        k = SUPPORT[cfg.method]
        offsets = torch.randint(0, cfg.vocab, (cfg.tokens, 1), generator=gen, device=device)
        support = (offsets + 37 * torch.arange(k, device=device)) % cfg.vocab
        targets = support[:, 0].clone()
    if cfg.method in ("d0", "d", "h16", "h32"):
        hidden = torch.empty(cfg.tokens, cfg.hidden, dtype=torch.bfloat16, device=device).normal_(generator=gen)
        weight = torch.empty(local, cfg.hidden, dtype=torch.bfloat16, device=device)
        weight.normal_(std=cfg.hidden ** -0.5, generator=gen)
        return dict(hidden=hidden.requires_grad_(), weight=weight.requires_grad_(), targets=targets)
    # generated in bf16 directly (no transient fp32 copy), shard by shard the same on every rank
    logits = torch.empty(cfg.tokens, local, dtype=torch.bfloat16, device=device).normal_(std=2.0, generator=gen)
    inputs = dict(logits=logits.requires_grad_(), targets=targets)
    if cfg.method in SUPPORT:
        inputs["support"] = support.to(torch.int32)
    return inputs


def _step(cfg: Config, inputs: dict) -> None:
    """One forward + backward; the gradients stay in .grad (they count as the method's memory)."""
    from megatron.core import tensor_parallel

    t = inputs["targets"]
    if cfg.method == "a":
        logits = inputs["logits"]
        if cfg.tp > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        loss = torch.log_softmax(logits.float(), dim=-1).gather(-1, t.unsqueeze(-1)).sum()
    elif cfg.method == "b":
        loss = -tensor_parallel.vocab_parallel_cross_entropy(inputs["logits"], t).sum()
    elif cfg.method == "c":
        loss = vocab_parallel_logprobs(inputs["logits"], t, vocab_size=cfg.vocab, chunk_size=cfg.chunk_size).sum()
    elif cfg.method == "cH":
        logp, entropy = vocab_parallel_logprobs_and_entropy(inputs["logits"], t, vocab_size=cfg.vocab,
                                                            chunk_size=cfg.chunk_size)
        loss = logp.sum() + entropy.sum()
    elif cfg.method == "d0":
        logits = inputs["hidden"] @ inputs["weight"].t()
        loss = vocab_parallel_logprobs(logits, t, vocab_size=cfg.vocab, chunk_size=cfg.chunk_size).sum()
    elif cfg.method == "d":
        loss = fused_head_logprobs(inputs["hidden"], inputs["weight"], t, vocab_size=cfg.vocab,
                                   chunk_size=cfg.chunk_size).sum()
    elif cfg.method in SUPPORT:
        logp, entropy = vocab_parallel_support_logprobs_and_entropy(inputs["logits"], t, inputs["support"],
                                                                    vocab_size=cfg.vocab, chunk_size=cfg.chunk_size)
        loss = logp.sum() + entropy.sum()
    elif cfg.method in ("h16", "h32"):
        hidden, weight = inputs["hidden"], inputs["weight"]
        if cfg.method == "h32":
            hidden, weight = hidden.float(), weight.float()
        logp, entropy = vocab_parallel_logprobs_and_entropy(hidden @ weight.t(), t, vocab_size=cfg.vocab,
                                                            chunk_size=cfg.chunk_size)
        loss = logp.sum() + entropy.sum()
    else:
        raise ValueError(f"unknown method {cfg.method!r}; expected one of {sorted(METHODS)}")
    loss.backward()


def _clear_grads(inputs: dict) -> None:
    for v in inputs.values():
        if v.is_floating_point():
            v.grad = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_worker(rank: int, world_size: int, cfg_dict: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_grpo.launch.parallel import ParallelLayout, initialize_model_parallel

    cfg = Config(**cfg_dict)
    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    initialize_model_parallel(ParallelLayout(tensor=cfg.tp))
    inputs = _make_inputs(cfg, parallel_state.get_tensor_model_parallel_rank(), device)
    dist.barrier()
    with PeakMemory(device) as peak:
        _step(cfg, inputs)
        _sync(device)
    _clear_grads(inputs)
    times = []
    for _ in range(cfg.repeats):
        dist.barrier()
        start = time.perf_counter()
        _step(cfg, inputs)
        _sync(device)
        times.append(time.perf_counter() - start)
        _clear_grads(inputs)
    return dict(peak_extra=peak.extra, seconds=statistics.median(times) if times else None)


# ---------------------------------------------------------------- driver

def predicted_bytes(cfg: Config) -> int:
    """Rough upper bound of the memory all ranks together need (inputs + extra), to skip what cannot fit."""
    full = cfg.tokens * padded_vocab(cfg.vocab, cfg.tp)
    shard = full // cfg.tp
    per_rank = {  # bytes per logit element, from measured CPU runs (a: 12, b: 6, c: 2) plus margin
        "a": 2 * shard + 13 * full + (4 * full if cfg.tp > 1 else 0),
        "b": 2 * shard + 8 * shard,
        "c": 5 * shard,
        "cH": 5 * shard,
        "d0": 7 * shard + 8 * cfg.hidden * shard // cfg.tokens,
        "d": 8 * cfg.hidden * shard // cfg.tokens + 8 * cfg.tokens * cfg.hidden + (1 << 30),
        "r20": 5 * shard + 30 * cfg.tokens * 20,
        "r4k": 5 * shard + 30 * cfg.tokens * 4096,
        "h16": 9 * shard + 8 * cfg.hidden * shard // cfg.tokens,
        "h32": 15 * shard + 16 * cfg.hidden * shard // cfg.tokens,
    }[cfg.method]
    return cfg.tp * (per_rank + 600 * 1024 ** 2)  # + the interpreter with torch and megatron imported


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def run_config(cfg: Config, memory_fraction: float, timeout: float) -> Result:
    need, have = predicted_bytes(cfg), available_bytes(torch.device(cfg.device))
    if need > memory_fraction * have:
        return Result(cfg, skipped=f"needs ~{need / GIB:.0f} GiB, {have / GIB:.0f} GiB available")
    per_rank = run_distributed(_bench_worker, world_size=cfg.tp, args=(asdict(cfg),), timeout=timeout)
    seconds = [r["seconds"] for r in per_rank if r["seconds"] is not None]
    return Result(cfg, peak_extra=max(r["peak_extra"] for r in per_rank), seconds=max(seconds) if seconds else None)


def _ratio(value, base) -> str:
    if value is None or base is None or base <= 0:
        return "n/a"
    return f"{value / base:.2f}x"


def markdown_table(results: list[Result]) -> str:
    lines = ["| TP | T | method | peak extra (GiB) | vs (a)* | time fwd+bwd (s) | vs (a)* |",
             "|---:|---:|:---|---:|---:|---:|---:|"]
    baseline = {(r.config.tp, r.config.tokens): r for r in results if r.config.method == "a"}
    for r in results:
        c = r.config
        base = baseline.get((c.tp, c.tokens))
        if base is None:  # without (a): each method against the pass it replaces or extends
            reference = {"r20": "cH", "r4k": "cH", "h32": "h16"}.get(c.method)
            base = next((o for o in results if o.config.method == reference and o.config.tp == c.tp
                         and o.config.tokens == c.tokens), None)
        if r.skipped:
            lines.append(f"| {c.tp} | {c.tokens} | {METHODS[c.method]} | skipped: {r.skipped} | | | |")
            continue
        mem_ratio = _ratio(r.peak_extra, base.peak_extra if base and not base.skipped else None)
        time_ratio = _ratio(r.seconds, base.seconds if base and not base.skipped else None)
        secs = f"{r.seconds:.3f}" if r.seconds is not None else "n/a"
        lines.append(f"| {c.tp} | {c.tokens} | {METHODS[c.method]} | {r.peak_extra / GIB:.3f} | {mem_ratio} | "
                     f"{secs} | {time_ratio} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="T in {256, 512}, V=32000, 1 repeat: a smoke run")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="default 4096 16384")
    p.add_argument("--vocab", type=int, default=None, help="true vocabulary size (default 151936, Qwen)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--hidden", type=int, default=None, help="H for (d0)/(d); default 4096 on GPU, 256 on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=None, help="timed runs after the measured one (default 2 CPU, 5 GPU)")
    p.add_argument("--chunk-size", type=int, default=None, help="rows per chunk for (c)/(d); default: automatic")
    p.add_argument("--memory-fraction", type=float, default=0.8,
                   help="skip a configuration whose predicted memory exceeds this fraction of what is available")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    if args.quick:
        args.tokens = args.tokens or [256, 512]
        args.vocab = args.vocab or 32000
        args.repeats = 1 if args.repeats is None else args.repeats
    args.tokens = args.tokens or [4096, 16384]
    args.vocab = args.vocab or 151936
    args.hidden = args.hidden or (4096 if gpu else 256)
    args.repeats = args.repeats if args.repeats is not None else (5 if gpu else 2)
    return args


def main(argv=None) -> list[Result]:
    args = parse_args(argv)
    results = []
    for tp in args.tp:
        for tokens in args.tokens:
            for method in args.methods:
                cfg = Config(method, tokens, args.vocab, tp, args.hidden, args.device, args.repeats, args.chunk_size)
                result = run_config(cfg, args.memory_fraction, args.timeout)
                results.append(result)
                status = result.skipped or (f"peak extra {result.peak_extra / GIB:.3f} GiB, "
                                            f"{result.seconds if result.seconds is not None else float('nan'):.3f} s")
                print(f"TP={tp} T={tokens} {METHODS[method]}: {status}", file=sys.stderr, flush=True)
    device_note = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU, 1 thread per rank"
    print(f"\nV={args.vocab} (padded to 128*TP), bf16 logits, H={args.hidden} for (d0)/(d), {device_note}, "
          f"median of {args.repeats} timed run(s)\n")
    print(markdown_table(results))
    print("\n* against (a) where it ran; otherwise (r20), (r4k) against (c+H), (h32) against (h16)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return results


if __name__ == "__main__":
    main()
