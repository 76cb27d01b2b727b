"""Resume on another layout: a run saved at TP2 x PP2 continues at TP1 x PP1, then at DP2; and DP2 -> DP1.

What must hold, and why these tolerances (fp32 throughout):
  * The state a resume loads is the state that was saved, bitwise, whatever the layouts: every
    model and optimizer tensor (megatron's fully_reshardable format is model-space: resaved at the
    new layout, each tensor equals the saved one), and the policy weights the rollout engine
    receives (an independent gather path: weight_sync's HF conversion).
  * The step after the resume then differs from the run it continues (the uninterrupted run at
    the saving layout) only by the new layout's arithmetic: other TP / PP / DP splits add the same
    products in another order. Its rollout is the same (same weights, same RNG state): rewards are
    equal exactly.
      LOSS_RTOL     loss and gradient norm: fp32 dot products of 64-128 terms summed in another
                    order differ by a few ulp x sqrt(terms), ~1e-6 relative at most; measured
                    <= 2.0e-7 (loss) and 7.1e-8 (grad norm).
      UPDATE_RTOL   the step's weight update, per tensor, |update difference| / |update|. Adam's
                    update m / (sqrt(v) + eps) passes a gradient's relative rounding (~1e-7) on 1:1
                    where the gradient is well above its rounding, and amplifies it only where the
                    gradient nearly cancels; measured <= 1.7e-5. A wrongly restored state (moments,
                    Adam's step count, lr) changes the update by 10-100 %.
      UPDATE_ATOL   max |weight difference| after the step, as a fraction of lr: Adam moves each
                    weight by up to ~lr per step, so a restore error shows at ~lr; the layout's
                    rounding is ~1 ulp of |w| <= 1 (6e-8 = 4e-5 lr); measured 6e-8.
The DP 2 -> 1 question of the earlier test: compared with a run at DP=1 all along, the resumed run
differs by 2.1e-6 after step 3, exactly what the uninterrupted DP=1 and DP=2 runs differ by
(3.7e-7 after step 1, 2.1e-6 after step 2: the DP arithmetic of steps 1-2, amplified by Adam's
first steps); against the DP=2 run it continues, the difference is 2.3e-8 after step 3.
"""
import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed
from tests.train_harness import train_capturing as _train

FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "rollout.n=4", "logging.console=false", "logging.plot=false", "eval.interval=-1", "trainer.total_steps=4"]
TP2_PP2 = ["parallel.tensor=2", "parallel.pipeline=2"]
LR = 1.5e-3  # tiny_cpu's actor.optim.lr
LOSS_RTOL = 1e-5
UPDATE_RTOL = 1e-3
UPDATE_ATOL = 1e-3 * LR


