"""One prepared command proves the CUDA path on one GPU; `bash scripts/gpu_check.sh` drives this.

    python scripts/gpu_check.py prepare            # CPU machine with PyPI: wheels the device lacks
    python scripts/gpu_check.py run [--out DIR]    # the device: the parts below, time-boxed
    python scripts/gpu_check.py run --dry-run      # CPU, tiny shapes: the same code paths

`prepare` downloads the pinned cp312 wheels (WHEELS) into .gpu_wheels/ (git-ignored), checks their
total against WHEELS_LIMIT_MIB and prints the one device call (carry list and command). The GPU
machine has torch, transformers, safetensors, tokenizers, sentencepiece, pyyaml, pyarrow, psutil,
numpy, tqdm, sympy, triton, pytest and pytest-timeout, no network and none of WHEELS.

`run` executes the parts in order, each in its own process group under a time box, and rewrites
gpu_check.json and gpu_check.md after every part, so a part that fails or hangs leaves the others'
figures and its own name and error:
  env     versions and the device (python, torch, CUDA, megatron-core, transformers)
  pytest  pytest -m gpu tests/test_gpu.py: ops vs float64 dense torch, bf16 GPTModel vs fp32,
          local engine on the device and the training-inference log-prob mismatch
  bench   benchmarks/bench_gpu.py: train-step MFU (Qwen3-1.7B shape, padded rows), log-prob kernel
          bandwidth vs HBM and a device copy, log-prob peak memory vs dense fp32, generation
          tokens/s, and the memory planner's simulated peak of the train step vs
          torch.cuda.max_memory_allocated
  attention  benchmarks/bench_attention.py: torch's varlen_attn (model.attention_backend=torch_varlen)
          vs the local packed attention: bf16 numerics against float64 under a derived bound (CP = 2
          included), and the packed train step at the Qwen3-1.7B shape with each backend (time,
          tokens/s, MFU, peak memory side by side)
  grpo    a 10-step GRPO run of a Qwen3-0.6B-shaped random model with the local engine: invariants
          and the step-time breakdown
A part's box is its nominal seconds plus whatever earlier parts left unused, so the whole run ends
within --budget-s (480 s on the device, inside the device call's 600 s with the wheel install). The
boxes are estimates: no part has run on a GPU yet.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
WHEELS_DIR = ".gpu_wheels"
WHEELS_LIMIT_MIB = 60  # the device call carries at most 64 MiB, the working tree included
TRAVEL_LIMIT_MIB = 64
# What megatron_grpo imports at run time that the device image lacks (its package list is in the
# device notes), with their own run-time requirements; one version each (two stop the install).
WHEELS = (
    ("megatron-core", "0.19.2"),           # megatron.core (needs torch, numpy, packaging: present)
    ("math-verify", "0.9.0"),              # rewards/math_equiv.py
    ("latex2sympy2_extended", "1.11.0"),   # math-verify's parser (needs sympy: present)
    ("antlr4-python3-runtime", "4.13.2"),  # latex2sympy2_extended's parser runtime
)
# The device's interpreter: CPython 3.12 on x86-64 manylinux (pip matches each N exactly).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
DEVICE_TIMEOUT_S = 600
DRY_RUN_ENV = "MEGATRON_GRPO_GPU_CHECK_DRY_RUN"  # tests/test_gpu.py runs on CPU when it is "1"

# Targets from the issue; the published anchor of the training-inference mismatch is vLLM / SGLang
# against an HF recompute at 4B parameters in bf16.
MISMATCH_ANCHOR = "0.011-0.012 (vLLM/SGLang vs HF recompute, 4B, bf16)"


class CheckError(Exception):
    """A one-line error of this script (prepare: exit 2)."""


# ----- prepare --------------------------------------------------------------------------------
def wheel_name_matches(filename: str, project: str, version: str) -> bool:
    """A wheel file of project==version (names normalised as in the wheel spec: - . _ alike)."""
    def norm(text: str) -> str:
        return text.lower().replace("-", "_").replace(".", "_")

    parts = filename[: -len(".whl")].split("-") if filename.endswith(".whl") else []
    return len(parts) >= 5 and norm(parts[0]) == norm(project) and parts[1] == version


def check_wheels(folder: Path, wheels=WHEELS, limit_mib: float = WHEELS_LIMIT_MIB) -> list[Path]:
    """Exactly one wheel per pinned project, nothing else, together under limit_mib; returns them."""
    files = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    found = []
    for project, version in wheels:
        matches = [f for f in files if wheel_name_matches(f.name, project, version)]
        if len(matches) != 1:
            raise CheckError(f"{folder}: expected one wheel of {project}=={version}, found "
                             f"{[m.name for m in matches] or 'none'} (run: bash scripts/gpu_check.sh --prepare)")
        found.append(matches[0])
    extra = sorted(set(files) - set(found))
    if extra:
        raise CheckError(f"{folder}: wheels outside the pinned set would be installed too: "
                         f"{[f.name for f in extra]} (remove them, or run --prepare, which does)")
    total = sum(f.stat().st_size for f in found)
    if total >= limit_mib * 2**20:
        raise CheckError(f"{folder}: the wheels take {total / 2**20:.1f} MiB, over the {limit_mib} MiB limit "
                         f"(a device call carries at most {TRAVEL_LIMIT_MIB} MiB, the working tree included)")
    return found


def pip_download_command(folder: Path, requirement: str) -> list[str]:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", *platforms, "-d", str(folder), requirement]


def travelling_bytes(repo: Path) -> int:
    """Bytes of what a device call sends besides the carried paths: tracked files and untracked
    files that git does not ignore."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                             capture_output=True, check=True).stdout.decode().split("\0")
    total = 0
    for name in filter(None, listing):
        path = repo / name
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def device_call(carry: list[str]) -> dict:
    return {"command": "bash scripts/gpu_check.sh", "timeout_s": DEVICE_TIMEOUT_S, "carry": carry}


