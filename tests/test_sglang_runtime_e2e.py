"""GRPO end to end with SGLang 0.5.23's own runtime on this CPU (no harness): the trainer, its launcher,
transports and weight verification against real engines.

- the embedded default's task (recipes/tiny_cpu_sglang.yaml) with one engine the trainer launches,
  weights synced through disk, in bfloat16 (the GPU default, trainer and engine): exit 0, every sync
  checked against the trainer by SGLang's /weights_checker checksums, bf16's log-prob mismatch (one run
  for both: each engine start costs 35-45 s idle, 70-120 s beside CI's other lane);
- the 32B recipe's layout shrunk as tests/test_shipped_recipes.py shrinks it (TP2 x DP2 trainer ranks,
  2 dedicated engines of TP 2 given by URL behind the real sglang-router, distributed sync over gloo)
  for 2 steps: after each, every TP rank of every engine holds bitwise the trainer's weights;
- the trainer's prediction of those checksums against real TP-2 engines after a tensor update, and a
  push the engine got wrong named by tensor, TP rank and engine.

The learning run itself (fp32, tensor sync) is CI's `scripts/run_sglang_default.sh`, not a test here."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_grpo.launch.env import free_server_port
from tests.sglang_harness.fixtures import engine_checksums
from tests.sglang_runtime_fixtures import (launch_real_servers, real_router_settings, real_server_settings,
                                           runtime_env, runtime_python)

pytestmark = [pytest.mark.sglang_runtime]

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_cpu_sglang.yaml"


def _fused_parameters(num_layers: int, tied: bool) -> int:
    """How many parameters SGLang's Qwen3 holds: per layer qkv_proj, o_proj, q_norm, k_norm,
    gate_up_proj, down_proj and two layer norms; embed_tokens, the final norm, an untied lm_head."""
    return num_layers * 8 + 2 + (0 if tied else 1)


def _train_cli(tmp_path: Path, *overrides: str, timeout: float = 600) -> tuple[list[dict], str]:
    """`python -m megatron_grpo.cli train recipes/tiny_cpu_sglang.yaml ...` in the runtime venv, as
    scripts/run_sglang_default.sh runs it; asserts exit 0 and returns the steps' metrics records and
    the engine's log."""
    out = tmp_path / "run"
    cmd = [runtime_python(), "-m", "megatron_grpo.cli", "train", str(RECIPE), *overrides,
           f"rollout.sglang.port={free_server_port()}", f"logging.output_dir={out}", "logging.plot=false",
           "eval.interval=-1"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **runtime_env()})
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((out / "sglang_logs").glob("sglang-*.log"))) \
        if (out / "sglang_logs").is_dir() else ""
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-5000:]}\n{logs[-5000:]}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "step" in r], logs


def _recipe_model():
    from megatron_grpo.config import load_config

    return load_config("tiny_cpu_sglang").model.override_config


def test_bfloat16_disk_sync_default_task_every_sync_checked_against_the_trainer(tmp_path):
    """The embedded default's task with the engine the trainer launches, weights synced through disk,
    in bfloat16 (the GPU default; the launcher passes --dtype bfloat16) on both sides: every parameter
    the engine holds equals the trainer's bf16 tensor after every sync (SGLang's /weights_checker
    checksums), and the log-prob mismatch is bf16's. (fp32 to 1e-5: the 32B layout below.) Two steps:
    step 2 samples with weights synced after training."""
    steps = 2
    records, log = _train_cli(tmp_path, "model.dtype=bfloat16", "rollout.sglang.weight_sync=disk",
                              f"trainer.total_steps={steps}")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert log.startswith("$ ") and "--dtype bfloat16" in log.splitlines()[0]  # the launcher's command line
    assert log.count('"POST /update_weights_from_disk HTTP/1.1" 200') == steps  # one reload per step
    assert "Prefill batch" in log  # the engine's log, kept under the run folder, is SGLang's scheduler's
    model = _recipe_model()
    per_sync = _fused_parameters(model["num_hidden_layers"], model["tie_word_embeddings"])
    for r in records:
        # every parameter of the engine (TP 1) against the trainer's tensors, every step
        assert r["sync/verified"] == 1.0 and r["sync/checksums_verified"] == r["sync/verified_tensors"] == per_sync, r
        assert r["mismatch/tokens"] > 0 and 0 < r["mismatch/abs_logp_diff_p99"] < 0.05, r["mismatch/abs_logp_diff_p99"]
        assert r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == r["step"] - 1


