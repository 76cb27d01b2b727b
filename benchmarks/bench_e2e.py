"""End-to-end GRPO throughput: our trainer vs TRL's GRPOTrainer, side by side in one run (CPU).

    python benchmarks/bench_e2e.py                     # tiny_cpu shape, 2 warm-up + 5 measured iterations
    python benchmarks/bench_e2e.py --shape small       # a wider/deeper Qwen3 (more compute per token)
    python benchmarks/bench_e2e.py --profile out/      # + a cProfile of ours (separate, untimed run)
    python benchmarks/bench_e2e.py --quick             # seconds: a smoke run (CI)
    python benchmarks/bench_e2e.py --setup-trl         # make build/bench-trl-venv (trl beside .venv)

What is compared. One GRPO iteration = generate n responses for each of B prompts, score them with
the synthetic reward, compute group advantages, compute old log-probs, and take B/M optimizer steps
(mini-batches of M prompts x n responses), then (ours) sync the weights to the rollout engine.
Both sides start from the SAME HF folder (a Qwen3 initialised from the seed, saved with the
synthetic task's 24-token tokenizer), see the same prompt distribution (data/synthetic.py, chat
template), sample with temperature 1 up to the same response length, use the same reward
(rewards/synthetic.py), group-normalised advantages, token-mean loss, clip 0.2, no KL, AdamW
(same lr, betas, eps, weight decay, grad clip 1.0), fp32 on CPU with the same torch thread count.
TRL: GRPOConfig(use_cpu=True, bf16=False, per_device_train_batch_size=M*n,
steps_per_generation=B/M, num_generations=n, loss_type="dapo", beta=0). Ours: the tiny_cpu recipe
with model.path pointing at the folder and the same sizes, driven step by step through
trainer.loop.grpo_step.

What is measured. Each side runs in its own process (`--worker`), W warm-up iterations then K
measured ones. Throughput = (prompt + response tokens of the measured iterations) / their wall
time: every token counted was generated or fed to the policy, then trained on. "gen tok/s" counts
response tokens only. Peak RSS is the process's VmHWM (kernel high-water mark of resident memory)
at the end, so it includes imports, model, optimizer, generation and training. With --repeats R
the sides alternate R times and the medians are reported (timings on shared CPUs are noisy).

TRL comes from another interpreter when it is not importable here: --trl-python, else
build/bench-trl-venv/bin/python (made by --setup-trl: a venv layered on this one, with trl and its
extra dependencies installed into it, so this environment is not changed). Without TRL the TRL
side is skipped with a message and only ours is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRL_VENV = REPO / "build" / "bench-trl-venv"
REQUIREMENTS = Path(__file__).resolve().parent / "requirements-bench.txt"

# HF config overrides (model_type qwen3). "tiny" is recipes/tiny_cpu.yaml's model.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, max_position_embeddings=128, tie_word_embeddings=True),
}


@dataclass
class Settings:
    shape: str = "tiny"
    prompts: int = 16          # B: prompts per iteration (data.train_batch_size)
    n: int = 8                 # responses per prompt
    mini_prompts: int = 8      # M: prompts per optimizer step (actor.ppo_mini_batch_size)
    response_length: int = 16  # max new tokens
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 2            # W iterations, not timed
    iterations: int = 5        # K timed iterations
    threads: int = 1           # torch threads, both sides (1 = robust to shared, loaded CPUs)
    seed: int = 1
    # ours only: rollout.max_staleness (> 0: the local engine generates the next batches in its own
    # process, on rollout.local.threads=1 more thread, while the trainer trains)
    max_staleness: int = 0


@dataclass
class Result:
    system: str
    iteration_seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)            # prompt + response tokens per iteration
    response_tokens: list[int] = field(default_factory=list)
    peak_rss: int = 0                                          # bytes, VmHWM
    phases: dict[str, float] = field(default_factory=dict)     # ours: mean seconds per phase
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / sum(self.iteration_seconds)

    @property
    def gen_tokens_per_s(self) -> float:
        return sum(self.response_tokens) / sum(self.iteration_seconds)

    @property
    def seconds_per_iteration(self) -> float:
        return statistics.median(self.iteration_seconds)


def peak_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def children_peak_rss_bytes() -> int:
    """The largest finished child's peak RSS (ours async: the engine process, closed by then)."""
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale


# ----- the shared starting point ---------------------------------------------------------------
def write_model_folder(settings: Settings, folder: Path) -> Path:
    """An HF Qwen3 folder initialised from the seed, with the synthetic tokenizer (both sides load it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megatron_grpo.data.synthetic import build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(folder.with_name(folder.name + "_tokenizer")))
    config = AutoConfig.for_model("qwen3", **SHAPES[settings.shape], vocab_size=len(tokenizer))
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(settings.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def synthetic_records(settings: Settings, count: int = 4096):
    from megatron_grpo.data.synthetic import SyntheticTaskConfig, generate_records

    # recipes/tiny_cpu.yaml: task reverse, 3-5 digits
    return generate_records(SyntheticTaskConfig(task="reverse", min_digits=3, max_digits=5), count=count,
                            seed=settings.seed, split="train")


# ----- ours ------------------------------------------------------------------------------------
def our_overrides(settings: Settings, model_dir: Path, output_dir: Path) -> list[str]:
    return [f"model.path={model_dir}", f"trainer.total_steps={settings.warmup + settings.iterations}",
            f"trainer.seed={settings.seed}", f"logging.output_dir={output_dir}", "logging.console=false",
            "logging.plot=false", f"data.train_batch_size={settings.prompts}", f"rollout.n={settings.n}",
            f"data.max_response_length={settings.response_length}",
            f"actor.ppo_mini_batch_size={settings.mini_prompts}", f"actor.optim.lr={settings.lr}",
            f"actor.optim.weight_decay={settings.weight_decay}", "actor.grad_clip=1.0", "actor.use_kl_loss=false",
            "trainer.device=cpu", "model.dtype=float32", f"rollout.max_staleness={settings.max_staleness}"]


def run_ours(settings: Settings, model_dir: Path, work: Path, profile: Path | None = None) -> Result:
    import torch

    torch.set_num_threads(settings.threads)
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.loop import grpo_step
    from megatron_grpo.trainer.rollouts.rollout_pipeline import RolloutPipeline
    from megatron_grpo.trainer.setup import build_run

    cfg = load_config("tiny_cpu", our_overrides(settings, model_dir, work / "ours"))
    run = build_run(cfg)
    pipeline = None  # as trainer/loop.py's train() builds it
    if settings.max_staleness > 0:
        pipeline = RolloutPipeline(run, run.settings.rollout, start_step=0,
                                   max_staleness=settings.max_staleness).start()
    result = Result("ours")
    phases: dict[str, list[float]] = {}
    profiler = None
    try:
        for step in range(1, settings.warmup + settings.iterations + 1):
            measured = step > settings.warmup
            if measured and profile is not None and profiler is None:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            start = time.perf_counter()
            metrics = grpo_step(run, step, pipeline)
            seconds = time.perf_counter() - start
            if not measured:
                continue
            result.iteration_seconds.append(seconds)
            result.tokens.append(round(metrics["perf/tokens_per_s"] * metrics["time/step"]))
            result.response_tokens.append(round(metrics["response/length_mean"] * settings.prompts * settings.n))
            for key in ("time/rollout", "time/reward", "time/logprob", "time/train", "time/sync"):
                phases.setdefault(key, []).append(metrics.get(key, 0.0))
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(profile))
    finally:
        if pipeline is not None:
            pipeline.close()
        run.close()
    # time/rollout includes time/reward (collect_rollout_batch); report generation alone.
    result.phases = {k: statistics.mean(v) for k, v in phases.items()}
    result.phases["time/rollout"] -= result.phases.get("time/reward", 0.0)
    result.phases["time/other"] = statistics.mean(result.iteration_seconds) - sum(
        v for k, v in result.phases.items())
    result.versions = {"torch": torch.__version__}
    return result


# ----- TRL -------------------------------------------------------------------------------------
def run_trl(settings: Settings, model_dir: Path, work: Path, profile: Path | None = None) -> Result:
    import torch

    torch.set_num_threads(settings.threads)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_grpo.rewards.synthetic import reward as synthetic_reward

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    records = synthetic_records(settings)
    dataset = Dataset.from_list([{"prompt": r.prompt, "ground_truth": r.ground_truth} for r in records])
    prompt_lengths: dict[str, int] = {}
    batches: list[tuple[int, int]] = []  # per generation batch: (prompt + response tokens, response tokens)

    def prompt_length(messages) -> int:
        key = json.dumps(messages)
        if key not in prompt_lengths:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompt_lengths[key] = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return prompt_lengths[key]

    def reward_fn(prompts, completions, completion_ids, ground_truth, **_):
        response = sum(len(ids) for ids in completion_ids)
        batches.append((response + sum(prompt_length(p) for p in prompts), response))
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [synthetic_reward("", text, gt)["score"] for text, gt in zip(texts, ground_truth)]

    steps_per_generation = settings.prompts // settings.mini_prompts
    step_times: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            step_times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_times.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(work / "trl"), use_cpu=True, bf16=False, fp16=False, seed=settings.seed,
        per_device_train_batch_size=settings.mini_prompts * settings.n, gradient_accumulation_steps=1,
        steps_per_generation=steps_per_generation, num_generations=settings.n, num_iterations=1,
        max_completion_length=settings.response_length, temperature=1.0, top_p=1.0,
        learning_rate=settings.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=settings.weight_decay,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        max_steps=(settings.warmup + settings.iterations) * steps_per_generation,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    profiler = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    trainer.train()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(str(profile))
    result = Result("TRL")
    ends = step_times[steps_per_generation::steps_per_generation]  # end of each iteration
    starts = step_times[:-1:steps_per_generation]
    for index in range(settings.warmup, settings.warmup + settings.iterations):
        result.iteration_seconds.append(ends[index] - starts[index])
        result.tokens.append(batches[index][0])
        result.response_tokens.append(batches[index][1])
    result.versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    return result


# ----- orchestration ---------------------------------------------------------------------------
def find_trl_python(explicit: str | None) -> str | None:
    """An interpreter that can import trl (and megatron_grpo), or None."""
    if explicit == "none":
        return None
    candidates = [explicit] if explicit else [sys.executable, str(TRL_VENV / "bin" / "python")]
    for python in candidates:
        if python and Path(python).exists():
            probe = subprocess.run([python, "-c", "import trl, megatron_grpo"], capture_output=True)
            if probe.returncode == 0:
                return python
    return None


def layered_venv(folder: Path, pip_args: list[str]) -> Path:
    """A venv at `folder` that sees this environment's packages through a .pth file and gets
    `pip install <pip_args>` into itself, so this environment stays as it is; its python."""
    import site
    import venv

    venv.EnvBuilder(with_pip=True, clear=False).create(folder)
    python = folder / "bin" / "python"
    child_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    base_site = site.getsitepackages()[0]
    Path(child_site, "_mgrpo_base_venv.pth").write_text(f"import site; site.addsitedir({base_site!r})\n")
    subprocess.run([str(python), "-m", "pip", "install", *pip_args], check=True)
    return python


def setup_trl_venv() -> Path:
    """build/bench-trl-venv: trl and its extra dependencies beside this environment."""
    return layered_venv(TRL_VENV, ["-r", str(REQUIREMENTS)])


def run_worker(python: str, system: str, settings: Settings, model_dir: Path, work: Path,
               profile: Path | None = None) -> Result:
    out = work / f"{system}-{time.monotonic_ns()}.json"
    cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--settings", json.dumps(asdict(settings)),
           "--model-dir", str(model_dir), "--work", str(work), "--result", str(out)]
    if profile is not None:
        cmd += ["--profile-out", str(profile)]
    env = dict(os.environ, OMP_NUM_THREADS=str(settings.threads), TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error", HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    data = json.loads(out.read_text())
    return Result(**data)


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def table(ours: list[Result], trl: list[Result], settings: Settings, trl_note: str | None) -> str:
    def med(results, attr):
        return statistics.median(getattr(r, attr) for r in results)

    rows = ["| system | tokens/s (prompt+response) | generated tokens/s | s / iteration | peak RSS |",
            "|---|---:|---:|---:|---:|"]
    o = {a: med(ours, a) for a in ("tokens_per_s", "gen_tokens_per_s", "seconds_per_iteration", "peak_rss")}
    rows.append(f"| ours (megatron-grpo) | {o['tokens_per_s']:,.0f} | {o['gen_tokens_per_s']:,.0f} | "
                f"{o['seconds_per_iteration']:.3f} | {fmt_bytes(o['peak_rss'])} |")
    if trl:
        t = {a: med(trl, a) for a in ("tokens_per_s", "gen_tokens_per_s", "seconds_per_iteration", "peak_rss")}
        rows.append(f"| TRL GRPOTrainer {trl[0].versions.get('trl', '')} | {t['tokens_per_s']:,.0f} | "
                    f"{t['gen_tokens_per_s']:,.0f} | {t['seconds_per_iteration']:.3f} | {fmt_bytes(t['peak_rss'])} |")
        rows.append(f"| **ours / TRL** | **{o['tokens_per_s'] / t['tokens_per_s']:.2f}x** | "
                    f"{o['gen_tokens_per_s'] / t['gen_tokens_per_s']:.2f}x | "
                    f"{o['seconds_per_iteration'] / t['seconds_per_iteration']:.2f}x | "
                    f"{o['peak_rss'] / t['peak_rss']:.2f}x |")
    text = "\n".join(rows)
    phases = {k: statistics.median(r.phases[k] for r in ours) for k in ours[0].phases}
    total = sum(phases.values())
    text += "\n\nOurs, seconds per iteration by phase: " + ", ".join(
        f"{k.split('/')[1]} {v:.3f} ({100 * v / total:.0f}%)" for k, v in phases.items())
    text += (f"\n\nSettings: Qwen3 shape '{settings.shape}' ({SHAPES[settings.shape]['hidden_size']} hidden, "
             f"{SHAPES[settings.shape]['num_hidden_layers']} layers), {settings.prompts} prompts x n={settings.n}, "
             f"<= {settings.response_length} new tokens, {settings.prompts // settings.mini_prompts} optimizer "
             f"steps/iteration (mini-batch {settings.mini_prompts} prompts), AdamW lr {settings.lr}, fp32, "
             f"{settings.threads} torch threads, {settings.warmup} warm-up + {settings.iterations} measured "
             f"iterations, medians of {len(ours)} run(s); {os.cpu_count()} CPUs visible.")
    if settings.max_staleness:
        text += (f" Ours asynchronous (rollout.max_staleness={settings.max_staleness}): the engine generates in a "
                 "process of its own on one more thread while the trainer trains; its peak RSS is added to ours.")
    if trl_note:
        text += f"\n\n{trl_note}"
    return text


def profile_summary(path: Path, limit: int = 25) -> str:
    import io
    import pstats

    buffer = io.StringIO()
    stats = pstats.Stats(str(path), stream=buffer)
    stats.strip_dirs().sort_stats("cumulative").print_stats(limit)
    buffer.write("\n--- by own time ---\n")
    stats.sort_stats("tottime").print_stats(limit)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--prompts", type=int, default=Settings.prompts)
    parser.add_argument("--n", type=int, default=Settings.n)
    parser.add_argument("--mini-prompts", type=int, default=Settings.mini_prompts)
    parser.add_argument("--response-length", type=int, default=Settings.response_length)
    parser.add_argument("--warmup", type=int, default=Settings.warmup)
    parser.add_argument("--iterations", type=int, default=Settings.iterations)
    parser.add_argument("--threads", type=int, default=Settings.threads)
    parser.add_argument("--max-staleness", type=int, default=Settings.max_staleness,
                        help="ours: rollout.max_staleness (async GRPO; the engine gets its own process and thread)")
    parser.add_argument("--repeats", type=int, default=1, help="alternate ours/TRL this many times; medians")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1+2 iterations: a smoke run")
    parser.add_argument("--trl-python", help="interpreter with trl; 'none' = ours only")
    parser.add_argument("--setup-trl", action="store_true", help="create build/bench-trl-venv and exit")
    parser.add_argument("--profile", type=Path, help="folder: cProfile ours (and TRL) in extra untimed runs")
    parser.add_argument("--json", type=Path, help="also write all results as JSON")
    # internal: one side in this process
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        settings = Settings(**json.loads(args.settings))
        fn = run_ours if args.worker == "ours" else run_trl
        result = fn(settings, args.model_dir, args.work, args.profile_out)
        result.peak_rss = peak_rss_bytes() + children_peak_rss_bytes()
        args.result.write_text(json.dumps(asdict(result)))
        return 0
    if args.setup_trl:
        print(f"TRL interpreter: {setup_trl_venv()}")
        return 0

    settings = Settings(shape=args.shape, prompts=args.prompts, n=args.n, mini_prompts=args.mini_prompts,
                        response_length=args.response_length, warmup=args.warmup, iterations=args.iterations,
                        threads=args.threads, max_staleness=args.max_staleness)
    if args.quick:
        settings = replace(settings, shape="tiny", prompts=4, n=4, mini_prompts=2, response_length=8,
                           warmup=1, iterations=2)
    if settings.prompts % settings.mini_prompts:
        parser.error("--prompts must be a multiple of --mini-prompts")
    trl_python = find_trl_python(args.trl_python)
    trl_note = None
    if trl_python is None:
        trl_note = ("TRL side skipped: trl is not importable (run `python benchmarks/bench_e2e.py --setup-trl`, "
                    "or pass --trl-python PATH)." if args.trl_python != "none"
                    else "TRL side skipped (--trl-python none).")
        print(trl_note, file=sys.stderr)

    ours: list[Result] = []
    trl: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        work = Path(tmp)
        model_dir = write_model_folder(settings, work / "model")
        for repeat in range(args.repeats):
            print(f"[{repeat + 1}/{args.repeats}] ours ...", file=sys.stderr, flush=True)
            ours.append(run_worker(sys.executable, "ours", settings, model_dir, work))
            if trl_python:
                print(f"[{repeat + 1}/{args.repeats}] TRL ...", file=sys.stderr, flush=True)
                trl.append(run_worker(trl_python, "trl", settings, model_dir, work))
        print(table(ours, trl, settings, trl_note))
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            run_worker(sys.executable, "ours", settings, model_dir, work, profile=args.profile / "ours.prof")
            if trl_python:
                run_worker(trl_python, "trl", settings, model_dir, work, profile=args.profile / "trl.prof")
            print(f"\n## cProfile of ours ({settings.iterations} measured iterations; {args.profile / 'ours.prof'})\n")
            print("```\n" + profile_summary(args.profile / "ours.prof") + "```")
    if args.json:
        args.json.write_text(json.dumps({"settings": asdict(settings), "ours": [asdict(r) for r in ours],
                                         "trl": [asdict(r) for r in trl]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