def prepare(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    for project, version in WHEELS:
        command = pip_download_command(folder, f"{project}=={version}")
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise CheckError(f"pip download {project}=={version} failed: {tail[0]}")
    for stale in folder.glob("*.whl"):  # e.g. an older pin: two versions would stop the install
        if not any(wheel_name_matches(stale.name, p, v) for p, v in WHEELS):
            stale.unlink()
    wheels = check_wheels(folder)
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    tree = travelling_bytes(REPO)
    for wheel in wheels:
        print(f"  {wheel.name}  {wheel.stat().st_size / 2**20:.2f} MiB")
    print(f"wheels: {wheel_bytes / 2**20:.2f} MiB (limit {WHEELS_LIMIT_MIB}); working tree that travels: "
          f"{tree / 2**20:.2f} MiB; together {(tree + wheel_bytes) / 2**20:.2f} MiB of {TRAVEL_LIMIT_MIB}")
    if tree + wheel_bytes >= TRAVEL_LIMIT_MIB * 2**20:
        raise CheckError(f"the device call would carry {(tree + wheel_bytes) / 2**20:.1f} MiB, over "
                         f"{TRAVEL_LIMIT_MIB} MiB: git-ignore or remove large untracked files first")
    call = device_call([folder.relative_to(REPO).as_posix() if folder.is_relative_to(REPO) else str(folder)])
    print("device call (one run, then fetch gpu_check.json / gpu_check.md from its files):")
    print(f"  carry: {json.dumps(call['carry'])}")
    print(f"  timeout_s: {call['timeout_s']}")
    print(f"  command: {call['command']}")
    return 0


# ----- run: parts -----------------------------------------------------------------------------
@dataclass
class PartResult:
    status: str = "not run"  # ok | failed | timeout | error | not run
    seconds: float = 0.0
    box_s: float = 0.0
    error: Optional[str] = None
    figures: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)  # [check, measured, target, verdict]


