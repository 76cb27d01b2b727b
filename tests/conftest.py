"""Test-suite settings shared by every module.

`versions` marks the modules whose outcome can change with the versions of torch, megatron-core or
transformers (model building, the parallel state, distributed checkpoints, the log-prob kernels,
conversion, the GRPO math on torch ops). CI's second lane (the clusters' Python 3.12, torch 2.14,
megatron-core 0.19) runs `-m "versions and not slow"` and the embedded default; the first lane runs
everything. A new module that calls those libraries belongs in this list."""
from __future__ import annotations

import pytest

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
