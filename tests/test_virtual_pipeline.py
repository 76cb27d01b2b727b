"""The interleaved pipeline schedule (parallel.virtual_pipeline): the first GRPO step of a tiny
4-layer Qwen3 at PP2 x VPP2 (one layer per model chunk) and TP2 x PP2 x VPP2 equals the single
process (loss, entropy, grad norm, every weight's update within 1e-5 relative: fp32 rounding of
reductions in other orders, tests/first_step.py)."""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.models.tiny import save_tiny_hf_model
from megatron_grpo.testing.distributed import run_distributed
from tests.first_step import compare_updates, first_step, relative_difference, uneven_samples

TOLERANCE = 1e-5
METRICS = ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm")
LAYOUTS = {
    "pp2-vpp2": (2, dict(pipeline=2, virtual_pipeline=2)),
    "tp2-pp2-vpp2": (4, dict(tensor=2, pipeline=2, virtual_pipeline=2)),
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return str(save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("vpp") / "policy", seed=5))


@pytest.fixture(scope="module")
def single(policy):
    return run_distributed(first_step, 1, args=(policy, {}, uneven_samples(16, 250)), timeout=300)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_first_grpo_step_with_virtual_pipeline_equals_single_process(policy, single, layout):
    world, parallel = LAYOUTS[layout]
    metrics, weights = run_distributed(first_step, world, args=(policy, parallel, uneven_samples(16, 250)),
                                       timeout=600)[0]
    ref_metrics, ref_weights = single
    assert metrics["micro_batches"] % parallel["pipeline"] == 0  # megatron's interleaved micro-batch groups
    worst = {key: relative_difference(metrics[key], ref_metrics[key]) for key in METRICS}
    update_worst, allowed = compare_updates(policy, weights, ref_weights, TOLERANCE)
    worst.update(update_worst)
    print(layout, {k: f"{v:.1e}" for k, v in sorted(worst.items(), key=lambda kv: -kv[1])[:5]})
    bad = {k: v for k, v in worst.items() if v > allowed.get(k, TOLERANCE)}
    assert not bad, f"{layout}: differs from the single process beyond {TOLERANCE:.0e}: {bad}"


FOUR_LAYERS = "model.override_config.num_hidden_layers=4"  # one layer per model chunk at PP2 x VPP2


def test_resume_and_export_across_a_virtual_pipeline_change(tmp_path):
    """Saved at PP2 x VPP2 (megatron numbers the chunks' layers locally; the checkpoint is model
    space), resumed at PP2 without VPP: the state loaded is the state saved, bitwise, and step 3
    continues the interleaved run within the layout arithmetic's rounding (tests/test_resume_layouts.py
    explains the bounds). `megatron-grpo export` of the VPP checkpoint on one process gives the
    weights the rollout engine held at that step, bitwise."""
    from tests.test_export import hf_tensors, megatron_grpo
    from tests.test_resume_layouts import FAST, _assert_same_state, _compare_step
    from tests.train_harness import train_capturing

    origin = tmp_path / "origin"
    interleaved = run_distributed(
        train_capturing, 2, ([*FAST, FOUR_LAYERS, "parallel.pipeline=2", "parallel.virtual_pipeline=2",
                              "trainer.total_steps=3", "checkpoint.save_interval=2",
                              f"logging.output_dir={origin}"],), timeout=400)[0]
    step_2 = origin / "checkpoints" / "step_2"
    plain = run_distributed(
        train_capturing, 2, ([*FAST, FOUR_LAYERS, "parallel.pipeline=2", "trainer.total_steps=3",
                              f"checkpoint.resume={step_2}", f"logging.output_dir={tmp_path / 'plain'}"],
                             None, tmp_path / "resaved"), timeout=400)[0]
    _assert_same_state(step_2 / "model_optim", tmp_path / "resaved")
    for name, value in interleaved["steps"][2].items():
        assert torch.equal(plain["at_resume"][name], value), name
    _compare_step(plain, interleaved, 3, "PP2xVPP2 -> PP2")

    out = tmp_path / "exported"
    result = megatron_grpo("export", str(step_2), "--out", str(out))
    assert result.returncode == 0, result.stderr
    exported = hf_tensors(out)
    engine = interleaved["steps"][2]
    assert sorted(exported) == sorted(set(engine) - {"lm_head.weight"})  # tiny_cpu ties lm_head to the embedding
    for name, value in exported.items():
        assert torch.equal(value, engine[name]), name