@dataclass(frozen=True)
class Context:
    out: Path
    work: Path
    dry_run: bool
    python: str

    def env(self, **extra: str) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        if self.dry_run:
            env[DRY_RUN_ENV] = "1"
        return env


def run_process(command: list[str], log: Path, timeout_s: float, env: dict) -> tuple[Optional[int], float]:
    """Runs command in its own process group, output to log; returns (exit code, seconds) with
    None as the code when it was killed at timeout_s (its whole group goes)."""
    start = time.monotonic()
    with open(log, "ab") as handle:
        handle.write(f"$ {' '.join(command)}\n".encode())
        handle.flush()
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.monotonic() - start


def log_tail(log: Path, lines: int = 6) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])[-600:]


def part_env(ctx: Context, box_s: float) -> PartResult:
    code = ("import json, platform, torch\n"
            "from importlib import metadata\n"
            "def version(name):\n"
            "    try:\n        return metadata.version(name)\n"
            "    except metadata.PackageNotFoundError:\n        return None\n"
            "cuda = torch.cuda.is_available()\n"
            "props = torch.cuda.get_device_properties(0) if cuda else None\n"
            "import megatron.core, math_verify, megatron_grpo\n"
            "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__,\n"
            "  'cuda': torch.version.cuda, 'cuda_available': cuda,\n"
            "  'device': torch.cuda.get_device_name(0) if cuda else 'cpu',\n"
            "  'capability': '.'.join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,\n"
            "  'memory_gib': round(props.total_memory / 2**30, 1) if cuda else None,\n"
            "  'megatron_core': version('megatron-core'), 'transformers': version('transformers'),\n"
            "  'math_verify': version('math-verify'), 'triton': version('triton'),\n"
            "  'transformer_engine': version('transformer-engine')}))\n")
    log = ctx.work / "env.log"  # its tail goes into the JSON on failure: OUT brings back at most 8 files
    stdout = ctx.work / "env.json"
    command = [ctx.python, "-c", f"import sys; sys.stdout = open({str(stdout)!r}, 'w')\n" + code]
    result = PartResult(box_s=box_s)
    status, result.seconds = run_process(command, log, box_s, ctx.env())
    if status != 0:
        result.status = "timeout" if status is None else "failed"
        result.error = log_tail(log)
        return result
    result.figures = json.loads(stdout.read_text())
    result.status = "ok"
    if not ctx.dry_run and not result.figures["cuda_available"]:
        result.status, result.error = "failed", "torch.cuda.is_available() is False on the device"
    f = result.figures
    result.rows.append(["versions", f"python {f['python']}, torch {f['torch']} (CUDA {f['cuda']}), megatron-core "
                        f"{f['megatron_core']}, transformers {f['transformers']}", "", result.status])
    result.rows.append(["device", f"{f['device']}" + (f", sm {f['capability']}, {f['memory_gib']} GiB"
                                                      if f["cuda_available"] else ""), "", ""])
    return result


