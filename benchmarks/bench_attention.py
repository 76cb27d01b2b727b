"""The attention backends on one GPU: torch's varlen_attn (model.attention_backend=torch_varlen)
against the local path's packed attention (ops.varlen_attention); the GPU check's attention part.

    python benchmarks/bench_attention.py [--json FILE]   # a CUDA device, torch >= 2.10
    python benchmarks/bench_attention.py --dry-run       # CPU, tiny shapes: the same code paths, with
                                                         # testing/varlen_reference.py in the kernel's place

Without CUDA (and without --dry-run) it exits at once with a message.

Sections (each runs on its own: one that raises is named under raw["errors"], the others report;
--json is rewritten after each):
1. numerics: one packed row of GRPO-like sequences (prompt 256 + response 1..768 tokens, segments
   padded to a multiple of 8 as TP / CP padding does) at the Qwen3-1.7B attention shape (16 heads,
   8 KV groups, head_dim 128), bf16. The torch_varlen path (ops.torch_varlen.packed_varlen_attention)
   and the local path (ops.varlen_attention.packed_causal_attention), output and the q / k / v
   gradients of a random upstream gradient, each against a dense float64 attention of the same bf16
   inputs; then the context-parallel conversion (ops.torch_varlen.varlen_over_gathered) for each
   rank of CP = 2 on this one device (output and dq), against the same reference.
   Bound, relative to the reference's largest magnitude (testing/floats.py's form):
       ULPS * (sqrt(r) * eps(bf16) + sqrt(L) * eps(fp32)),   ULPS = 4,
   with r the bf16 roundings that reach a value (output: the probabilities rounded to bf16 before
   P.V, and the output: r = 2; gradients: the bf16 output in FlashAttention's rowsum(dO * O) or the
   bf16 probabilities in the local kernel, dP / dS rounded before its matmul, P for dV, the gradient
   itself: r = 4) and L the longest reduction (keys per query, queries per key: the longest
   sequence), summed in fp32. torch_varlen vs local then differ by at most the sum of their bounds.
   Times: fwd + bwd of each kernel on the row (median), and its peak extra memory.
2. train step: benchmarks/bench_gpu.py's train section (the trainer's own update on the Qwen3-1.7B
   shape, packed micro-batches of 1..768-token responses after 256-token prompts, bf16, megatron
   DDP + distributed optimizer) once per backend, local then torch_varlen: seconds per step,
   tokens/s, MFU and peak memory side by side, and local / torch_varlen.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_gpu  # noqa: E402
from bench_gpu import Report, Row  # noqa: E402

ULPS = 4.0
ROUNDINGS = {"output": 2, "grad": 4}
SECTIONS = {"numerics": "attention numerics", "train": "train step, packed, per backend"}


def bound(roundings: int, reduction: int) -> float:
    """Relative bound of a bf16 attention value against float64 (module docstring)."""
    return ULPS * (math.sqrt(roundings) * torch.finfo(torch.bfloat16).eps
                   + math.sqrt(reduction) * torch.finfo(torch.float32).eps)


def error_ratio(actual: torch.Tensor, reference: torch.Tensor, allowed: float) -> float:
    """max|actual - reference| / (allowed * max|reference|); <= 1 is within the bound."""
    reference = reference.detach().double()
    error = float((actual.detach().double() - reference).abs().max())
    scale = allowed * float(reference.abs().max())
    return error / scale if scale else (0.0 if error == 0 else math.inf)


def packed_row(args, device: torch.device):
    """(q, k, v, upstream, cu, cu_padded, lengths): one packed bf16 row, padding rows' upstream 0."""
    generator = torch.Generator().manual_seed(0)
    lengths = [args.prompt_length + int(n) for n in torch.randint(1, args.response_length + 1, (args.sequences,),
                                                                  generator=generator)]
    segments = [-(-n // 8) * 8 for n in lengths]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    cu_padded = torch.tensor([0] + list(torch.tensor(segments).cumsum(0)), dtype=torch.int32)
    total = int(cu_padded[-1])

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    q, k, v = randn(total, args.heads, args.head_dim), randn(total, args.groups, args.head_dim), \
        randn(total, args.groups, args.head_dim)
    upstream = torch.zeros(total, args.heads, args.head_dim)
    for start, length in zip(cu_padded[:-1].tolist(), lengths):
        upstream[start:start + length] = torch.randn(length, args.heads, args.head_dim, generator=generator)
    return q, k, v, upstream.to(device), cu, cu_padded, lengths


def dense_reference(q, k, v, cu_padded, lengths, scale):
    """float64 causal attention per sequence (its real tokens), zeros on padding; differentiable."""
    heads, groups = q.size(1), k.size(1)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    pieces, rows = [], []
    for start, length in zip(cu_padded[:-1].tolist(), lengths):
        if not length:
            continue
        qs, ks, vs = (t[start:start + length].double() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(heads // groups, 1), vs.repeat_interleave(heads // groups, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        pieces.append(torch.einsum("hqk,khd->qhd", probs, vs))
        rows.append(torch.arange(start, start + length, device=q.device))
    return out.index_put((torch.cat(rows),), torch.cat(pieces))


@contextlib.contextmanager
def kernel_for(device: torch.device):
    """torch's varlen_attn on CUDA; on CPU (the dry run) the float64 stand-in in its place."""
    if device.type == "cuda":
        yield "torch.nn.attention.varlen.varlen_attn"
        return
    from megatron_grpo.ops.torch_varlen import substitute_kernel
    from megatron_grpo.testing.varlen_reference import varlen_attn

    with substitute_kernel(varlen_attn):
        yield "testing/varlen_reference.py (CPU dry run: torch's kernel needs CUDA)"


def bench_numerics(args, device: torch.device, report: Report) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_grpo.ops.context_parallel import packed_local_positions
    from megatron_grpo.ops.torch_varlen import packed_varlen_attention, varlen_over_gathered
    from megatron_grpo.ops.varlen_attention import packed_causal_attention

    q, k, v, upstream, cu, cu_padded, lengths = packed_row(args, device)
    scale = 1.0 / math.sqrt(args.head_dim)
    longest = max(lengths)
    segments = torch.diff(cu_padded)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
                             cu_seqlens_q_padded=cu_padded.to(device), cu_seqlens_kv_padded=cu_padded.to(device),
                             max_seqlen_q=int(segments.max()), max_seqlen_kv=int(segments.max()))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = dense_reference(*leaves, cu_padded, lengths, scale)
    (ref * upstream.double()).sum().backward()
    ref_out, ref_grads = ref.detach(), [t.grad.detach().double() for t in leaves]
    allowed = {"output": bound(ROUNDINGS["output"], longest), "grad": bound(ROUNDINGS["grad"], longest)}
    raw = dict(shape=dict(tokens=int(cu_padded[-1]), sequences=len(lengths), longest=longest, heads=args.heads,
                          groups=args.groups, head_dim=args.head_dim),
               bounds=allowed, roundings=ROUNDINGS)
    setting = (f"{len(lengths)} sequences, {int(cu_padded[-1])} tokens (longest {longest}), {args.heads} heads / "
               f"{args.groups} groups x {args.head_dim}, bf16, vs float64")
    outputs = {}
    with kernel_for(device) as kernel_name:
        raw["kernel"] = kernel_name
        runs = {"torch_varlen": lambda *x: packed_varlen_attention(*x, params, scale),
                "local": lambda *x: packed_causal_attention(*x, params, scale)}
        for name, run in runs.items():
            inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = run(*inputs)
            (out.float() * upstream).sum().backward()
            ratios = {"output": error_ratio(out, ref_out, allowed["output"])}
            for grad_name, tensor, want in zip("qkv", inputs, ref_grads):
                ratios[f"d{grad_name}"] = error_ratio(tensor.grad, want, allowed["grad"])
            outputs[name] = out.detach()

            def step(run=run):
                x = [t.detach().requires_grad_() for t in (q, k, v)]
                (run(*x).float() * upstream).sum().backward()

            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            seconds = bench_gpu.timed(step, device, args.warmup, args.repeats)
            peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
            worst = max(ratios.values())
            raw[name] = dict(ratios=ratios, worst=worst, holds=worst <= 1.0, fwd_bwd_seconds=seconds,
                             peak_extra_bytes=peak)
            report.rows.append(Row("attention numerics", f"{name}: {setting}",
                                   ", ".join(f"{key} {value:.3f}" for key, value in ratios.items())
                                   + f" of the bound; fwd+bwd {seconds * 1e3:.2f} ms"
                                   + (f", peak extra {peak / 2**20:,.0f} MiB" if peak is not None else ""),
                                   target="<= 1 (bound: ULPS (sqrt(r) eps_bf16 + sqrt(L) eps_fp32))",
                                   verdict="met" if worst <= 1.0 else "not met"))
        difference = error_ratio(outputs["torch_varlen"], outputs["local"].double(), 2 * allowed["output"])
        raw["varlen_vs_local_output"] = difference
        local_time, varlen_time = raw["local"]["fwd_bwd_seconds"], raw["torch_varlen"]["fwd_bwd_seconds"]
        raw["local_over_varlen_time"] = local_time / varlen_time if varlen_time else None
        report.rows.append(Row("attention numerics", "torch_varlen vs local output (each within its bound of float64)",
                               f"{difference:.3f} of the two bounds' sum; time local / torch_varlen "
                               f"{raw['local_over_varlen_time']:.2f}x", target="<= 1",
                               verdict="met" if difference <= 1.0 else "not met"))

        # CP = 2 on one device: every rank's chunks against the rank-ordered gathered K / V.
        cp = 2
        positions = [packed_local_positions(cu_padded, r, cp).to(device) for r in range(cp)]
        gathered = torch.cat(positions)
        real = torch.zeros(q.size(0), dtype=torch.bool, device=device)
        for start, length in zip(cu_padded[:-1].tolist(), lengths):
            real[start:start + length] = True
        cp_ratios = {}
        for rank in range(cp):
            local_q = q[positions[rank]].detach().requires_grad_()
            out = varlen_over_gathered(local_q, k[gathered], v[gathered], params, scale, rank, cp)
            (out.float() * upstream[positions[rank]]).sum().backward()
            keep = real[positions[rank]]
            cp_ratios[f"rank {rank} output"] = error_ratio(out[keep], ref_out[positions[rank]][keep],
                                                           allowed["output"])
            cp_ratios[f"rank {rank} dq"] = error_ratio(local_q.grad, ref_grads[0][positions[rank]], allowed["grad"])
        worst = max(cp_ratios.values())
        raw["context_parallel"] = dict(cp=cp, ratios=cp_ratios, worst=worst, holds=worst <= 1.0)
        report.rows.append(Row("attention numerics", f"torch_varlen under CP = {cp} (each rank's chunks on one device, "
                                                     "bottom-right causal over the gathered keys)",
                               ", ".join(f"{key} {value:.3f}" for key, value in cp_ratios.items()) + " of the bound",
                               target="<= 1", verdict="met" if worst <= 1.0 else "not met"))
    report.raw["numerics"] = raw
    if not (raw["torch_varlen"]["holds"] and raw["context_parallel"]["holds"]):
        raise AssertionError(f"torch_varlen outside its bf16 bound: worst {raw['torch_varlen']['worst']:.3f} "
                             f"(CP {raw['context_parallel']['worst']:.3f}) of the bound")


def bench_train(args, device: torch.device, report: Report, peak_tflops: Optional[float]) -> None:
    """bench_gpu's train section, packed, once per backend."""
    raw = {}
    for backend in ("local", "torch_varlen"):
        sub = Report(device=report.device)
        train_args = argparse.Namespace(**vars(args))
        train_args.backend, train_args.train_modes = backend, "packed"
        with kernel_for(device) if backend == "torch_varlen" else contextlib.nullcontext():
            bench_gpu.bench_train(train_args, device, torch.bfloat16, sub, peak_tflops)
        figures = sub.raw["train_packed"]
        raw[backend] = dict(figures, mfu=figures["tflops"] / peak_tflops if peak_tflops else None)
        for row in sub.rows:
            row.section = f"train step, packed, {backend}"
            report.rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    local, varlen = raw["local"], raw["torch_varlen"]
    raw["local_over_varlen_time"] = local["seconds"] / varlen["seconds"]
    memory = (f"; peak memory {local['peak_memory'] / 2**30:.2f} vs {varlen['peak_memory'] / 2**30:.2f} GiB"
              if local["peak_memory"] and varlen["peak_memory"] else "")
    report.rows.append(Row("train step, packed, per backend", "local vs torch_varlen, same batch and weights' shape",
                           f"{local['seconds']:.3f} vs {varlen['seconds']:.3f} s/step: local / torch_varlen "
                           f"{raw['local_over_varlen_time']:.2f}x{memory}"))
    report.raw["train"] = raw


DRY_RUN = dict(bench_gpu.DRY_RUN, heads=4, groups=2, head_dim=16, sequences=6)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, the stand-in as the kernel")
    parser.add_argument("--model", choices=sorted(bench_gpu.QWEN3), default="qwen3-1.7b")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--heads", type=int, default=16, help="numerics: query heads (Qwen3-1.7B)")
    parser.add_argument("--groups", type=int, default=8, help="numerics: KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=12, help="numerics: sequences in the packed row")
    parser.add_argument("--micro-batch-rows", type=int, help="default: bench_gpu's (8, or 4 under 100 GiB)")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=768)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the card (default: from its name)")
    parser.add_argument("--only", choices=list(SECTIONS), action="append", help="run only these sections")
    parser.add_argument("--json", help="also write the table and raw numbers to this file")
    args = parser.parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("bench_attention.py: no CUDA device; torch's varlen_attn runs on CUDA only. Run it on a GPU node, "
              "or pass --dry-run to check its code paths on CPU.", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.micro_batch_rows is None:
        args.micro_batch_rows = bench_gpu.default_micro_batch_rows(device)
    name, peak_tflops, _ = bench_gpu.device_peaks(device, args.peak_tflops, None)
    report = Report(device=name)
    report.raw["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    started = time.perf_counter()
    runners = {"numerics": lambda: bench_numerics(args, device, report),
               "train": lambda: bench_train(args, device, report, peak_tflops)}
    for section in [s for s in SECTIONS if s in (args.only or SECTIONS)]:
        report.raw["running"] = section
        report.write_json(args.json, args)
        try:
            runners[section]()
            status = "done"
        except Exception as exc:  # noqa: BLE001 - one broken section must not cost the other its figures
            report.raw.setdefault("errors", {})[section] = f"{type(exc).__name__}: {exc}"[:500]
            report.rows.append(Row(SECTIONS[section], "failed", f"{type(exc).__name__}: {exc}"[:300]))
            status = f"FAILED ({type(exc).__name__}: {exc})"
            bench_gpu._release_after_failure(device)
        print(f"{SECTIONS[section]} {status} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        report.raw["wall_seconds"] = time.perf_counter() - started
        report.raw.pop("running")
        report.write_json(args.json, args)
    print(report.markdown())
    from megatron_grpo.launch.distributed import shutdown

    shutdown(idle_timeout_s=1.0)
    return 1 if report.raw.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
