"""One-GPU performance: train-step MFU, log-prob kernel bandwidth, local-engine generation; one table.

    bash benchmarks/run_gpu_bench.sh                  # the prepared run (~3-5 min on an H100/H200)
    python benchmarks/bench_gpu.py --model qwen3-1.7b # same, choosing the model / sizes yourself
    python benchmarks/bench_gpu.py --dry-run          # tiny shapes on CPU (or GPU): checks the code paths
    bash scripts/gpu_check.sh                         # on a GPU machine: this, plus the GPU tests and a GRPO run

Without CUDA (and without --dry-run) it exits at once with a message: nothing here is meaningful
on CPU.

Sections (each a row group of the table):
1. train step MFU: a Qwen3-shaped model (random init; config dict -> ModelArchitecture.from_hf ->
   models.build_model with --backend's attention (auto: TE when it imports, else torch_varlen), bf16,
   Megatron DDP + distributed optimizer) runs trainer.step.train_step.train_on_mini_batch, the trainer's own update
   (GRPO loss on vocab-parallel log-probs + entropy, one optimizer step) on fixed-length sequences.
   MFU = useful model FLOPs / step time / the card's dense bf16 peak, with useful FLOPs as the
   trainer counts them (trainer/step/flops.py: 3 x forward; forward = 2 x matmul parameters, the LM
   head included and the input embedding not, per token, plus causal attention).
2. log-prob kernels: ops.vocab_parallel on a [T, V] bf16 logit tensor. Effective bandwidth = the
   bytes the op must at least move / time: forward reads the logits once (T*V*2 bytes); forward +
   backward with entropy (what the trainer runs) reads them twice and writes the gradient once
   (3*T*V*2). Shown against the card's peak HBM bandwidth and against a measured device copy
   (logits.clone(): read + write), the practical ceiling.
3. log-prob peak memory: the extra device memory (beyond the logits) of one forward + backward of
   ops.vocab_parallel log-probs + entropy (what the trainer runs), gradient included, against dense
   torch.log_softmax(logits.float()).gather(...) on the same [T, V] bf16 logits (bench_logprob's
   methods (c+H) and (a), measured the same way: torch.cuda.max_memory_allocated).
4. local engine generation: rollout.local.LocalEngine (HF transformers Qwen3, bf16, KV cache) on
   P prompts x n samples, EOS disabled so every row decodes exactly the requested tokens.
   Generated tokens/s; "weight read" is parameter bytes x decode steps / time, a lower bound on the
   HBM traffic of decoding (KV-cache reads come on top).
Times: CUDA-synchronised wall clock, median of the measured repetitions after warm-up.

Targets (TARGETS; the table's "target" column): train-step MFU >= 45%, log-prob forward + backward
>= 70% of the device copy's bandwidth, log-prob peak memory <= 0.25x dense fp32. Each section runs
on its own: one that raises is named under raw["errors"] and the others still report, and --json
is rewritten after every section (raw["running"] names the one in progress), so a run killed at a
time limit leaves what it measured.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN3 = {  # HF config dicts (Qwen/Qwen3-*/config.json, the fields that shape the network)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
COMMON = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
              max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
              attention_dropout=0.0, hidden_act="silu", initializer_range=0.02, bos_token_id=151643,
              eos_token_id=151645)


# The targets: (key in raw["targets"], comparison, value)
TARGETS = {"train_mfu": (">=", 0.45), "logprob_fwd_bwd_vs_copy": (">=", 0.70), "logprob_memory_vs_dense": ("<=", 0.25),
           "plan_ratio": ("within", 0.10)}  # simulated / measured peak: 1 +- 10%


def target_verdict(key: str, value: Optional[float], raw: dict) -> tuple[str, str]:
    """("target" text, "met" / "not met"), and the outcome recorded in raw["targets"]."""
    op, bound = TARGETS[key]
    if op == "within":
        text = f"1 +- {bound:.0%}"
        met = None if value is None else abs(value - 1) <= bound
    else:
        text = f"{op} {bound:.0%}" if key != "logprob_memory_vs_dense" else f"{op} {bound:.2f}x"
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
    raw.setdefault("targets", {})[key] = dict(value=value, target=f"{op} {bound}", met=met)
    return text, "n/a" if met is None else ("met" if met else "not met")


@dataclass
class Row:
    section: str
    setting: str
    measured: str
    peak: str = "n/a"
    fraction: str = "n/a"
    target: str = ""
    verdict: str = ""


@dataclass
class Report:
    device: str
    rows: list[Row] = field(default_factory=list)
    raw: dict = field(default_factory=dict)

    def markdown(self) -> str:
        lines = [f"Device: {self.device}", "", "| benchmark | setting | measured | peak | % of peak | target |",
                 "|---|---|---:|---:|---:|---|"]
        lines += [f"| {r.section} | {r.setting} | {r.measured} | {r.peak} | {r.fraction} | "
                  f"{r.target + (' (' + r.verdict + ')' if r.verdict else '')} |" for r in self.rows]
        return "\n".join(lines)

    def write_json(self, path: Optional[str], args: argparse.Namespace) -> None:
        if not path:
            return
        data = {"table": self.markdown(), "rows": [vars(r) for r in self.rows], "raw": self.raw, "args": vars(args)}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, default=str)
        os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def hf_config(name: str, vocab_size: Optional[int] = None) -> dict:
    config = dict(COMMON, **QWEN3[name])
    if vocab_size:
        config["vocab_size"] = vocab_size
        config["bos_token_id"] = config["eos_token_id"] = vocab_size - 1
    return config


def device_peaks(device: torch.device, tflops: Optional[float],
                 tbps: Optional[float]) -> tuple[str, Optional[float], Optional[float]]:
    """trainer/step/flops.py's table, with --peak-tflops / --peak-tbps taking precedence."""
    from megatron_grpo.trainer.step.flops import device_peaks as table_peaks

    name, peak_tflops, peak_tbps = table_peaks(device)
    return (name + ", dry run" if device.type != "cuda" else name), tflops or peak_tflops, tbps or peak_tbps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e12:.2f} TB/s" if bytes_per_s >= 1e11 else f"{bytes_per_s / 1e9:.2f} GB/s"