def read_junit(path: Path) -> list[dict]:
    """Test cases of a JUnit XML report: name, outcome, seconds, message, recorded properties."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()[0][:300] if (
                    node.get("message") or node.text) else ""
                break
        properties = {}
        for prop in case.iter("property"):
            value = prop.get("value")
            try:
                properties[prop.get("name")] = json.loads(value)
            except (TypeError, ValueError):
                properties[prop.get("name")] = value
        cases.append(dict(name=case.get("name"), outcome=outcome, seconds=float(case.get("time") or 0.0),
                          message=message, properties=properties))
    return cases


def part_pytest(ctx: Context, box_s: float) -> PartResult:
    log, report = ctx.out / "pytest.log", ctx.out / "pytest_gpu.xml"
    command = [ctx.python, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider", "-q",
               f"--junitxml={report}", "-o", "junit_family=xunit1"]
    result = PartResult(box_s=box_s)
    status, result.seconds = run_process(command, log, box_s, ctx.env())
    cases = read_junit(report) if report.is_file() else []
    result.figures["tests"] = cases
    for case in cases:
        props = case["properties"]
        measured = props.pop("measured", "") if isinstance(props.get("measured"), str) else ""
        target = props.pop("target", "") if isinstance(props.get("target"), str) else ""
        result.rows.append([case["name"], measured or f"{case['seconds']:.1f} s", target,
                            case["outcome"] + (f": {case['message']}" if case["message"] else "")])
    counts = {outcome: sum(c["outcome"] == outcome for c in cases) for outcome in ("passed", "failed", "error",
                                                                                   "skipped")}
    result.figures["counts"] = counts
    if status is None:
        result.status, result.error = "timeout", f"pytest killed after {box_s:.0f} s; last: {log_tail(log, 2)}"
    elif status != 0:
        result.status = "failed"
        failed = [c["name"] for c in cases if c["outcome"] in ("failed", "error")]
        result.error = f"failed: {failed}" if failed else log_tail(log)
    elif not cases or counts["skipped"] == len(cases):
        result.status, result.error = "failed", "no gpu test ran (all skipped: no CUDA device?)"
    else:
        result.status = "ok"
    return result


# The GRPO run: the tiny_cpu recipe (synthetic task, local engine, one on-policy update per step)
# with a Qwen3-0.6B-shaped network. A random 151,936-token model almost never emits the task's
# digits, so every reward is 0 and every advantage too: entropy_coeff makes the gradient non-zero
# anyway, so the weights change every step and the engine-vs-trainer log-prob agreement of the
# next step checks the weight sync. lr 2e-4: Adam moves each weight by ~lr, 1% of the init's 0.02,
# above bf16's resolution (0.4%), so the bf16 copies the engine receives change too.
QWEN3_0_6B = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                  rope_theta=1000000.0, tie_word_embeddings=True, vocab_size=151936)


def grpo_overrides(ctx: Context, output_dir: Path) -> list[str]:
    common = [f"logging.output_dir={output_dir}", "logging.plot=false", "logging.console=false", "eval.interval=-1",
              "checkpoint.save_interval=-1", "actor.entropy_coeff=0.001", "model.dtype=bfloat16",
              "rollout.temperature=1.0",
              # every step's first mini-batch also gets the old-log-prob pass: the ratio invariant is measured
              "actor.old_logprob_check_interval=1"]
    if ctx.dry_run:  # the recipe's own tiny network, on CPU
        return common + ["trainer.total_steps=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                         "rollout.n=4", "data.max_response_length=8"]
    shape = "{" + ", ".join(f"{k}: {v}" for k, v in QWEN3_0_6B.items()) + "}"
    return common + ["trainer.device=cuda", "trainer.total_steps=10", f"model.override_config={shape}",
                     "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "rollout.n=8",
                     "data.max_response_length=64", "actor.max_tokens_per_micro_batch=8192", "actor.optim.lr=2e-4"]


def grpo_invariants(records: list[dict], steps: int) -> list[tuple[str, bool, str]]:
    """(name, holds, detail) for the run's metrics.jsonl records."""
    got = [r.get("step") for r in records]

    def values(key):
        return [r.get(key, float("nan")) for r in records]

    def finite(key):
        return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values(key))

    checks = [
        ("steps 1..N logged", got == list(range(1, steps + 1)), f"{got}"),
        ("old == current at the first mini-batch (ratio 1 exactly)",  # update's forward vs the old-log-prob pass
         all(v == 0.0 for v in values("invariant/ratio_dev_first_minibatch")),
         f"max {max(values('invariant/ratio_dev_first_minibatch'), default=float('nan')):.3g}"),
        ("no update skipped", all(v == 0.0 for v in values("actor/updates_skipped")), ""),
        ("loss and grad norm finite", finite("actor/loss") and finite("actor/grad_norm"), ""),
        ("gradient non-zero every step (weights move)", all(v > 0 for v in values("actor/grad_norm")),
         f"min {min(values('actor/grad_norm'), default=float('nan')):.3g}"),
        ("rewards in [0, 1]", all(0.0 <= v <= 1.0 for v in values("reward/mean")), ""),
        ("engine used the last synced weights",
         all(r.get("rollout/weight_version_min") == r.get("step") - 1 == r.get("rollout/weight_version_max")
             for r in records), ""),
        ("engine vs trainer log-probs finite", finite("actor/logprob_abs_diff_mean"), ""),
    ]
    return checks


