"""Test-suite settings shared by every module.

`versions` marks the modules whose outcome can change with the versions of torch, megatron-core or
transformers (model building, the parallel state, distributed checkpoints, the log-prob kernels,
conversion, the GRPO math on torch ops). CI's second lane (the clusters' Python 3.12, torch 2.14,
megatron-core 0.19) runs `-m "versions and not slow"` and the embedded default; the first lane runs
everything. A new module that calls those libraries belongs in this list."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

VERSION_SENSITIVE = frozenset({
    "test_algo_advantages", "test_algo_global_denominators", "test_algo_losses",
    "test_checkpoint", "test_checkpoint_formats", "test_context_parallel", "test_convert", "test_deepseek_v3",
    "test_export_errors",
    "test_fused_head",
    "test_mcore_compat", "test_megatron_cpu", "test_models", "test_moe_families", "test_moe_metrics",
    "test_moe_models",
    "test_moe_replay", "test_packing", "test_packing_equivalence", "test_resume", "test_rollout_local",
    "test_stage_sync", "test_support_logprobs", "test_torch_varlen", "test_trainer_batching",
    "test_vocab_parallel", "test_weight_sync_megatron",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in VERSION_SENSITIVE:
            item.add_marker(pytest.mark.versions)
    # SGLang's own runtime needs the clusters' Python 3.12 and torch 2.14.1: its tests run in the
    # interpreter of build/sglang-runtime-venv (scripts/test_cluster_lane.sh, CI's second lane) and
    # are deselected, not skipped, in any other (scripts/test.sh's, Python 3.11).
    if not in_sglang_runtime_venv():
        runtime = [item for item in items if item.get_closest_marker("sglang_runtime")]
        if runtime:
            config.hook.pytest_deselected(items=runtime)
            items[:] = [item for item in items if not item.get_closest_marker("sglang_runtime")]


def in_sglang_runtime_venv() -> bool:
    return Path(sys.prefix).resolve() == (REPO_ROOT / "build" / "sglang-runtime-venv").resolve()
