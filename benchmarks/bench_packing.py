"""Sequence packing vs padding on one GRPO update (CPU): useful-token fraction, step time, peak memory.

    python benchmarks/bench_packing.py --data data/gsm8k/train.jsonl            # the measured run
    python benchmarks/bench_packing.py --data data/gsm8k/train.jsonl --json out.json
    python benchmarks/bench_packing.py --data data/gsm8k/train.jsonl --quick    # seconds: a smoke run

`--data` is required: the GSM8K train split in its original jsonl form (one {"question", "answer"}
object per line, as openai/gsm8k ships it); the repository carries no copy of it.

The batch. P prompts drawn at random (seed) from the file, n = 5 responses each: a sequence is the
prompt (the question followed by the instruction of tools/prepare_gsm8k.py) and the reference
answer as the response, cut at max_response_length = 1024. Lengths are counted by a real tokenizer
when --tokenizer names an HF tokenizer folder (or `qwen`: Qwen's own, built offline from its BPE
ranks), else by the proxy tokens = ceil(characters / 4) (the JSON's "length_unit" says which). Token ids are
random (the step's cost does not depend on their values).

The step. The Qwen3-shaped `small` model of bench_e2e.py (4 layers, hidden 256, 8 heads, 4 KV
heads, head_dim 32; max_position_embeddings raised to 2048, which only sizes RoPE tables; the
vocabulary of bench_e2e's tokenizer) built by models.build_model (megatron-core local spec), fp32,
megatron DDP + distributed optimizer, one process. One step = trainer.batches.micro_batches.plan + one
trainer.step.train_step.train_on_mini_batch over the whole batch as one mini-batch (forward, GRPO loss
on vocab-parallel log-probs and entropy, backward, AdamW): exactly what the trainer runs.
Modes, all on the same samples and budget:
  packed        actor.packing=true (the default): THD rows of <= max_tokens tokens;
  padded        actor.packing=false: right-padded rows, rows x longest <= max_tokens (the
                trainer before packing, same token budget);
  padded-fixed  verl's layout without dynamic batch size: ppo_micro_batch_size_per_gpu sequences
                per micro-batch in batch order, padded to the longest (reported, not a target).

Measured. useful fraction = prompt + response tokens / tokens the model runs over. Step time =
median over the measured steps after warm-up (torch threads fixed, 1 by default: robust on shared
CPUs). Peak memory = the rise of the process's resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs before the measured steps) over its resident set just before them: what the
step itself adds (activations, attention scores, gradients' temporaries); each mode runs in a fresh
process. speedup = padded step time / packed step time; peak_mem_ratio = packed / padded peak.
Targets (the issue's): packed useful fraction >= 0.95 and speedup >= 1.5.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # tools/prepare_gsm8k.py
TARGETS = {"packed_useful_frac": 0.95, "speedup": 1.5}
MODES = ("packed", "padded", "padded-fixed")


@dataclass(frozen=True)
class Settings:
    data: str
    tokenizer: str | None = None
    prompts: int = 32                 # P
    n: int = 5
    max_response_length: int = 1024
    max_tokens: int = 16384           # actor.max_tokens_per_micro_batch (the recipe default)
    fixed_micro_batch: int = 8        # padded-fixed: sequences per micro-batch
    warmup: int = 1
    steps: int = 3
    threads: int = 1
    seed: int = 0
    shape: str = "small"


# ----- the length distribution -----------------------------------------------------------------
def gsm8k_lengths(path: str, tokenizer: str | None = None) -> tuple[list[tuple[int, int]], str]:
    """(prompt tokens, response tokens) of every record, and the unit they are counted in."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                records.append((f"{obj['question']} {INSTRUCTION}", obj["answer"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SystemExit(f"error: {path}:{line_number}: "
                                 "expected a JSON object with 'question' and 'answer'") from None
    if not records:
        raise SystemExit(f"error: {path}: no records")
    if tokenizer is None:
        count = lambda text: max(1, math.ceil(len(text) / 4))  # noqa: E731
        unit = "proxy: ceil(characters / 4)"
    else:
        from transformers import AutoTokenizer

        if tokenizer == "qwen":  # Qwen's real BPE, built offline (scripts/install_qwen_vocab.sh)
            from megatron_grpo.testing.qwen_tokenizer import build_qwen_tokenizer

            tokenizer = str(build_qwen_tokenizer())
        tok = AutoTokenizer.from_pretrained(tokenizer)
        count = lambda text: max(1, len(tok(text, add_special_tokens=False)["input_ids"]))  # noqa: E731
        unit = f"tokenizer {tokenizer}"
    return [(count(prompt), count(answer)) for prompt, answer in records], unit


