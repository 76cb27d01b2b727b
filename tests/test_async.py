"""Asynchronous GRPO (rollout.max_staleness) and the local engine in its own process, end to end on
the tiny recipe: K = 0 is bitwise the synchronous loop whichever process the engine is in and
whichever route the weights take; K = 1, 2 never train a sample more than K versions after it was
generated; stale groups are dropped, counted and refilled; a run stopped and resumed mid-way
trains every prompt exactly once, in the synchronous run's order."""
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_grpo.testing.distributed import run_distributed

FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
        "logging.console=false", "logging.plot=false", "eval.interval=-1", "trainer.num_threads=1",
        "rollout.local.threads=1"]
TIMING = ("time", "perf/", "sync/")  # wall-clock figures (time, time/*) and the sync route's own metrics


def _metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def _train(rank, world_size, overrides, record_prompts=False):
    """train() on tiny_cpu; with record_prompts, each step's prompts (token ids, one per group) as trained."""
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer import loop
    from megatron_grpo.trainer.rollouts import rollout_pipeline

    cfg = load_config("tiny_cpu", overrides)
    validate(cfg, world_size=world_size)
    trained = {}
    if record_prompts:
        next_batch, collect = rollout_pipeline.RolloutPipeline.next_batch, loop.collect_rollout_batch

        def async_next_batch(self, step):
            batch = next_batch(self, step)
            trained[step] = _prompts(batch)
            return batch

        def sync_collect(*args, **kwargs):
            batch = collect(*args, **kwargs)
            trained[args[5]] = _prompts(batch)  # args[5]: the step
            return batch

        rollout_pipeline.RolloutPipeline.next_batch = async_next_batch
        loop.collect_rollout_batch = sync_collect
    loop.train(cfg)
    if rank != 0:
        return None
    return {"metrics": _metrics(cfg.logging.output_dir), "trained": trained}


def _prompts(batch):
    """The batch's prompts in sampler order (a group's samples share one)."""
    seen = []
    for sample in batch.samples:
        if not seen or seen[-1] != sample.prompt_ids:
            seen.append(list(sample.prompt_ids))
    return seen


def _final_weights(out_dir, step):
    files = sorted((Path(out_dir) / "checkpoints" / f"step_{step}" / "hf").glob("*.safetensors"))
    assert files, f"no HF export of step {step} under {out_dir}"
    weights = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def _without_timing(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


@pytest.mark.slow
def test_k0_is_bitwise_the_synchronous_loop_in_either_process_and_route(tmp_path):
    """metrics.jsonl (all but timings) and the final policy of a 3-step run: the engine in the
    trainer's process (the synchronous loop as it was), in its own process with per-stage weights,
    and in its own process with weights through rank 0."""
    steps = ["trainer.total_steps=3", "checkpoint.save_interval=3", "checkpoint.save_hf=true"]
    runs = {"in_process": [], "own_process_per_stage": ["rollout.local.process=true"],
            "own_process_rank0": ["rollout.local.process=true", "rollout.weight_sync_route=rank0"]}
    results, weights = {}, {}
    for name, extra in runs.items():
        out = tmp_path / name
        results[name] = run_distributed(_train, world_size=1, timeout=300,
                                        args=(FAST + steps + extra + [f"logging.output_dir={out}"],))[0]
        weights[name] = _final_weights(out, 3)
    reference = _without_timing(results["in_process"]["metrics"])
    assert [r["step"] for r in reference] == [1, 2, 3]
    assert reference[-1]["actor/grad_norm"] > 0  # the weights moved
    for name in ("own_process_per_stage", "own_process_rank0"):
        assert _without_timing(results[name]["metrics"]) == reference, name
        assert weights[name].keys() == weights["in_process"].keys()
        for key, tensor in weights["in_process"].items():
            assert weights[name][key].equal(tensor), f"{name}: {key}"
    assert results["own_process_per_stage"]["metrics"][0]["sync/stages"] == 1.0  # went through the stage sender


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [1, 2])
def test_no_sample_is_trained_more_than_k_versions_after_it_was_generated(tmp_path, staleness):
    out = tmp_path / f"k{staleness}"
    result = run_distributed(_train, world_size=1, timeout=300, args=(
        FAST + ["trainer.total_steps=8", f"rollout.max_staleness={staleness}", f"logging.output_dir={out}"],))[0]
    records = result["metrics"]
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        step = r["step"]
        # the oldest sample of step s came from version s - 1 - staleness at the earliest
        assert r["rollout/weight_version_min"] >= step - 1 - staleness, r
        assert r["staleness/max"] == step - 1 - r["rollout/weight_version_min"] <= staleness, r
        assert r["rollout/dropped_stale"] == 0
        assert f"off_policy/logprob_gap/staleness_{int(r['staleness/max'])}" in r
    # asynchrony happened: later steps trained on samples of older weights
    assert max(r["staleness/max"] for r in records) >= 1
    assert all(r["time/wait_rollout"] >= 0 and r["time/engine_wait_weights"] >= 0 for r in records)


