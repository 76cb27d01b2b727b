"""benchmarks/bench_packing.py --quick on the repository's GSM8K slice: it runs, writes the JSON
keys the issue names, and its counts agree with the planner (packed: no padding on one process)."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_packing_quick(tmp_path):
    out = tmp_path / "packing.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_packing.py"), "--quick",
                           "--data", str(REPO / "tests" / "data" / "gsm8k_test_slice.jsonl"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("padded_useful_frac", "packed_useful_frac", "speedup", "peak_mem_ratio"):
        assert isinstance(result[key], float), key
    modes = result["modes"]
    assert (modes["packed"]["useful_tokens"] == modes["padded"]["useful_tokens"]
            == modes["padded-fixed"]["useful_tokens"])
    assert result["packed_useful_frac"] == 1.0  # one process: no kernel needs a multiple
    assert result["padded_useful_frac"] < 1.0
    assert result["length_unit"].startswith("proxy")


def test_bench_packing_needs_its_data(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_packing.py"), "--data",
                           str(tmp_path / "missing.jsonl")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: --data")
    assert "Traceback" not in proc.stderr