def make_samples(lengths: list[tuple[int, int]], settings: Settings, vocab_size: int):
    """P random prompts x n responses (the reference answer's length, cut at max_response_length)."""
    from megatron_grpo.trainer.batches.batching import TrainSample

    rng = random.Random(settings.seed)
    samples = []
    for prompt_len, response_len in rng.sample(lengths, settings.prompts):
        prompt = [rng.randrange(vocab_size) for _ in range(prompt_len)]
        for _ in range(settings.n):
            response = [rng.randrange(vocab_size) for _ in range(min(response_len, settings.max_response_length))]
            samples.append(TrainSample(prompt_ids=prompt, response_ids=response, advantage=rng.uniform(-1, 1)))
    return samples


# ----- the step (also what bench_gpu.py calls for its packed step) ------------------------------
def step_inputs(samples, *, packing: bool = True, max_tokens: int | None = None, micro_batch_size: int | None = None,
                model_config=None, loss_scale_factor: float | None = None):
    """(micro-batches, GlobalBatchInfo) of one mini-batch holding every sample, for this rank under
    megatron's current parallel state, as the trainer plans them (trainer.batches.micro_batches.plan)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.algo import GlobalBatchInfo
    from megatron_grpo.trainer.batches.micro_batches import MicroBatching, ParallelShape, attention_cost_weight, plan

    batching = MicroBatching(packing=packing, max_tokens=max_tokens, micro_batch_size=micro_batch_size,
                             mini_batch_size=len(samples),
                             attention_weight=attention_cost_weight(model_config) if model_config else 0.0)
    shape = ParallelShape.current(sequence_parallel=False)
    micro_batches = plan(samples, batching, shape)[0]
    counts = torch.cat([mb.row_token_counts for mb in micro_batches])
    totals = torch.tensor([int(counts.sum()), int((counts > 0).sum())], dtype=torch.int64)
    if shape.dp_size > 1:
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
    info = GlobalBatchInfo(num_valid_tokens=int(totals[0]), num_sequences=int(totals[1]),
                           dp_size=shape.dp_size * shape.cp_size, loss_scale_factor=loss_scale_factor,
                           framework_loss_divisor=len(micro_batches) / shape.cp_size)
    return micro_batches, info


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS


def run_mode(rank, world_size, mode: str, settings: Settings, lengths: list[tuple[int, int]]) -> dict:
    """One mode in this (fresh) process: warm-up and measured steps; timings and memory."""
    import torch

    torch.set_num_threads(settings.threads)
    from bench_e2e import SHAPES
    from megatron_grpo.algo import GRPOLossConfig
    from megatron_grpo.launch import ParallelLayout, initialize_model_parallel
    from megatron_grpo.models import ModelArchitecture, build_model
    from megatron_grpo.trainer.assembly.optimizer import OptimizerSettings, build_optimizer, wrap_with_ddp
    from megatron_grpo.trainer.step.train_step import train_on_mini_batch

    vocab = 24  # bench_e2e's model folder: the synthetic task's tokenizer
    hf = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=vocab, rms_norm_eps=1e-6,
              rope_theta=1000000.0, attention_bias=False, attention_dropout=0.0, hidden_act="silu",
              initializer_range=0.02, **dict(SHAPES[settings.shape], max_position_embeddings=2048))
    layout = ParallelLayout()
    initialize_model_parallel(layout, seed=settings.seed)
    mc = ModelArchitecture.from_hf(hf)
    chunks = build_model(mc, layout)
    policy = wrap_with_ddp(chunks, use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(policy, OptimizerSettings(lr=1e-6, grad_clip=1.0, use_distributed_optimizer=True))
    samples = make_samples(lengths, settings, vocab)
    budget = dict(packed=dict(packing=True, max_tokens=settings.max_tokens),
                  padded=dict(packing=False, max_tokens=settings.max_tokens),
                  **{"padded-fixed": dict(packing=False, micro_batch_size=settings.fixed_micro_batch)})[mode]

    def step():
        micro_batches, info = step_inputs(samples, model_config=mc, loss_scale_factor=settings.max_response_length,
                                          **budget)
        metrics = train_on_mini_batch(policy, optimizer, micro_batches, loss_config=GRPOLossConfig(),
                                      batch_info=info, temperature=1.0, vocab_size=mc.vocab_size,
                                      device=torch.device("cpu"), need_entropy=True)
        return micro_batches, metrics

    for _ in range(settings.warmup):
        step()
    rss_before = _rss_bytes("VmRSS")
    _reset_peak_rss()
    seconds = []
    for _ in range(settings.steps):
        start = time.perf_counter()
        micro_batches, metrics = step()
        seconds.append(time.perf_counter() - start)
    return dict(mode=mode, seconds=seconds, step_seconds=statistics.median(seconds),
                peak_step_bytes=_rss_bytes("VmHWM") - rss_before, peak_rss_bytes=_rss_bytes("VmHWM"),
                useful_tokens=sum(mb.useful_tokens for mb in micro_batches),
                processed_tokens=sum(mb.processed_tokens for mb in micro_batches),
                micro_batches=len(micro_batches), sequences=len(samples), loss=metrics["actor/loss"],
                grad_norm=metrics["actor/grad_norm"])


def summarize(results: dict[str, dict], settings: Settings, unit: str) -> dict:
    packed, padded = results["packed"], results["padded"]
    out = dict(settings=asdict(settings), length_unit=unit,
               packed_useful_frac=packed["useful_tokens"] / packed["processed_tokens"],
               padded_useful_frac=padded["useful_tokens"] / padded["processed_tokens"],
               speedup=padded["step_seconds"] / packed["step_seconds"],
               peak_mem_ratio=packed["peak_step_bytes"] / padded["peak_step_bytes"],
               modes=results, load_average=os.getloadavg())
    if "padded-fixed" in results:
        fixed = results["padded-fixed"]
        out["padded_fixed_useful_frac"] = fixed["useful_tokens"] / fixed["processed_tokens"]
        out["speedup_vs_padded_fixed"] = fixed["step_seconds"] / packed["step_seconds"]
        out["peak_mem_ratio_vs_padded_fixed"] = packed["peak_step_bytes"] / fixed["peak_step_bytes"]
    out["targets"] = {key: dict(value=out[key], target=f">= {bound}", met=out[key] >= bound)
                      for key, bound in TARGETS.items()}
    return out


def table(summary: dict) -> str:
    rows = ["| layout | micro-batches | useful / processed tokens | useful fraction | step (s) "
            "| step peak memory (MiB) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for mode, r in summary["modes"].items():
        rows.append(f"| {mode} | {r['micro_batches']} | {r['useful_tokens']:,} / {r['processed_tokens']:,} | "
                    f"{r['useful_tokens'] / r['processed_tokens']:.3f} | {r['step_seconds']:.2f} | "
                    f"{r['peak_step_bytes'] / 2 ** 20:,.0f} |")
    rows.append("")
    rows.append(f"packed vs padded: speedup {summary['speedup']:.2f}x, peak memory {summary['peak_mem_ratio']:.2f}x"
                + (f"; vs padded-fixed: {summary['speedup_vs_padded_fixed']:.2f}x, "
                   f"{summary['peak_mem_ratio_vs_padded_fixed']:.2f}x" if "speedup_vs_padded_fixed" in summary else ""))
    for key, target in summary["targets"].items():
        rows.append(f"target {key} {target['target']}: {target['value']:.3f} ({'met' if target['met'] else 'NOT met'})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--data", required=True, help="GSM8K train split, original jsonl (question, answer)")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer folder to count tokens, or 'qwen' for Qwen's real tokenizer built offline "
                             "(scripts/install_qwen_vocab.sh); default: chars/4")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--prompts", type=int, default=Settings.prompts)
    parser.add_argument("--max-tokens", type=int, default=Settings.max_tokens)
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--warmup", type=int, default=Settings.warmup)
    parser.add_argument("--threads", type=int, default=Settings.threads)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--quick", action="store_true", help="4 prompts, tiny model, 1 step (a smoke run)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.data):
        print(f"error: --data {args.data}: no such file (the GSM8K train split, original jsonl)", file=sys.stderr)
        return 2
    settings = Settings(data=args.data, tokenizer=args.tokenizer, prompts=args.prompts, max_tokens=args.max_tokens,
                        steps=args.steps, warmup=args.warmup, threads=args.threads)
    if args.quick:
        settings = Settings(data=args.data, tokenizer=args.tokenizer, prompts=4, max_tokens=2048, steps=1, warmup=0,
                            shape="tiny")
    modes = [m for m in MODES if m in args.modes]
    if not {"packed", "padded"} <= set(modes):
        parser.error("--modes needs at least packed and padded")
    lengths, unit = gsm8k_lengths(settings.data, settings.tokenizer)
    from megatron_grpo.testing.distributed import run_distributed

    results = {}
    for mode in modes:  # one fresh process per mode: its own memory high-water mark
        results[mode] = run_distributed(run_mode, 1, args=(mode, settings, lengths), timeout=3600)[0]
        print(f"{mode}: {results[mode]['step_seconds']:.2f} s/step", flush=True)
    summary = summarize(results, settings, unit)
    print(f"lengths: {unit}; {settings.prompts} prompts x n={settings.n}, max_response_length "
          f"{settings.max_response_length}, max_tokens {settings.max_tokens}, {settings.threads} thread(s), "
          f"load average {summary['load_average'][0]:.2f}")
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