def _stale_groups_are_dropped(rank, world_size, model_dir):
    """collect_rollout_batch with min_weight_version: the first round comes from version 0 weights
    (stale), the engine then gets version 1, and the batch is refilled with fresh groups."""

    from megatron_grpo.algo import AdvantageConfig
    from megatron_grpo.data.prompts import EncodedPrompt
    from megatron_grpo.data.records import PromptRecord
    from megatron_grpo.rewards.runner import RewardRunner
    from megatron_grpo.rollout.local import LocalEngine
    from megatron_grpo.rollout.types import SamplingParams
    from megatron_grpo.trainer.rollouts.rollout_phase import RolloutSettings, collect_rollout_batch

    engine = LocalEngine.from_pretrained(model_dir)
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    tokenizer = engine.tokenizer
    rounds = []

    def next_prompts():
        rounds.append(len(rounds))
        if len(rounds) == 2:  # the second round is generated by version 1
            engine.update_weights(weights.items(), version=1)
        prompts = []
        for i in range(2):
            text = f"{len(rounds)}{i}3"
            record = PromptRecord(data_source="test", prompt=[{"role": "user", "content": text}],
                                  ground_truth=text[::-1])
            prompts.append(EncodedPrompt(record=record, text=text, input_ids=tokenizer.encode(text), truncated=False))
        return prompts

    rewards = RewardRunner("synthetic", num_workers=0, timeout_s=None)
    settings = RolloutSettings(n=3, sampling=SamplingParams(n=3, max_new_tokens=4, seed=1), adv_estimator="grpo",
                               advantage_config=AdvantageConfig())
    batch = collect_rollout_batch(engine, next_prompts, tokenizer, rewards, settings, step=2, num_prompts=2,
                                  min_weight_version=1)
    rewards.close()
    return {"rounds": len(rounds), "dropped": batch.metrics["rollout/dropped_stale"], "versions": batch.versions,
            "prompts": [tokenizer.decode(p) for p in _prompts(batch)]}


def test_stale_groups_are_dropped_counted_and_refilled(tmp_path):
    from tests.tiny_hf import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", seed=0)
    result = run_distributed(_stale_groups_are_dropped, world_size=1, timeout=120, args=(str(model_dir),))[0]
    assert result["rounds"] == 2
    assert result["dropped"] == 2 * 3  # both groups of the first round, 3 samples each
    assert result["versions"] == [1] * 6
    assert result["prompts"] == ["203", "213"]


@pytest.mark.slow
def test_resume_mid_async_run_trains_every_prompt_once_in_order(tmp_path):
    """K=1, 6 steps: stopped after step 3 (SIGUSR1: checkpoint, clean exit), resumed to 6. The
    prompts trained at each step are those of the uninterrupted asynchronous run and of the
    synchronous run; the batch generated ahead when the run stopped is generated again."""
    base = FAST + ["trainer.total_steps=6", "rollout.max_staleness=1"]
    sync = run_distributed(_train, world_size=1, timeout=300, args=(
        FAST + ["trainer.total_steps=6", f"logging.output_dir={tmp_path / 'sync'}"], True))[0]
    whole = run_distributed(_train, world_size=1, timeout=300, args=(
        base + [f"logging.output_dir={tmp_path / 'whole'}"], True))[0]
    stopped = run_distributed(_stop_after, world_size=1, timeout=300, args=(
        base + [f"logging.output_dir={tmp_path / 'resumed'}"], 3))[0]
    resumed = run_distributed(_train, world_size=1, timeout=300, args=(
        base + [f"logging.output_dir={tmp_path / 'resumed'}"], True))[0]
    assert sorted(stopped["trained"]) == [1, 2, 3]
    assert sorted(resumed["trained"]) == [4, 5, 6]
    interrupted = {**stopped["trained"], **resumed["trained"]}
    # the sampler's batches in order, each trained once: none twice, none skipped
    assert interrupted == whole["trained"] == sync["trained"]
    # the metrics continue: one record per step; the resumed steps' weights are version step - 1 or older by 1
    records = {r["step"]: r for r in resumed["metrics"]}
    assert sorted(records) == list(range(1, 7))
    assert records[4]["rollout/weight_version_min"] == 3  # regenerated from the restored weights
    for step in (5, 6):
        assert records[step]["staleness/max"] <= 1


def _stop_after(rank, world_size, overrides, stop_step):
    """_train with prompts recorded, stopped by SIGUSR1 after `stop_step`."""
    import os
    import signal

    from megatron_grpo.trainer import loop

    step_fn = loop.grpo_step

    def stopping(run, step, *args, **kwargs):
        metrics = step_fn(run, step, *args, **kwargs)
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        return metrics

    loop.grpo_step = stopping
    return _train(rank, world_size, overrides, record_prompts=True)
