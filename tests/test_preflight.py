"""trainer.preflight (trainer/preflight.py) on the tiny recipe: a sound run passes every check and
logs the figures; a batch-variant log-prob kernel fails "trainer vs itself" and stops the run
before step 1. (A weight sync that misses a tensor: tests/test_trainer_sglang.py, with SGLang's
own server code, where nothing else catches it with one Qwen engine.)"""
import json
from pathlib import Path

import pytest

from megatron_grpo.testing.distributed import run_distributed

SMALL = ["data.max_response_length=8", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "logging.console=false", "logging.plot=false", "trainer.total_steps=1", "trainer.preflight=true",
         "trainer.preflight_rounds=2"]


def _train(rank, world_size, overrides, batch_variant):
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer.loop import train
    from megatron_grpo.trainer.step import train_step

    if batch_variant:  # a kernel whose results depend on how many sequences share its micro-batch
        exact = train_step.token_logprobs_and_entropy

        def variant(micro_batch, logits, **kwargs):
            logp, entropy = exact(micro_batch, logits, **kwargs)
            return logp + 1e-3 * len(micro_batch.sample_indices), entropy

        train_step.token_logprobs_and_entropy = variant
    cfg = load_config("tiny_cpu", overrides)
    validate(cfg, world_size=world_size)
    try:
        train(cfg)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(exc).__name__}: {exc}"}
    records = [json.loads(line) for line in (Path(cfg.logging.output_dir) / "metrics.jsonl").open()]
    return {"records": records} if rank == 0 else None


@pytest.mark.slow
def test_sound_run_passes_and_a_batch_variant_kernel_fails(tmp_path):
    sound = run_distributed(_train, 2, ([*SMALL, "parallel.tensor=2", "rollout.top_p=0.9", "rollout.top_k=20",
                                         f"logging.output_dir={tmp_path / 'sound'}"], False), timeout=600)[0]
    assert "error" not in sound, sound
    preflight, step1 = sound["records"]
    assert preflight["step"] == 0 and step1["step"] == 1
    figures = {k: v for k, v in preflight.items() if k.startswith("preflight/")}
    assert set(figures) == {"preflight/lr_0_engine_vs_trainer", "preflight/lr_0_trend", "preflight/weight_round_trip",
                            "preflight/trainer_vs_itself", "preflight/engine_vs_itself"}
    assert all(0 <= v < 1e-5 for v in figures.values()), figures  # fp32 on CPU: rounding only

    broken = run_distributed(_train, 1, ([*SMALL, f"logging.output_dir={tmp_path / 'broken'}"], True),
                             timeout=600)[0]
    error = broken["error"]
    assert error.startswith("PreflightFailed: preflight failed ("), error
    failed = error.split("(", 1)[1].split(";")[0].split(", ")
    assert "trainer vs itself" in failed, error
    row = next(line for line in error.splitlines() if line.startswith("| trainer vs itself |"))
    assert float(row.split("|")[2]) >= 1e-3 and "FAIL" in row  # one more sequence per micro-batch: +1e-3
    assert not (tmp_path / "broken" / "metrics.jsonl").exists()  # stopped before step 1


@pytest.mark.slow
def test_doctor_mismatch_prints_the_preflight_table(tmp_path):
    """`megatron-grpo doctor RECIPE --mismatch`: the node's table, then the preflight's, exit 0."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "doctor", "tiny_cpu",
                           f"logging.output_dir={tmp_path}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                           "data.max_response_length=8", "trainer.preflight_rounds=2", "--mismatch"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = done.stdout.split("megatron-grpo doctor --mismatch: preflight")[1]
    rows = [line for line in table.splitlines()[3:] if line.startswith("| ") and "| ok |" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["lr 0: engine vs trainer", "lr 0: trend",
                                                          "weight round trip", "trainer vs itself", "engine vs itself"]
    assert (tmp_path / "preflight" / "run.json").exists()  # built in a folder of its own