def pct(value: float, peak: Optional[float]) -> str:
    return f"{100 * value / peak:.1f}%" if peak else "n/a"


# ----- 1. train step ---------------------------------------------------------------------------
def bench_train(args, device: torch.device, dtype: torch.dtype, report: Report, peak_tflops: Optional[float]) -> None:
    from megatron_grpo.algo import GlobalBatchInfo, GRPOLossConfig
    from megatron_grpo.launch import ParallelLayout, init_distributed, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.models.spec import resolve_backend
    from megatron_grpo.trainer.batches.batching import TrainSample, collate
    from megatron_grpo.trainer.step.flops import training_flops
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.step.train_step import train_on_mini_batch

    init_distributed()
    layout = ParallelLayout()
    initialize_model_parallel(layout, seed=1234)
    mc = ModelArchitecture.from_hf(hf_config(args.model, args.vocab_size))
    chunks = build_model(mc, layout, dtype=dtype, backend=args.backend)
    for chunk in chunks:
        chunk.to(device)
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    policy = wrap_with_ddp(chunks, use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(policy, OptimizerSettings(lr=1e-6, grad_clip=1.0, use_distributed_optimizer=True,
                                                             bf16=dtype == torch.bfloat16))
    for packed in [mode == "packed" for mode in args.train_modes.split(",")]:
        seq = args.prompt_length + args.response_length
        generator = torch.Generator().manual_seed(0)
        rows = args.micro_batch_rows * args.micro_batches
        # --packed: GRPO-like uneven responses (uniform in 1..response_length), packed as the trainer does.
        lengths = (torch.randint(1, args.response_length + 1, (rows,), generator=generator).tolist() if packed
                   else [args.response_length] * rows)
        samples = [TrainSample(prompt_ids=torch.randint(mc.vocab_size, (args.prompt_length,),
                                                        generator=generator).tolist(),
                               response_ids=torch.randint(mc.vocab_size, (length,), generator=generator).tolist(),
                               advantage=1.0 if i % 2 else -1.0) for i, length in enumerate(lengths)]
        if packed:
            from bench_packing import step_inputs

            micro_batches, batch_info = step_inputs(samples, packing=True, max_tokens=args.micro_batch_rows * seq,
                                                    model_config=mc, loss_scale_factor=args.response_length)
        else:
            micro_batches = [collate(samples, list(range(i, i + args.micro_batch_rows)))
                             for i in range(0, rows, args.micro_batch_rows)]
            batch_info = GlobalBatchInfo.from_row_token_counts([mb.row_token_counts for mb in micro_batches],
                                                               num_micro_batches=len(micro_batches),
                                                               loss_scale_factor=args.response_length)
        loss_config = GRPOLossConfig()

        step = functools.partial(train_on_mini_batch, policy, optimizer, micro_batches, loss_config=loss_config,
                                 batch_info=batch_info, temperature=1.0, vocab_size=mc.vocab_size, device=device,
                                 need_entropy=True)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = timed(step, device, args.warmup, args.repeats)
        sequence_lengths = [args.prompt_length + length for length in lengths]
        tokens = sum(sequence_lengths)  # useful tokens: packing processes no others (bar kernel multiples)
        flops = training_flops(mc, sequence_lengths)
        achieved = flops / seconds / 1e12
        backend = resolve_backend(args.backend, dtype)
        setting = (f"{args.model} ({params / 1e6:,.1f}M params, {backend} spec, bf16), {args.micro_batches} x "
                   f"[{args.micro_batch_rows} x {seq}] tokens, fwd+bwd+Adam"
                   + (f", packed: {tokens} useful tokens of responses 1..{args.response_length}" if packed else ""))
        target, verdict = target_verdict("train_mfu", achieved / peak_tflops if peak_tflops else None, report.raw)
        report.rows.append(Row("train step (packed)" if packed else "train step", setting,
                               f"{achieved:.{1 if achieved >= 0.1 else 4}f} TFLOP/s ({seconds:.3f} s/step, "
                               f"{tokens / seconds:,.0f} tok/s)",
                               f"{peak_tflops:.0f} TFLOP/s" if peak_tflops else "n/a",
                               pct(achieved, peak_tflops) + " MFU" if peak_tflops else "n/a", target, verdict))
        report.raw["train_packed" if packed else "train"] = dict(seconds=seconds, tokens=tokens, tflops=achieved,
                                                                 params=params, backend=backend,
                                                                 peak_memory=(torch.cuda.max_memory_allocated(device)
                                                                              if device.type == "cuda" else None))
    optimizer = policy = chunks = None  # released before the next section (the closures above hold them)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----- 2. log-prob kernels ---------------------------------------------------------------------
def bench_logprob(args, device: torch.device, report: Report, peak_tbps: Optional[float]) -> None:
    from megatron_grpo.ops.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_logprobs_and_entropy

    tokens, vocab = args.logprob_tokens, args.logprob_vocab
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, vocab, device=device, dtype=torch.bfloat16, generator=generator)
    targets = torch.randint(vocab, (tokens,), device=device, generator=generator)
    size = logits.numel() * logits.element_size()
    raw = {}

    def copy():
        return logits.clone()

    def forward():
        with torch.no_grad():
            return vocab_parallel_logprobs(logits, targets, tp_group=None)

    def forward_backward():
        x = logits.detach().requires_grad_(True)
        logp, entropy = vocab_parallel_logprobs_and_entropy(x, targets, tp_group=None)
        (logp.sum() + entropy.sum()).backward()
        return x.grad

    peak = f"{peak_tbps:.2f} TB/s" if peak_tbps else "n/a"
    for name, fn, moved in (("device copy (clone)", copy, 2 * size),
                            ("vocab_parallel_logprobs fwd", forward, size),
                            ("logprobs+entropy fwd+bwd", forward_backward, 3 * size)):
        seconds = timed(fn, device, args.warmup, args.repeats)
        tbps = moved / seconds / 1e12
        raw[name] = dict(seconds=seconds, bytes=moved, tbps=tbps)
        report.rows.append(Row("log-prob kernels", f"{name}, [{tokens} x {vocab}] bf16",
                               f"{bandwidth(tbps * 1e12)} ({seconds * 1e3:.2f} ms)", peak, pct(tbps, peak_tbps)))
    copy_tbps = raw["device copy (clone)"]["tbps"]
    for name in ("vocab_parallel_logprobs fwd", "logprobs+entropy fwd+bwd"):
        target, verdict = "", ""
        if name == "logprobs+entropy fwd+bwd":
            target, verdict = target_verdict("logprob_fwd_bwd_vs_copy", raw[name]["tbps"] / copy_tbps, report.raw)
        report.rows.append(Row("log-prob kernels", f"{name} vs device copy", bandwidth(raw[name]["tbps"] * 1e12),
                               bandwidth(copy_tbps * 1e12), pct(raw[name]["tbps"], copy_tbps), target, verdict))
    report.raw["logprob"] = raw
    logits = targets = None  # released before the next section (the closures above hold them)
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----- 3. log-prob peak memory ------------------------------------------------------------------
def bench_memory(args, device: torch.device, report: Report) -> None:
    import bench_logprob

    raw = {}
    for method in ("a", "cH"):
        cfg = bench_logprob.Config(method=method, tokens=args.memory_tokens, vocab=args.memory_vocab, tp=1, hidden=0,
                                   device=str(device), repeats=0, chunk_size=None)
        inputs = bench_logprob._make_inputs(cfg, 0, device)
        with bench_logprob.PeakMemory(device) as peak:
            bench_logprob._step(cfg, inputs)
        raw[method] = dict(peak_extra=peak.extra, logits_bytes=inputs["logits"].numel() * 2)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ratio = raw["cH"]["peak_extra"] / raw["a"]["peak_extra"] if raw["a"]["peak_extra"] > 0 else None
    raw["ratio"] = ratio
    shape = f"[{args.memory_tokens} x {args.memory_vocab}] bf16 logits, fwd+bwd, gradient included"
    gib = 2 ** 30
    report.rows.append(Row("log-prob peak memory", f"dense log_softmax(logits.float()).gather, {shape}",
                           f"{raw['a']['peak_extra'] / gib:.2f} GiB"))
    target, verdict = target_verdict("logprob_memory_vs_dense", ratio, report.raw)
    report.rows.append(Row("log-prob peak memory", f"ours: vocab_parallel log-probs + entropy, {shape}",
                           f"{raw['cH']['peak_extra'] / gib:.2f} GiB ({ratio:.3f}x dense)" if ratio is not None
                           else f"{raw['cH']['peak_extra'] / gib:.2f} GiB", target=target, verdict=verdict))
    report.raw["memory"] = raw


