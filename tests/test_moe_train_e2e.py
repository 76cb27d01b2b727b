"""The MoE recipe end to end: recipes/tiny_cpu_moe.yaml at EP2 on 2 gloo ranks with routing replay
(the in-process local engine records its routes, the trainer's routers replay them)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_grpo.testing.distributed import run_distributed

FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "rollout.n=4", "logging.console=false", "logging.plot=false", "trainer.total_steps=2"]


def _train(rank, world_size, overrides):
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer.loop import train

    cfg = load_config("tiny_cpu_moe", overrides)
    validate(cfg, world_size=world_size)
    train(cfg)
    if rank:
        return None
    with open(Path(cfg.logging.output_dir) / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


@pytest.mark.slow
def test_moe_recipe_trains_at_ep2_with_routing_replay(tmp_path):
    records = run_distributed(_train, 2, ([*FAST, "parallel.expert=2", "actor.moe_routing_replay=true",
                                           f"logging.output_dir={tmp_path}"],), timeout=600)[0]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        print({k: v for k, v in record.items() if k.startswith(("moe/", "actor/", "invariant/"))})
        assert math.isfinite(record["actor/loss"]) and math.isfinite(record["actor/grad_norm"])
        # the engine's routes reached the trainer's routers: every position but each sequence's
        # last token (which the engine never fed back) and padding routes by them
        assert 0.5 < record["moe/replayed_frac"] <= 1.0
        assert record["moe/dropped_frac"] == 0.0  # no capacity factor
        assert record["moe/load_max_over_mean"] >= 1.0 and 0 < record["moe/router_entropy"] < math.log(8)
        assert math.isfinite(record["moe/aux_loss"])
        # engine (fp32 HF) and trainer (fp32 megatron, the engine's routes) agree on the sampled
        # tokens' log-probs to fp32 rounding: ~100 ulp of |logp| ~ 1 (measured 4.8e-7)
        assert record["actor/logprob_abs_diff_max"] < 100 * 1.2e-7
