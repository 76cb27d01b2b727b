"""The benchmark scripts run end to end in their smoke modes and print their tables.

bench_e2e --quick: ours always; the TRL side only where trl is importable (here or in
build/bench-trl-venv, see benchmarks/README.md), otherwise that test is skipped saying so.
bench_gpu: refuses to run without CUDA (exit 2, one clear message) and runs every section in
--dry-run (tiny shapes, CPU)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_e2e  # noqa: E402
import bench_gpu  # noqa: E402
from tests.requirements import missing  # noqa: E402


def _run(*args: str, timeout: int = 540) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _check_ours(data: dict) -> None:
    (ours,) = data["ours"]
    assert len(ours["iteration_seconds"]) == 2 and all(t > 0 for t in ours["iteration_seconds"])
    # 4 prompts x n=4, each sample >= 1 response token and a prompt of > 5 tokens
    assert all(tokens > 16 * 6 for tokens in ours["tokens"])
    assert all(16 <= r <= 16 * 8 for r in ours["response_tokens"])
    assert ours["peak_rss"] > 50 * 2**20
    assert set(ours["phases"]) >= {"time/rollout", "time/train", "time/logprob", "time/sync"}


@pytest.mark.slow
def test_bench_e2e_quick_ours_asynchronous_without_trl(tmp_path):
    """max_staleness 1 (the synchronous run is the TRL comparison's, below)."""
    out = tmp_path / "e2e.json"
    proc = _run(str(BENCH / "bench_e2e.py"), "--quick", "--trl-python", "none", "--json", str(out),
                "--max-staleness", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| ours (megatron-grpo) |" in proc.stdout
    assert "TRL side skipped" in proc.stdout
    data = json.loads(out.read_text())
    assert data["trl"] == []
    _check_ours(data)


@pytest.mark.slow
def test_bench_e2e_quick_against_trl(tmp_path):
    python = bench_e2e.find_trl_python(None)
    if python is None:
        missing("trl is not importable here nor in build/bench-trl-venv "
                "(python benchmarks/bench_e2e.py --setup-trl): TRL side not tested")
    out = tmp_path / "e2e.json"
    proc = _run(str(BENCH / "bench_e2e.py"), "--quick", "--trl-python", python, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| **ours / TRL** |" in proc.stdout
    data = json.loads(out.read_text())
    _check_ours(data)
    (trl,) = data["trl"]
    assert len(trl["iteration_seconds"]) == 2 and all(t > 0 for t in trl["iteration_seconds"])
    assert all(16 <= r <= 16 * 8 for r in trl["response_tokens"])
    assert trl["peak_rss"] > 50 * 2**20


def test_bench_gpu_fails_fast_without_cuda():
    if bench_gpu.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = _run(str(BENCH / "bench_gpu.py"), timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.slow
def test_bench_gpu_dry_run_prints_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    proc = _run(str(BENCH / "bench_gpu.py"), "--dry-run", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for section in ("| train step |", "| log-prob kernels |", "| log-prob peak memory |",
                    "| local engine generation |", "| memory plan vs measured |"):
        assert section in proc.stdout
    data = json.loads(out.read_text())
    raw = data["raw"]
    assert raw["train"]["tflops"] > 0 and raw["train"]["tokens"] == 2 * 2 * 16
    assert raw["logprob"]["logprobs+entropy fwd+bwd"]["tbps"] > 0
    assert raw["generation"]["generated"] == 2 * 2 * 4  # EOS disabled: every row decodes all tokens
    assert set(raw["memory"]) == {"a", "cH", "ratio"} and raw["memory"]["a"]["logits_bytes"] == 64 * 2048 * 2
    # no CUDA peak in a CPU dry run: MFU is not judged; the other targets are, from their measured values
    assert raw["targets"]["train_mfu"]["met"] is None and raw["targets"]["plan_ratio"]["met"] is None
    assert raw["targets"]["logprob_fwd_bwd_vs_copy"]["value"] > 0
    assert raw["plan"]["simulated"]["peak_bytes"] > 0 and raw["plan"]["measured"] is None
    assert "errors" not in raw and "running" not in raw
    assert [r["section"] for r in data["rows"]].count("log-prob peak memory") == 2


def test_bench_gpu_failing_section_leaves_the_others(tmp_path, monkeypatch):
    """One section raising is named in raw["errors"]; the sections after it still run and report."""
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(bench_gpu, "bench_logprob", broken)
    out = tmp_path / "gpu.json"
    code = bench_gpu.main(["--dry-run", "--only", "logprob", "--only", "memory", "--json", str(out)])
    assert code == 1
    data = json.loads(out.read_text())
    assert data["raw"]["errors"] == {"logprob": "RuntimeError: CUDA out of memory"}
    assert data["raw"]["memory"]["a"]["logits_bytes"] == 64 * 2048 * 2
    assert ["log-prob kernels", "log-prob peak memory", "log-prob peak memory"] == [r["section"] for r in data["rows"]]


def test_bench_gpu_targets_are_the_issues():
    raw = {}
    assert bench_gpu.target_verdict("train_mfu", 0.46, raw) == (">= 45%", "met")
    assert bench_gpu.target_verdict("logprob_fwd_bwd_vs_copy", 0.69, raw) == (">= 70%", "not met")
    assert bench_gpu.target_verdict("logprob_memory_vs_dense", 0.2, raw) == ("<= 0.25x", "met")
    assert bench_gpu.target_verdict("plan_ratio", 1.08, raw) == ("1 +- 10%", "met")
    assert bench_gpu.target_verdict("plan_ratio", 0.88, raw) == ("1 +- 10%", "not met")
    assert raw["targets"]["logprob_fwd_bwd_vs_copy"] == dict(value=0.69, target=">= 0.7", met=False)


@pytest.mark.slow
def test_bench_async_compares_sync_and_async_runs(tmp_path):
    proc = _run(str(BENCH / "bench_async.py"), "--out", str(tmp_path), "--steps", "5", "--target", "0.0",
                "--configs", "sync", "async K=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert set(results) == {"sync", "async K=1"}
    for r in results.values():  # target 0: reached at the first full moving-average window
        assert r["samples_to_target"] == 5 * 32 * 16 and r["tokens_per_s"] > 0 and r["peak_rss_mib"] > 50
    assert results["sync"]["staleness_mean"] == 0 and 0 < results["async K=1"]["staleness_mean"] <= 1
    # the mismatch of the stale samples (mismatch/staleness_1/*): none in the synchronous run
    assert results["sync"]["stale_p99"] is None and results["async K=1"]["stale_p99"] > 0
    assert "| async K=1 | 1 |" in proc.stdout and (tmp_path / "async_reward_curves.png").stat().st_size > 0


def test_bench_multi_turn_quick_runs_both_modes_on_the_same_tokens(tmp_path):
    out = tmp_path / "multi_turn.json"
    proc = _run(str(BENCH / "bench_multi_turn.py"), "--quick", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "speedup" in proc.stdout
    for result in json.loads(out.read_text())["results"]:
        kept, reprefill = result["kept"], result["reprefill"]
        assert kept["trajectory_tokens"] == reprefill["trajectory_tokens"] > 0
        # keeping the KV means later turns prefill only their new ids
        assert 0 < kept["prefill_positions"] < reprefill["prefill_positions"]


def test_bench_replay_summarises_runs_side_by_side(tmp_path):
    """bench_replay's table and plot from two runs' metrics.jsonl (its runs go through
    bench_async.run_one, which test_bench_async_compares_sync_and_async_runs runs for real)."""
    import bench_replay

    runs = {}
    for name, gap in (("replay on", 1e-7), ("replay off", 0.12)):
        run_dir = tmp_path / name.replace(" ", "_")
        run_dir.mkdir()
        records = [{"step": s, "reward/mean": min(1.0, s / (60 if gap < 0.1 else 90)), "time/step": 0.5,
                    "mismatch/ratio_outside_frac": 1.0 if gap > 0.1 and s == 1 else 0.0,
                    "mismatch/abs_logp_diff_p99": gap} for s in range(1, 101)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        runs[name] = run_dir
    result = type("Result", (), {"time_to_target_s": 1.0, "peak_rss_mib": 100.0, "final_reward": 1.0})
    rows = [bench_replay.summarise(name, run_dir, result, 0.8) for name, run_dir in runs.items()]
    on, off = rows
    assert (on["steps_to_target"], off["steps_to_target"]) == (50, 74)  # 5-step moving average >= 0.8
    assert (on["outside_step1"], off["outside_step1"], off["outside_mean"]) == (0.0, 1.0, 0.01)
    table = bench_replay.table(rows, 0.8)
    assert "| replay on | 0.0% / 0.0% | 1e-07 / 1e-07 |" in table and "| 50 | 1.00x | 1.00x |" in table
    assert bench_replay.plot(tmp_path, runs).stat().st_size > 0


@pytest.mark.slow
def test_bench_checkpoint_quick_measures_the_formats_figures(tmp_path):
    """bench_checkpoint --quick (10M, DP2): what its GPU-equivalent tracker counts agrees with the
    per-element formulas (so a change in megatron's save path or in the tracker shows), and the
    model-space format gathers nothing."""
    import bench_checkpoint

    out = tmp_path / "checkpoint.json"
    proc = _run(str(BENCH / "bench_checkpoint.py"), "--quick", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fully_reshardable", "fully_sharded_model_space"}
    for fmt, r in rows.items():
        formula = bench_checkpoint.predicted(fmt, r["numel"], r["dp"], r["fc1"], weight_bytes=4)
        for key, value in formula.items():
            assert abs(r[key] - value) <= 0.05 * r["numel"], (fmt, key, r[key], value)  # terms: >= 1 B per element
    assert rows["fully_sharded_model_space"]["save_device"] == 0 < rows["fully_reshardable"]["save_device"]
    assert "| TP8 x PP2 x DP8 | 4.41B | fully_sharded_model_space | 0.0 GB |" in proc.stdout


@pytest.mark.slow
def test_bench_long_tail_runs_the_three_modes_side_by_side(tmp_path):
    """Three short runs (plain, over-sampling, partial) through the CLI: the JSON has each mode's
    figures and the speedup; only partial rollouts train tokens of older weights."""
    out = tmp_path / "long_tail.json"
    proc = _run(str(BENCH / "bench_long_tail.py"), "--json", str(out), "--out", str(tmp_path / "runs"), "--steps",
                "2", "--batch", "4", "--n", "2", "--max-response-length", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for mode in ("plain", "over_sampling", "partial"):
        r = data[mode]
        assert r["steps"] == 2 and r["rollout_s_per_step"] > 0 and 0 < r["busy_frac"] <= 1 and r["peak_rss_mib"] > 50
    assert data["plain"]["tokens_one_version_old_frac"] == data["over_sampling"]["tokens_one_version_old_frac"] == 0
    assert data["rollout_speedup"] == pytest.approx(
        data["plain"]["rollout_s_per_step"] / data["partial"]["rollout_s_per_step"])
    assert "| partial |" in proc.stdout and "rollout_speedup" in proc.stdout