def _plain_tensors(rank, world_size, path):
    """Every tensor of a megatron checkpoint folder, as full (unsharded) tensors by key."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    def flat(tree, prefix=""):  # tensors only (the param groups' settings are checked by the next step)
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor):
                yield f"{prefix}{key}", value.clone()

    return dict(flat(load_plain_tensors(str(path))))


def _assert_same_state(saved_dir, resaved_dir):
    """Bitwise, key by key. Embedding / output rows are padded to a multiple of 128 x TP, so at
    another TP size the checkpoints hold different numbers of padding rows: the rows both have
    are compared (the vocabulary and some padding)."""
    saved = run_distributed(_plain_tensors, 1, (saved_dir,), timeout=120)[0]
    resaved = run_distributed(_plain_tensors, 1, (resaved_dir,), timeout=120)[0]
    assert sorted(saved) == sorted(resaved)
    optimizer_keys = [k for k in saved if k.startswith("optimizer.state.exp_avg")]
    assert optimizer_keys, "the optimizer state is in the checkpoint in model space"
    for key, before in saved.items():
        after = resaved[key]
        rows = min(before.shape[0], after.shape[0])
        assert before.shape[1:] == after.shape[1:], key
        assert torch.equal(before[:rows], after[:rows]), key


def _compare_step(resumed, reference, step, label):
    """The step after a resume against the same step of the run it continues."""
    got, want = resumed["metrics"][step], reference["metrics"][step]
    assert got["reward/mean"] == want["reward/mean"], label  # the same rollout
    for key in ("actor/loss", "actor/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=LOSS_RTOL), (label, key)
    before = reference["steps"][step - 1] if step - 1 in reference["steps"] else resumed["at_resume"]
    worst_abs = worst_rel = 0.0
    for name, want_w in reference["steps"][step].items():
        got_w = resumed["steps"][step][name]
        update = want_w - before[name]
        diff = (got_w - want_w).abs().max().item()
        worst_abs = max(worst_abs, diff)
        if update.norm() > 0:
            worst_rel = max(worst_rel, ((got_w - want_w).norm() / update.norm()).item())
    rel = {key: abs(got[key] - want[key]) / abs(want[key]) for key in ("actor/loss", "actor/grad_norm")}
    print(f"\n{label}: step {step} after the resume vs the run it continues: max |weight diff| {worst_abs:.3g} "
          f"= {worst_abs / LR:.3g} lr; |update diff| / |update| {worst_rel:.3g}; loss {rel['actor/loss']:.2g} and "
          f"grad norm {rel['actor/grad_norm']:.2g} relative")
    assert worst_rel <= UPDATE_RTOL, label
    assert worst_abs <= UPDATE_ATOL, label


@pytest.mark.slow
def test_resume_tp2_pp2_then_tp1_then_dp2(tmp_path):
    # The uninterrupted run at TP2 x PP2, saving at step 2.
    origin = tmp_path / "origin"
    uninterrupted = run_distributed(
        _train, 4, ([*FAST, *TP2_PP2, "checkpoint.save_interval=2", f"logging.output_dir={origin}"],),
        timeout=400)[0]
    step_2 = origin / "checkpoints" / "step_2"

    # Step 3 at TP1 x PP1 from its step 2, then stop (checkpoint step_3).
    single = tmp_path / "single"
    at_tp1 = run_distributed(_train, 1, ([*FAST, f"checkpoint.resume={step_2}", f"logging.output_dir={single}"],
                                         3, tmp_path / "resaved_tp1"), timeout=300)[0]
    _assert_same_state(step_2 / "model_optim", tmp_path / "resaved_tp1")
    for name, value in uninterrupted["steps"][2].items():
        assert torch.equal(at_tp1["at_resume"][name], value), name
    _compare_step(at_tp1, uninterrupted, 3, "TP2xPP2 -> TP1")

    # Step 4 at DP2 from that step 3, against step 4 continued at TP1 (the uninterrupted run there).
    step_3 = single / "checkpoints" / "step_3"
    at_dp2 = run_distributed(_train, 2, ([*FAST, f"checkpoint.resume={step_3}",
                                          f"logging.output_dir={tmp_path / 'dp2'}"],
                                         None, tmp_path / "resaved_dp2"), timeout=300)[0]
    continued = run_distributed(_train, 1, ([*FAST, f"checkpoint.resume={step_3}",
                                             f"logging.output_dir={tmp_path / 'tp1'}"],), timeout=300)[0]
    _assert_same_state(step_3 / "model_optim", tmp_path / "resaved_dp2")
    for name, value in at_tp1["steps"][3].items():
        assert torch.equal(at_dp2["at_resume"][name], value), name
        assert torch.equal(continued["at_resume"][name], value), name
    _compare_step(at_dp2, continued, 4, "TP1 -> DP2")


@pytest.mark.slow
def test_resume_dp2_to_dp1(tmp_path):
    """Saved by 2 data-parallel ranks (stopped by a signal that reaches rank 1 only), resumed by
    one. The reference for step 3 is the DP=2 run itself continuing: comparing with a run that was
    at DP=1 all along (as before) adds the DP=1 vs DP=2 arithmetic of steps 1-2, which is not the
    resume's doing and which Adam amplifies step after step (README: the figures)."""
    uninterrupted = run_distributed(_train, 2, ([*FAST, f"logging.output_dir={tmp_path / 'dp2'}"],), timeout=300)[0]
    saved = run_distributed(_train, 2, ([*FAST, f"logging.output_dir={tmp_path / 'saved'}"], 2, None, 1),
                            timeout=300)[0]
    step_2 = tmp_path / "saved" / "checkpoints" / "step_2"
    assert (step_2 / "rng" / "tp0-pp0-cp0-dp1.pt").is_file()
    for name, value in uninterrupted["steps"][2].items():
        assert torch.equal(saved["steps"][2][name], value), name  # stopping did not change the run

    resumed = run_distributed(_train, 1, ([*FAST, f"logging.output_dir={tmp_path / 'saved'}"], None,
                                          tmp_path / "resaved"), timeout=300)[0]
    _assert_same_state(step_2 / "model_optim", tmp_path / "resaved")
    for name, value in uninterrupted["steps"][2].items():
        assert torch.equal(resumed["at_resume"][name], value), name
    assert sorted(resumed["metrics"]) == [1, 2, 3, 4]  # steps 1-2 kept from the DP=2 life
    _compare_step(resumed, uninterrupted, 3, "DP2 -> DP1")