def median_after_first(records: list[dict], key: str) -> Optional[float]:
    """Median over steps 2.. (step 1 pays for kernel selection and allocator warm-up)."""
    values = [r[key] for r in records[1:] if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def part_grpo(ctx: Context, box_s: float) -> PartResult:
    run_dir = ctx.work / "grpo"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    log = ctx.out / "grpo.log"
    steps = 3 if ctx.dry_run else 10
    command = [ctx.python, "-m", "megatron_grpo.train", "tiny_cpu", *grpo_overrides(ctx, run_dir)]
    result = PartResult(box_s=box_s)
    status, result.seconds = run_process(command, log, box_s, ctx.env(OMP_NUM_THREADS="2" if ctx.dry_run else "8"))
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    if metrics.is_file():
        shutil.copyfile(metrics, ctx.out / "grpo_metrics.jsonl")
    result.figures["steps_logged"] = len(records)
    if records:
        checks = grpo_invariants(records, steps)
        result.figures["invariants"] = {name: {"holds": holds, "detail": detail} for name, holds, detail in checks}
        for name, holds, detail in checks:
            result.rows.append([name, detail, "holds", "ok" if holds else "VIOLATED"])
        breakdown = {key: median_after_first(records, key) for key in
                     ("time/step", "time/rollout", "time/reward", "time/logprob", "time/train", "time/sync",
                      "perf/tokens_per_s", "perf/mfu", "actor/logprob_abs_diff_mean", "actor/logprob_abs_diff_max")}
        result.figures["median_steps_2_on"] = breakdown
        result.figures["step1_seconds"] = records[0].get("time/step")
        step = breakdown["time/step"]
        if step:
            parts = ", ".join(f"{key[5:]} {breakdown[key]:.2f} s ({100 * breakdown[key] / step:.0f}%)"
                              for key in ("time/rollout", "time/reward", "time/logprob", "time/train", "time/sync")
                              if breakdown[key] is not None)
            result.rows.append(["step time (median of steps 2..)", f"{step:.2f} s: {parts}", "", ""])
        if breakdown["perf/tokens_per_s"]:
            mfu = breakdown["perf/mfu"]
            result.rows.append(["throughput", f"{breakdown['perf/tokens_per_s']:,.0f} tokens/s" +
                                (f", train-phase MFU {100 * mfu:.1f}%" if mfu else ""), "", ""])
        if breakdown["actor/logprob_abs_diff_mean"] is not None:
            result.rows.append(["|engine - trainer| log-prob, mean / max (trainer bf16)",
                                f"{breakdown['actor/logprob_abs_diff_mean']:.4g} / "
                                f"{breakdown['actor/logprob_abs_diff_max']:.4g}", MISMATCH_ANCHOR, ""])
    if status is None:
        result.status, result.error = "timeout", f"killed after {box_s:.0f} s at step {len(records)} of {steps}"
    elif status != 0:
        result.status, result.error = "failed", log_tail(log)
    elif not all(holds for _, holds, _ in grpo_invariants(records, steps)):
        result.status = "failed"
        result.error = "invariants violated: " + ", ".join(n for n, h, _ in grpo_invariants(records, steps) if not h)
    else:
        result.status = "ok"
    return result


def part_bench(ctx: Context, box_s: float) -> PartResult:
    log, report = ctx.out / "bench.log", ctx.out / "bench_gpu.json"
    if report.exists():
        report.unlink()
    # The packed train step is the attention part's, once per attention backend.
    command = [ctx.python, "benchmarks/bench_gpu.py", "--json", str(report), "--train-modes", "padded"] + (
        ["--dry-run"] if ctx.dry_run else [])
    result = PartResult(box_s=box_s)
    status, result.seconds = run_process(command, log, box_s, ctx.env())
    data = json.loads(report.read_text()) if report.is_file() else {}
    raw = data.get("raw", {})
    result.figures = {key: raw.get(key) for key in ("train", "logprob", "memory", "generation", "plan", "targets",
                                                    "errors", "running", "wall_seconds")}
    for row in data.get("rows", []):
        against = f" = {row['fraction']} of {row['peak']}" if row.get("fraction", "n/a") != "n/a" else ""
        result.rows.append([f"{row['section']}: {row['setting']}", row["measured"] + against, row.get("target", ""),
                            row.get("verdict", "")])
    return _with_outcome(result, status, raw, log, box_s)


def _with_outcome(result: PartResult, status: int | None, raw: dict, log: Path, box_s: float) -> PartResult:
    """A benchmark part's status and error from its exit status (None: killed at the box) and the
    errors / running section its JSON report recorded."""
    errors = raw.get("errors") or {}
    if status is None:
        running = raw.get("running")
        result.status = "timeout"
        result.error = f"killed after {box_s:.0f} s" + (f" while running section {running!r}" if running else "")
    elif status != 0 or errors:
        result.status = "failed"
        result.error = "; ".join(f"{k}: {v}" for k, v in errors.items()) if errors else log_tail(log)
    else:
        result.status = "ok"
    return result


def part_attention(ctx: Context, box_s: float) -> PartResult:
    """benchmarks/bench_attention.py; its log and JSON stay in the work folder (OUT brings back at
    most 8 files), its raw figures go into gpu_check.json."""
    log, report = ctx.work / "attention.log", ctx.work / "bench_attention.json"
    command = [ctx.python, "benchmarks/bench_attention.py", "--json", str(report)] + (
        ["--dry-run"] if ctx.dry_run else [])
    result = PartResult(box_s=box_s)
    status, result.seconds = run_process(command, log, box_s, ctx.env())
    data = json.loads(report.read_text()) if report.is_file() else {}
    raw = data.get("raw", {})
    result.figures = {key: raw.get(key) for key in ("numerics", "train", "errors", "running", "versions",
                                                    "wall_seconds")}
    for row in data.get("rows", []):
        result.rows.append([f"{row['section']}: {row['setting']}", row["measured"], row.get("target", ""),
                            row.get("verdict", "")])
    return _with_outcome(result, status, raw, log, box_s)


@dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[Context, float], PartResult]
    box_s: float      # nominal seconds on the device
    dry_box_s: float  # nominal seconds in the CPU dry run


