"""The interleaved pipeline schedule (parallel.virtual_pipeline): the first GRPO step of a tiny
4-layer Qwen3 at PP2 x VPP2 (one layer per model chunk) and TP2 x PP2 x VPP2 equals the single
process (loss, entropy, grad norm, every weight's update within 1e-5 relative: fp32 rounding of
reductions in other orders, tests/first_step.py)."""
from __future__ import annotations

import pytest

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