# ----- 4. generation ---------------------------------------------------------------------------
def bench_generation(args, device: torch.device, dtype: torch.dtype, report: Report,
                     peak_tbps: Optional[float]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_grpo.rollout.local import LocalEngine
    from megatron_grpo.rollout.types import GenerationRequest, SamplingParams

    config = dict(hf_config(args.model, args.vocab_size))
    model_type = config.pop("model_type")
    config.pop("architectures")
    hf = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf, dtype=dtype)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = args.gen_prompts * args.gen_n
    engine = LocalEngine(model, None, device=device, eos_token_ids=[], max_batch_rows=max(rows, 1))
    generator = torch.Generator().manual_seed(1)

    def requests(count: int, new_tokens: int):
        return [GenerationRequest(prompt_ids=torch.randint(hf.vocab_size, (args.gen_prompt_length,),
                                                           generator=generator).tolist(),
                                  sampling=SamplingParams(n=args.gen_n, temperature=1.0, max_new_tokens=new_tokens,
                                                          seed=i), group_id=str(i)) for i in range(count)]

    engine.generate(requests(args.gen_prompts, min(8, args.gen_new_tokens)))  # warm-up: kernels, allocator
    batch = requests(args.gen_prompts, args.gen_new_tokens)
    sync(device)
    start = time.perf_counter()
    samples = engine.generate(batch)
    sync(device)
    seconds = time.perf_counter() - start
    generated = sum(len(s.response_ids) for s in samples)
    weight_tbps = param_bytes * args.gen_new_tokens / seconds / 1e12
    setting = (f"{args.model} HF {dtype_name(dtype)}, {args.gen_prompts} prompts x n={args.gen_n} "
               f"({rows} rows), prompt {args.gen_prompt_length}, {args.gen_new_tokens} new tokens")
    report.rows.append(Row("local engine generation", setting,
                           f"{generated / seconds:,.0f} tok/s ({seconds:.1f} s)"))
    report.rows.append(Row("local engine generation", "weight read per decode step (lower bound on HBM traffic)",
                           bandwidth(weight_tbps * 1e12), f"{peak_tbps:.2f} TB/s" if peak_tbps else "n/a",
                           pct(weight_tbps, peak_tbps)))
    report.raw["generation"] = dict(seconds=seconds, generated=generated, rows=rows, param_bytes=param_bytes)
    engine.close()
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_plan(args, device: torch.device, report: Report) -> None:
    """The memory planner's simulation of the train section's padded step (megatron_grpo/plan,
    fake tensors, in a child process: it needs one without torch.distributed) against the peak that
    section measured (torch.cuda.max_memory_allocated after the build)."""
    import subprocess

    backend = report.raw.get("train", {}).get("backend", "local")
    # The simulator builds megatron's local modules (TE does not run on fake tensors); the padded step
    # runs the same attention under local and torch_varlen (varlen_attn takes packed rows only).
    if backend not in ("local", "torch_varlen"):
        raise RuntimeError(f"the train section ran the {backend} spec; the plan check compares the local spec")
    command = [sys.executable, "-m", "megatron_grpo.plan.train_step", "--hf-config",
               json.dumps(hf_config(args.model, args.vocab_size)), "--rows", str(args.micro_batch_rows),
               "--micro-batches", str(args.micro_batches), "--prompt-length", str(args.prompt_length),
               "--response-length", str(args.response_length), "--backend", "local"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"megatron_grpo.plan.train_step failed: {done.stderr[-500:]}")
    simulated = json.loads(done.stdout.strip().splitlines()[-1])
    measured = report.raw.get("train", {}).get("peak_memory")
    ratio = simulated["peak_bytes"] / measured if measured else None
    target, verdict = target_verdict("plan_ratio", ratio, report.raw)
    setting = (f"the train row's padded step ({args.model}, {args.micro_batches} x [{args.micro_batch_rows} x "
               f"{args.prompt_length + args.response_length}]) simulated on fake tensors ({simulated['seconds']} s)")
    value = (f"simulated {simulated['peak_bytes'] / 2**30:.2f} GiB vs measured "
             + (f"{measured / 2**30:.2f} GiB" if measured else "n/a (no CUDA)"))
    report.rows.append(Row("memory plan vs measured", setting, value, "torch.cuda.max_memory_allocated",
                           f"{ratio:.3f}x" if ratio else "n/a", target, verdict))
    report.raw["plan"] = dict(simulated=simulated, measured=measured, ratio=ratio)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----- main ------------------------------------------------------------------------------------