# ----- dedicated engines of TP 2 behind the real router (the 32B recipe's layout) --------------------
@dataclass
class Fleet:
    policy: Path
    urls: list[str]
    router_url: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from tests.test_shipped_recipes import CLUSTER_RECIPES, tiny_policy

    shrink = CLUSTER_RECIPES["qwen3_32b_math"]
    root = tmp_path_factory.mktemp("fleet")
    policy = tiny_policy(shrink.architecture, root / "policy")
    settings = [real_server_settings(policy, tp_size=shrink.engine_tp) for _ in range(shrink.engines)]
    router = real_router_settings("cache_aware")  # the recipe's router_policy
    launcher = launch_real_servers(root / "logs", settings, router=router)
    yield Fleet(policy, [s.url for s in settings], router.url)
    launcher.shutdown(grace_s=2)


def _policy_tensors(policy: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(policy.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _perturbed(policy: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {name: t + 0.01 * torch.randn(t.shape, generator=generator) for name, t in _policy_tensors(policy).items()}


def test_predicted_checksums_are_what_real_tp2_engines_report_after_a_tensor_update(fleet):
    from megatron_grpo.models.hf_config import ModelArchitecture
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
    from megatron_grpo.rollout.sglang.verify import WeightVerificationError, verify_engines
    from megatron_grpo.rollout.sglang.weight_sync import EngineTarget, TensorTransport, update_weights

    client = SGLangClient(fleet.urls)
    targets = [EngineTarget(url, 2) for url in fleet.urls]
    engine = SGLangEngine(client, TensorTransport(client, targets), options=EngineOptions(
        verify_interval=1, health_check_interval_s=0, model=ModelArchitecture.from_hf(fleet.policy)))
    try:
        tensors = _perturbed(fleet.policy)
        engine.update_weights(iter(tensors.items()), version=1)
        parameters = len(engine_checksums(fleet.urls[0])[0])
        metrics = engine.sync_metrics()
        assert metrics["sync/checksums_verified"] == 2 * 2 * parameters  # engines x TP ranks x parameters
        assert metrics["sync/verified_tensors"] == parameters
        # engine 1 gets another k_proj than the one the trainer's prediction saw: named
        sample = engine.checks.sample(targets)
        wrong = next(name for name in tensors if name.endswith("layers.1.self_attn.k_proj.weight"))
        list(sample.tap(iter(tensors.items())))
        update_weights(client, TensorTransport(client, targets[1:]), iter({wrong: tensors[wrong] + 1.0}.items()), 2)
        with pytest.raises(WeightVerificationError) as error:
            verify_engines(client, targets, sample, engine.checks)
        assert f"{fleet.urls[1]} holds other values for 'model.layers.1.self_attn.qkv_proj.weight' (TP rank 0)" \
            in str(error.value)
        # the fleet back as it started (the engines agree on their weight version again: a trainer
        # refuses engines that disagree at its start)
        engine.update_weights(iter(_policy_tensors(fleet.policy).items()), version=0)
    finally:
        engine.close()


def test_32b_recipe_layout_two_steps_every_engine_holds_the_trainers_weights(fleet, tmp_path):
    from megatron_grpo.models.hf_config import ModelArchitecture
    from megatron_grpo.rollout.sglang.expected_checksums import ChecksumPrediction, EngineLayout, ModelLayout
    from megatron_grpo.testing.distributed import run_distributed
    from tests.test_shipped_recipes import CLUSTER_RECIPES, _first_step, cpu_overrides

    recipe, shrink = "qwen3_32b_math", CLUSTER_RECIPES["qwen3_32b_math"]
    overrides = [*cpu_overrides(recipe, fleet.policy, tmp_path / "run"), "trainer.total_steps=2",
                 f"rollout.sglang.urls=[{','.join(fleet.urls)}]", f"rollout.sglang.num_engines={len(fleet.urls)}",
                 f"rollout.sglang.tp_size={shrink.engine_tp}", f"rollout.sglang.router_url={fleet.router_url}",
                 "rollout.sglang.verify_interval=1"]
    out = run_distributed(_first_step, shrink.world_size, (recipe, overrides, None), timeout=900)[0]
    records = [r for r in out["records"] if "step" in r]
    assert [r["step"] for r in records] == [1, 2]
    parameters = len(engine_checksums(fleet.urls[0])[0])
    for r in records:  # every sync checked against the trainer's tensors (2 engines x 2 TP ranks)
        assert r["sync/checksums_verified"] == 2 * 2 * parameters, r
        assert r["mismatch/abs_logp_diff_max"] < 1e-5 and r["rollout/weight_version_min"] == r["step"] - 1
    # independently of the sync: the trainer's parameters after step 2, as SGLang holds them
    layout = EngineLayout(tp_size=2, dtype="float32", device="cpu")
    want = ChecksumPrediction(ModelLayout.of(ModelArchitecture.from_hf(fleet.policy)), (layout,))
    for name, tensor in out["trained"].items():
        want.add(name, tensor)
    changed = [n for n, t in out["trained"].items() if not t.equal(out["initial"][n])]
    assert len(changed) >= 0.9 * len(out["trained"]), "the steps moved almost no weights"
    for url in fleet.urls:
        assert engine_checksums(url) == want.expected(layout), url
