"""scripts/gpu_check.sh: the prepared GPU check. Its --dry-run (CPU, tiny shapes) runs every part's
code end to end here, so CI exercises what a session lent a GPU will run; the rest checks the
pieces that a device run cannot afford to get wrong: the wheel set and its size limit, the time
boxes, a part that hangs or raises leaving the others' figures, and the GRPO invariants."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402

PINNED = ["megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
          "math_verify-0.9.0-py3-none-any.whl", "latex2sympy2_extended-1.11.0-py3-none-any.whl",
          "antlr4_python3_runtime-4.13.2-py3-none-any.whl"]


@pytest.mark.slow
def test_dry_run_runs_every_part_and_writes_json_and_markdown(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"].startswith("dry-run")
    parts = report["parts"]
    assert list(parts) == ["env", "pytest", "bench", "attention", "grpo"]
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(parts, "ok")
    # every GPU test ran (on CPU) and passed, none skipped; the figures came through the JUnit report
    tests = parts["pytest"]["figures"]["tests"]
    assert len(tests) == 7 and all(t["outcome"] == "passed" for t in tests), tests
    mismatch = next(t for t in tests if t["name"] == "test_training_inference_logprob_mismatch")
    bf16 = mismatch["properties"]["bf16"]
    assert 0 < bf16["mismatch_mean"] <= bf16["mismatch_max"] and bf16["tokens"] == 3 * 2 * 8
    # the benchmark's five sections, with the issues' targets judged
    bench = parts["bench"]["figures"]
    assert bench["train"]["tokens"] == 2 * 2 * 16 and bench["generation"]["generated"] == 2 * 2 * 4
    assert bench["memory"]["a"]["peak_extra"] >= 0 and not bench["errors"]
    assert set(bench["targets"]) == {"train_mfu", "logprob_fwd_bwd_vs_copy", "logprob_memory_vs_dense", "plan_ratio"}
    assert bench["plan"]["simulated"]["peak_bytes"] > 0
    # the attention backends: the torch_varlen path (the float64 stand-in in the CUDA kernel's place)
    # and the local one within their bf16 bounds, CP = 2 included, and a packed train step with each
    attention = parts["attention"]["figures"]
    numerics = attention["numerics"]
    assert numerics["kernel"].startswith("testing/varlen_reference.py") and not attention["errors"]
    assert numerics["torch_varlen"]["holds"] and numerics["local"]["holds"] and numerics["context_parallel"]["holds"]
    assert 0 < numerics["varlen_vs_local_output"] <= 1
    train = attention["train"]
    assert (train["local"]["backend"], train["torch_varlen"]["backend"]) == ("local", "torch_varlen")
    assert train["local"]["tokens"] == train["torch_varlen"]["tokens"] > 0 and train["local_over_varlen_time"] > 0
    grpo = parts["grpo"]["figures"]
    assert grpo["steps_logged"] == 3 and all(v["holds"] for v in grpo["invariants"].values())
    assert grpo["median_steps_2_on"]["time/train"] > 0
    markdown = (out / "gpu_check.md").read_text()
    for name in parts:
        assert f"| **{name}** |" in markdown
    # what comes back from a device call: at most 8 plain files, no folders
    files = sorted(p.name for p in out.iterdir())
    assert all((out / f).is_file() for f in files) and len(files) <= 8, files
    assert "grpo_metrics.jsonl" in files and "bench_gpu.json" in files


def test_check_wheels_wants_exactly_the_pinned_set(tmp_path):
    for name in PINNED:
        (tmp_path / name).write_bytes(b"x" * 100)
    assert [p.name for p in gpu_check.check_wheels(tmp_path)] == PINNED
    (tmp_path / "megatron_core-0.19.1-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    with pytest.raises(gpu_check.CheckError, match="outside the pinned set"):
        gpu_check.check_wheels(tmp_path)
    (tmp_path / "megatron_core-0.19.1-cp312-cp312-manylinux_2_28_x86_64.whl").unlink()
    (tmp_path / PINNED[1]).unlink()
    with pytest.raises(gpu_check.CheckError, match=r"one wheel of math-verify==0.9.0, found none"):
        gpu_check.check_wheels(tmp_path)
    with pytest.raises(gpu_check.CheckError, match="found none"):
        gpu_check.check_wheels(tmp_path / "missing")


def test_check_wheels_enforces_the_size_limit(tmp_path):
    for name in PINNED:
        (tmp_path / name).write_bytes(b"x")
    with open(tmp_path / PINNED[0], "r+b") as handle:
        handle.truncate(61 * 2**20)  # sparse: no disk used
    with pytest.raises(gpu_check.CheckError, match=r"61\.0 MiB, over the 60 MiB limit"):
        gpu_check.check_wheels(tmp_path)


def test_wheel_names_normalise_like_pip():
    assert gpu_check.wheel_name_matches("antlr4_python3_runtime-4.13.2-py3-none-any.whl",
                                        "antlr4-python3-runtime", "4.13.2")
    assert gpu_check.wheel_name_matches("latex2sympy2_extended-1.11.0-py3-none-any.whl", "latex2sympy2_extended",
                                        "1.11.0")
    assert not gpu_check.wheel_name_matches("math_verify-0.8.0-py3-none-any.whl", "math-verify", "0.9.0")
    assert not gpu_check.wheel_name_matches("math_verify-0.9.0.tar.gz", "math-verify", "0.9.0")


def test_pip_download_targets_the_device_interpreter(tmp_path):
    command = gpu_check.pip_download_command(tmp_path, "megatron-core==0.19.2")
    joined = " ".join(command)
    for flag in ("--no-deps", "--only-binary=:all:", "--python-version 3.12", "--implementation cp",
                 "--platform manylinux_2_28_x86_64", "--platform manylinux2014_x86_64"):
        assert flag in joined
    assert command[-1] == "megatron-core==0.19.2" and str(tmp_path) in command


def test_time_boxes_add_up_to_the_budget():
    parts = gpu_check.PARTS
    start = 1000.0
    deadline = start + 480
    first = gpu_check.box_for(0, parts, deadline, start, dry_run=False)
    assert first == 480 - sum(p.box_s for p in parts[1:])
    # a part that finished early passes its unused seconds on; the last part gets what is left
    assert gpu_check.box_for(len(parts) - 1, parts, deadline, start + 100, dry_run=False) == 380
    assert gpu_check.box_for(1, parts, deadline, start + 479, dry_run=False) == 20.0  # the floor
    assert sum(p.box_s for p in parts) <= 480 < gpu_check.DEVICE_TIMEOUT_S


def test_run_process_kills_the_whole_group_at_its_box(tmp_path):
    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    code, seconds = gpu_check.run_process(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], tmp_path / "log",
                                          1.0, dict(os.environ))
    assert code is None and seconds < 10 and time.monotonic() - start < 10
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{child}/stat").read_text().split()[2] if Path(f"/proc/{child}/stat").exists() else "X"
        if state == "Z":
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"


def test_a_failing_or_hanging_part_leaves_the_others_figures(tmp_path, monkeypatch):
    def raises(ctx, box):
        raise RuntimeError("CUDA error: an illegal memory access")

    def hangs(ctx, box):
        code, seconds = gpu_check.run_process(["sleep", "60"], ctx.out / "hang.log", box, dict(os.environ))
        return gpu_check.PartResult(status="timeout" if code is None else "ok", seconds=seconds, box_s=box,
                                    error=f"killed after {box:.0f} s")

    def works(ctx, box):
        return gpu_check.PartResult(status="ok", seconds=0.1, box_s=box, figures={"value": 42},
                                    rows=[["a check", "42", ">= 1", "met"]])

    parts = (gpu_check.Part("broken", raises, 5, 5), gpu_check.Part("stuck", hangs, 1, 1),
             gpu_check.Part("fine", works, 5, 5))
    monkeypatch.setattr(gpu_check, "PARTS", parts)
    monkeypatch.setattr(gpu_check, "box_for", lambda index, parts, deadline, now, dry_run: 1.0)
    assert gpu_check.run(tmp_path, dry_run=True, budget_s=30, python=sys.executable) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["parts"]["broken"]["status"] == "error"
    assert "illegal memory access" in report["parts"]["broken"]["error"]
    assert report["parts"]["stuck"]["status"] == "timeout"
    assert report["parts"]["fine"] == dict(status="ok", seconds=0.1, box_s=1.0, error=None, figures={"value": 42},
                                           rows=[["a check", "42", ">= 1", "met"]])
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "**error**: RuntimeError: CUDA error" in markdown and "| fine | a check | 42 | >= 1 | met |" in markdown


def _records(steps=3, changes=None):
    records = []
    for step in range(1, steps + 1):
        record = {"step": step, "invariant/ratio_dev_first_minibatch": 0.0, "actor/updates_skipped": 0.0,
                  "actor/loss": -0.01, "actor/grad_norm": 0.5, "reward/mean": 0.0,
                  "rollout/weight_version_min": step - 1, "rollout/weight_version_max": step - 1,
                  "actor/logprob_abs_diff_mean": 1e-3}
        record.update((changes or {}).get(step, {}))
        records.append(record)
    return records


def test_grpo_invariants_hold_on_a_clean_run_and_name_each_violation():
    assert all(holds for _, holds, _ in gpu_check.grpo_invariants(_records(), 3))
    cases = {"old == current at the first mini-batch (ratio 1 exactly)":
             {2: {"invariant/ratio_dev_first_minibatch": 1e-7}},
             "no update skipped": {3: {"actor/updates_skipped": 1.0}},
             "loss and grad norm finite": {1: {"actor/loss": float("nan")}},
             "gradient non-zero every step (weights move)": {2: {"actor/grad_norm": 0.0}},
             "engine used the last synced weights": {3: {"rollout/weight_version_min": 1}},
             "engine vs trainer log-probs finite": {1: {"actor/logprob_abs_diff_mean": float("inf")}}}
    for name, change in cases.items():
        failed = [n for n, holds, _ in gpu_check.grpo_invariants(_records(changes=change), 3) if not holds]
        assert failed == [name], (name, failed)
    assert [n for n, h, _ in gpu_check.grpo_invariants(_records(2), 3) if not h] == ["steps 1..N logged"]