PARTS = (Part("env", part_env, 30, 40), Part("pytest", part_pytest, 140, 90),
         Part("bench", part_bench, 140, 60), Part("attention", part_attention, 70, 30),
         Part("grpo", part_grpo, 100, 60))


def box_for(index: int, parts, deadline: float, now: float, dry_run: bool, floor_s: float = 20.0) -> float:
    """Seconds part `index` may take: until the deadline, less the nominal boxes of the parts after it."""
    later = sum(p.dry_box_s if dry_run else p.box_s for p in parts[index + 1:])
    return max(floor_s, deadline - now - later)


def markdown(report: dict) -> str:
    env = report["parts"].get("env", {}).get("figures", {})
    lines = [f"# GPU check ({report['mode']}), {report['date']}", "",
             f"Device: {env.get('device', '?')}; torch {env.get('torch', '?')} (CUDA {env.get('cuda', '?')}), "
             f"megatron-core {env.get('megatron_core', '?')}, transformers {env.get('transformers', '?')}; "
             f"wall {report['wall_seconds']:.0f} s of a {report['budget_s']:.0f} s budget.", "",
             "| part | check | measured | target | result |", "|---|---|---|---|---|"]
    for name, part in report["parts"].items():
        status = part["status"] + (f" ({part['seconds']:.0f} s of {part['box_s']:.0f})" if part["seconds"] else "")
        error = str(part["error"]).replace("|", "\\|").replace("\n", " ") if part["error"] else ""
        lines.append(f"| **{name}** | | | | **{status}**" + (f": {error}" if error else "") + " |")
        for check, measured, target, verdict in part["rows"]:
            cells = [str(c).replace("|", "\\|").replace("\n", " ") for c in (check, measured, target, verdict)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(ctx: Context, results: dict, started: float, budget_s: float) -> dict:
    report = {"schema": 1, "mode": "dry-run (CPU, tiny shapes)" if ctx.dry_run else "device",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "budget_s": budget_s, "wall_seconds": time.monotonic() - started,
              "parts": {name: dataclasses.asdict(result) for name, result in results.items()}}
    (ctx.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (ctx.out / "gpu_check.md").write_text(markdown(report))
    return report


def run(out: Path, dry_run: bool, budget_s: float, python: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("gpu_check.json", "gpu_check.md", "pytest.log", "pytest_gpu.xml", "bench.log",
                  "bench_gpu.json", "grpo.log", "grpo_metrics.jsonl"):
        (out / stale).unlink(missing_ok=True)
    # Large run outputs (the GRPO run's initial model) stay out of OUT: it comes back to the caller.
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = Context(out=out, work=work, dry_run=dry_run, python=python)
    started = time.monotonic()
    deadline = started + budget_s
    results = {part.name: PartResult() for part in PARTS}
    try:
        for index, part in enumerate(PARTS):
            box = box_for(index, PARTS, deadline, time.monotonic(), dry_run)
            print(f"gpu_check: {part.name} (box {box:.0f} s) ...", flush=True)
            try:
                results[part.name] = part.run(ctx, box)
            except Exception as exc:  # noqa: BLE001 - a broken part must not cost the others their figures
                results[part.name] = PartResult(status="error", box_s=box, error=f"{type(exc).__name__}: {exc}")
            result = results[part.name]
            print(f"gpu_check: {part.name} {result.status} in {result.seconds:.0f} s"
                  + (f": {result.error}" if result.error else ""), flush=True)
            write_report(ctx, results, started, budget_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = write_report(ctx, results, started, budget_s)
    print((out / "gpu_check.md").read_text())
    failed = [name for name, part in report["parts"].items() if part["status"] != "ok"]
    print(f"gpu_check: wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}"
          + (f"; not ok: {failed}" if failed else "; every part ok"), flush=True)
    return 1 if failed else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="download the wheels the device lacks; print the device call")
    prep.add_argument("--wheels-dir", default=str(REPO / WHEELS_DIR))
    check = sub.add_parser("check-wheels", help="exit 0 if the wheel folder holds exactly the pinned wheels")
    check.add_argument("--wheels-dir", default=str(REPO / WHEELS_DIR))
    runner = sub.add_parser("run", help="run the parts, write gpu_check.json / .md")
    runner.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "outputs" / "gpu_check"))
    runner.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    runner.add_argument("--budget-s", type=float, default=None, help="wall budget (default 480 device, 280 dry run)")
    runner.add_argument("--python", default=sys.executable, help="interpreter for the parts")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            return prepare(Path(args.wheels_dir).resolve())
        if args.command == "check-wheels":
            check_wheels(Path(args.wheels_dir))
            return 0
        budget = args.budget_s or (280.0 if args.dry_run else 480.0)
        return run(Path(args.out).resolve(), args.dry_run, budget, args.python)
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