DRY_RUN = dict(model="tiny", vocab_size=1024, micro_batch_rows=2, micro_batches=2, prompt_length=8,
               response_length=8, logprob_tokens=64, logprob_vocab=2048, memory_tokens=64, memory_vocab=2048,
               gen_prompts=2, gen_n=2,
               gen_prompt_length=8, gen_new_tokens=4, warmup=1, repeats=2)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes; runs on CPU when there is no GPU")
    parser.add_argument("--model", choices=sorted(QWEN3), default="qwen3-1.7b")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the model vocabulary (151936)")
    parser.add_argument("--backend", choices=["auto", "te", "torch_varlen", "local"], default="auto",
                        help="model.attention_backend")
    parser.add_argument("--micro-batch-rows", type=int,
                        help="rows per train micro-batch (default: 8 on a GPU of >= 100 GiB, else 4: the padded "
                             "1.7B step with 8 rows peaks at ~90 GiB in the memory plan, more than an H100 holds)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=768)
    parser.add_argument("--train-modes", default="padded,packed",
                        help="train step layouts, comma-separated: padded (full-length rows) and/or packed (responses "
                             "of 1..response-length in packed micro-batches, as the trainer trains by default)")
    parser.add_argument("--logprob-tokens", type=int, default=16384)
    parser.add_argument("--logprob-vocab", type=int, default=151936)
    parser.add_argument("--memory-tokens", type=int, default=16384, help="T of the log-prob memory section")
    parser.add_argument("--memory-vocab", type=int, default=151936, help="V of the log-prob memory section")
    parser.add_argument("--gen-prompts", type=int, default=64)
    parser.add_argument("--gen-n", type=int, default=8)
    parser.add_argument("--gen-prompt-length", type=int, default=256)
    parser.add_argument("--gen-new-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the card (default: from its name)")
    parser.add_argument("--peak-tbps", type=float, help="HBM peak in TB/s (default: from its name)")
    parser.add_argument("--only", choices=list(SECTIONS), action="append",
                        help="run only these sections (repeatable)")
    parser.add_argument("--json", help="also write the table and raw numbers to this file")
    args = parser.parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
    return args


def default_micro_batch_rows(device: torch.device) -> int:
    """8 rows where the padded 1.7B step fits (the plan: ~90 GiB with 8 rows, no recompute), else 4."""
    if device.type != "cuda":
        return 8
    return 8 if torch.cuda.get_device_properties(device).total_memory >= 100 * 2**30 else 4


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("bench_gpu.py: no CUDA device (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}). This benchmark measures a GPU; run it on a GPU node "
              "(bash benchmarks/run_gpu_bench.sh), or pass --dry-run to check its code paths on CPU "
              "with tiny shapes.", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.micro_batch_rows is None:
        args.micro_batch_rows = default_micro_batch_rows(device)
    dtype = torch.bfloat16
    name, peak_tflops, peak_tbps = device_peaks(device, args.peak_tflops, args.peak_tbps)
    report = Report(device=name)
    report.raw["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    started = time.perf_counter()
    runners = {"train": lambda: bench_train(args, device, dtype, report, peak_tflops),
               "logprob": lambda: bench_logprob(args, device, report, peak_tbps),
               "memory": lambda: bench_memory(args, device, report),
               "generation": lambda: bench_generation(args, device, dtype, report, peak_tbps),
               "plan": lambda: bench_plan(args, device, report)}
    for section in [s for s in SECTIONS if s in (args.only or SECTIONS)]:
        report.raw["running"] = section
        report.write_json(args.json, args)
        try:
            runners[section]()
            status = "done"
        except Exception as exc:  # noqa: BLE001 - one broken section must not cost the others their figures
            report.raw.setdefault("errors", {})[section] = f"{type(exc).__name__}: {exc}"
            report.rows.append(Row(SECTIONS[section], "failed", f"{type(exc).__name__}: {exc}"[:300]))
            status = f"FAILED ({type(exc).__name__}: {exc})"
            _release_after_failure(device)
        print(f"{SECTIONS[section]} {status} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        report.raw["wall_seconds"] = time.perf_counter() - started
        report.raw.pop("running")
        report.write_json(args.json, args)
    print(report.markdown())
    from megatron_grpo.launch.distributed import shutdown

    shutdown(idle_timeout_s=1.0)  # the train section's process groups; nothing runs after it
    return 1 if report.raw.get("errors") else 0


SECTIONS = {"train": "train step", "logprob": "log-prob kernels", "memory": "log-prob peak memory",
            "generation": "local engine generation", "plan": "memory plan vs measured"}


def _release_after_failure(device: torch.device) -> None:
    """A failed section may leave megatron's parallel state and device memory behind."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
