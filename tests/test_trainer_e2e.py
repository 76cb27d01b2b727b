"""The trainer end to end on the tiny recipe: CLI, invariants, reference-model skipping, parallel
layouts against the single-process run, and learning."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_grpo.testing.distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "rollout.n=4", "logging.console=false", "logging.plot=false"]


def _metrics(out_dir):
    with open(Path(out_dir) / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


def _train_in_process(rank, world_size, overrides):
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer.loop import train

    cfg = load_config("tiny_cpu", overrides)
    validate(cfg, world_size=world_size)
    train(cfg)
    return _metrics(cfg.logging.output_dir) if rank == 0 else None


def _build_and_step(rank, world_size, overrides):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.loop import grpo_step
    from megatron_grpo.trainer.setup import build_run

    run = build_run(load_config("tiny_cpu", overrides))
    try:
        metrics = grpo_step(run, 1)
    finally:
        run.close()
    return {"has_reference": run.reference is not None, "metrics": metrics}


def _one_step_per_estimator(rank, world_size, out, estimators):
    """One run built with the KL in the reward (so its reference model exists), then per estimator a
    step without the KL in the reward (the run build_run makes for that recipe: no controller, no
    reference) and one with it (the rollout phase's advantages, then trainer/step/reward_kl.py's).
    {(estimator, kl_in_reward): the step's metrics, or the error it raised}."""
    import dataclasses

    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer.loop import grpo_step
    from megatron_grpo.trainer.setup import build_run

    built = load_config("tiny_cpu", [*FAST, f"logging.output_dir={out}", "algorithm.use_kl_in_reward=true"])
    run = build_run(built)
    results, step = {}, 0
    try:
        for estimator in estimators:
            for kl_in_reward in (False, True):
                cfg = dataclasses.replace(built, algorithm=dataclasses.replace(
                    built.algorithm, adv_estimator=estimator, use_kl_in_reward=kl_in_reward))
                validate(cfg, world_size=world_size)  # what the recipe key accepts
                variant = run if kl_in_reward else dataclasses.replace(run, kl_controller=None, reference=None)
                step += 1
                try:
                    results[estimator, kl_in_reward] = grpo_step(dataclasses.replace(variant, config=cfg), step)
                except Exception as exc:  # noqa: BLE001 - each case reports its own failure
                    results[estimator, kl_in_reward] = f"{type(exc).__name__}: {exc}"
    finally:
        run.close()
    return results


def _accepted_estimators() -> list[str]:
    """Every algorithm.adv_estimator that validation accepts: its registry, once algo is imported."""
    import megatron_grpo.algo  # noqa: F401 - fills the registry config/names.py reads
    from megatron_grpo.config.names import ADVANTAGE_ESTIMATORS

    return ADVANTAGE_ESTIMATORS.known()


@pytest.fixture(scope="module")
def estimator_steps(tmp_path_factory):
    return run_distributed(_one_step_per_estimator, 1, (tmp_path_factory.mktemp("estimators"),
                                                        _accepted_estimators()), timeout=300)[0]


@pytest.mark.slow
@pytest.mark.parametrize("kl_in_reward", [False, True], ids=["plain", "kl_in_reward"])
@pytest.mark.parametrize("estimator", _accepted_estimators())
def test_every_accepted_advantage_estimator_trains_a_step(estimator, kl_in_reward, estimator_steps):
    """reinforce_plus_plus_baseline passed validation, then its first step raised "pass
    response_mask": the trainer computed advantages without the mask in the rollout phase and
    again with the KL in the reward. Every name validation accepts now trains a real step."""
    metrics = estimator_steps[estimator, kl_in_reward]
    assert isinstance(metrics, dict), metrics
    for key in ("actor/loss", "actor/grad_norm", "advantage/std"):
        assert math.isfinite(metrics[key]), key
    assert ("actor/reward_kl_penalty" in metrics) is kl_in_reward


def test_cli_runs_tiny_recipe(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", "trainer.total_steps=3",
                           f"logging.output_dir={out}", *FAST, "logging.plot=true", "eval.interval=3",
                           "actor.old_logprob_check_interval=2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    # Step 2 runs the old-log-prob pass over the first mini-batch too: the update's forward gives
    # the same log-probs bitwise on CPU (a sequence's forward does not depend on which sequences
    # share its micro-batch: per-row matmuls, per-sequence attention). Steps 1 and 3 have no
    # pass to compare with, so they log no ratio invariant (it would be 1 by construction).
    assert [("invariant/ratio_dev_first_minibatch" in r) for r in records] == [False, True, False]
    assert records[1]["invariant/ratio_dev_first_minibatch"] == 0.0
    for record in records:
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert record["actor/logprob_abs_diff_mean"] < 1e-4  # engine and trainer agree on log-probs
    assert "eval/pass@1" in records[-1]
    assert (out / "reward_curve.png").stat().st_size > 1000


def _step_with_shifted_old_logprobs(rank, world_size, overrides, shift):
    """One step in which the old-log-prob pass's value for the first sample's first response token
    is moved by `shift`: what the ratio invariant must then report."""
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer import loop
    from megatron_grpo.trainer.setup import build_run

    fill = loop.fill_logprobs

    def shifted(model_chunks, samples, cfg, name, **kwargs):
        fill(model_chunks, samples, cfg, name, **kwargs)
        if name == "old_logprobs":
            samples[0].old_logprobs = [samples[0].old_logprobs[0] + shift, *samples[0].old_logprobs[1:]]

    loop.fill_logprobs = shifted
    run = build_run(load_config("tiny_cpu", overrides))
    try:
        return loop.grpo_step(run, 1)
    finally:
        run.close()


def test_ratio_invariant_measures_the_old_logprob_pass(tmp_path):
    """The invariant is the update's log-probs against the pass's: a pass off by 0.01 on one token
    shows as |exp(-0.01) - 1|, and without a pass over the first mini-batch nothing is logged."""
    common = [*FAST, "eval.interval=-1", "eval.before_train=false"]
    checked = run_distributed(_step_with_shifted_old_logprobs, 1, (
        [*common, f"logging.output_dir={tmp_path / 'on'}", "actor.old_logprob_check_interval=1"], 0.01),
        timeout=300)[0]
    assert checked["invariant/ratio_dev_first_minibatch"] == pytest.approx(1 - math.exp(-0.01), rel=1e-4)
    unchecked = run_distributed(_step_with_shifted_old_logprobs, 1, (
        [*common, f"logging.output_dir={tmp_path / 'off'}"], 0.01), timeout=300)[0]
    assert "invariant/ratio_dev_first_minibatch" not in unchecked


def test_cli_config_error_exits_2_before_building(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", "actor.clip_ratio_hi=0.3",
                           f"logging.output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "clip_ratio_high" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "initial_model").exists()


def test_reference_model_only_when_kl_term_is_on(tmp_path):
    off = run_distributed(_build_and_step, 1, ([*FAST, f"logging.output_dir={tmp_path / 'off'}",
                                                "actor.use_kl_loss=false"],), timeout=300)[0]
    assert off["has_reference"] is False
    assert "actor/kl" not in off["metrics"]
    zero_coef = run_distributed(_build_and_step, 1, ([*FAST, f"logging.output_dir={tmp_path / 'zero'}",
                                                      "actor.use_kl_loss=true", "actor.kl_loss_coef=0"],),
                                timeout=300)[0]
    assert zero_coef["has_reference"] is False
    on = run_distributed(_build_and_step, 1, ([*FAST, f"logging.output_dir={tmp_path / 'on'}",
                                               "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01"],),
                         timeout=300)[0]
    assert on["has_reference"] is True
    # The reference equals the policy at step 1: KL is exactly 0.
    assert on["metrics"]["invariant/kl_at_step1"] == 0.0


# One update per step: a second update would compare Adam steps, and Adam's first step turns fp32
# noise on near-zero gradients into full-size updates (sign(g) * lr).
LAYOUT_COMMON = [*FAST, "trainer.total_steps=2", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01",
                 "actor.old_logprob_check_interval=1"]


# Truncated sampling with sampling replay: every log-prob pass is over each token's support.
REPLAY = ["rollout.top_p=0.9", "rollout.top_k=20"]


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    """The one-process references the layouts are compared with, without and with sampling replay
    (each computed once for the module, when a layout first asks for it)."""
    runs = {}

    def run(replay: bool):
        if replay not in runs:
            out = tmp_path_factory.mktemp("single")
            runs[replay] = run_distributed(_train_in_process, 1, ([*LAYOUT_COMMON, *(REPLAY if replay else []),
                                                                   f"logging.output_dir={out}"],), timeout=600)[0]
        return runs[replay]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout, replay", [(("tensor=2", "pipeline=2"), True), (("tensor=2", "pipeline=1"), False),
                                            (("context=2", "tensor=2"), True), (("context=2",), False)],
                         ids=["tp2-pp2-replay", "tp2-dp2", "cp2-tp2-replay", "cp2-dp2"])
def test_parallel_layouts_match_single_process(tmp_path, layout, replay, single_process_run):
    single = single_process_run(replay)
    parallel = run_distributed(_train_in_process, 4, ([*LAYOUT_COMMON, *(REPLAY if replay else []),
                                                       f"logging.output_dir={tmp_path / 'parallel'}",
                                                       *(f"parallel.{x}" for x in layout)],), timeout=900)[0]
    first_single, first_parallel = single[0], parallel[0]
    assert first_single["reward/mean"] == first_parallel["reward/mean"]  # same rollout
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        assert first_parallel[key] == pytest.approx(first_single[key], rel=1e-5, abs=1e-7), key
    # The old-log-prob pass (forward only, its own micro-batches) and the update's forward agree
    # bitwise in every layout, as on one process.
    assert first_parallel["invariant/ratio_dev_first_minibatch"] == 0.0
    assert first_parallel["invariant/kl_at_step1"] == 0.0
    # the engine's behaviour log-probs and the trainer's agree to fp32 rounding in every layout: with
    # replay both are of the truncated distribution (without it the truncation bias would show here)
    assert first_parallel["mismatch/abs_logp_diff_max"] < 1e-5
    assert first_parallel["mismatch/ratio_outside_frac"] == 0.0


def _reward_rise(records, window=5):
    rewards = [r["reward/mean"] for r in records]
    return sum(rewards[-window:]) / window - sum(rewards[:window]) / window


@pytest.mark.slow
def test_tiny_recipe_learns(tmp_path):
    """The README's first command, `bash scripts/run_default.sh` (this venv's), for 60 of its 150 steps:
    with its fixed seed the mean reward rises by a clear margin (measured: ~0.06 -> ~0.45; the full
    run reaches > 0.8). The suite's one "it learns" run: the parallel layouts are shown equal to this
    one process step for step (above); CI's second lane has the same task learn with a real SGLang
    engine (scripts/test_cluster_lane.sh)."""
    env = {**os.environ, "MEGATRON_GRPO_VENV": sys.prefix}
    run = subprocess.run(["bash", str(REPO / "scripts" / "run_default.sh"), f"logging.output_dir={tmp_path}",
                          "trainer.total_steps=60", "logging.console=false", "logging.plot=false", "eval.interval=-1"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    records = _metrics(tmp_path)
    assert len(records) == 60 and records[0]["reward/mean"] <= 0.3
    assert _reward_rise(records) >= 0.2, [round(r["reward/mean"], 3) for r in records]


def test_full_activation_recompute_gives_the_same_step(tmp_path):
    common = [*FAST, "trainer.total_steps=1"]
    plain = run_distributed(_train_in_process, 1, ([*common, f"logging.output_dir={tmp_path / 'plain'}"],),
                            timeout=300)[0][0]
    recompute = run_distributed(_train_in_process, 1, ([*common, f"logging.output_dir={tmp_path / 'recompute'}",
                                                        "model.recompute_granularity=full"],), timeout=300)[0][0]
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
        assert recompute[key] == pytest.approx(plain[key], rel=1e-6), key


def test_eval_without_a_checkpoint_says_how_to_get_one_before_building_a_model(tmp_path):
    """The README's order: the default run saves no checkpoint (save_interval -1)."""
    from megatron_grpo.errors import CheckpointError
    from megatron_grpo.trainer.evaluation.eval_cli import main as eval_main

    with pytest.raises(CheckpointError) as info:
        eval_main(["tiny_cpu", f"logging.output_dir={tmp_path}"])
    assert str(info.value).startswith(f"no complete checkpoint under {tmp_path / 'checkpoints'} to evaluate: "
                                      "train with checkpoint.save_interval=N")
    assert not (tmp_path / "initial_model").exists()


def test_eval_cli_scores_the_saved_checkpoint(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["tiny_cpu", f"logging.output_dir={tmp_path}", *FAST, "eval.n_samples=2", "eval.greedy=false",
              "eval.pass_k=[1,2]"]
    train = subprocess.run([sys.executable, "-m", "megatron_grpo.train", *common, "trainer.total_steps=2",
                            "checkpoint.save_interval=2", "eval.interval=2"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    trained = _metrics(tmp_path)[-1]
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "eval", *common],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "eval" / "step_2.json").read_text())
    assert result["step"] == 2
    # Same weights, same seeded sampling: the eval of the checkpoint repeats the in-run eval.
    assert result["eval/pass@1"] == trained["eval/pass@1"]
    assert result["eval/pass@2"] == trained["eval/pass@2"]
    assert len(_metrics(tmp_path)) == 2  # the training run's metrics are untouched
