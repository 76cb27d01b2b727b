"""Resume on another layout: a run saved at TP2 x PP2 continues at TP1 x PP1, then at DP2; and DP2 -> DP1.

What must hold, and why these tolerances (fp32 throughout):
  * The state a resume loads is the state that was saved, bitwise, whatever the layouts: every
    model and optimizer tensor (megatron's fully_reshardable format is model-space), and the
    policy weights the rollout engine receives (an independent gather path: weight_sync's HF
    conversion).
  * The step after the resume then differs from the uninterrupted run only by the new layout's
    arithmetic (other TP/PP splits sum the same products in another order). Its rollout is the
    same (same weights, same RNG), so the rewards are equal exactly. Its loss and gradient norm
    agree to fp32 rounding of such sums (LOSS_RTOL). Its weight update, lr * m/(sqrt(v)+eps),
    amplifies relative gradient differences only where sqrt(v) is tiny: the update difference is
    bounded relative to the update itself (UPDATE_RTOL) and in absolute terms by a small fraction
    of one step of lr (UPDATE_ATOL_LR).
"""
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed

FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "rollout.n=4", "logging.console=false", "logging.plot=false", "eval.interval=-1", "trainer.total_steps=4"]
TP2_PP2 = ["parallel.tensor=2", "parallel.pipeline=2"]
LR = 1.5e-3  # tiny_cpu's actor.optim.lr
LOSS_RTOL = 1e-5
UPDATE_RTOL = 1e-3
UPDATE_ATOL_LR = 1e-3


def _train(rank, world_size, overrides, stop_after=None, resave_dir=None, signal_rank=0):
    """train() in this process. Rank 0 returns the engine's weights after every step (and right
    after the resume) and the metrics; with resave_dir, the resumed state is saved there again
    at this layout; with stop_after, SIGUSR1 (sent to signal_rank only: the ranks must agree)
    stops the run after that step (checkpoint, clean exit)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer import checkpoint, loop

    captured = {"steps": {}}
    build_run, grpo_step = loop.build_run, loop.grpo_step

    def engine_weights(run):
        return {k: v.detach().clone() for k, v in run.engine.model.state_dict().items()}

    def capture_run(cfg):
        captured["run"] = build_run(cfg)
        return captured["run"]

    def step_and_capture(run, step):
        metrics = grpo_step(run, step)
        if run.is_main:
            captured["steps"][step] = engine_weights(run)
        if step == stop_after and rank == signal_rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        return metrics

    class Resaving(loop.Checkpointer):
        def resume(self):
            step = super().resume()
            if self.run.is_main:
                captured["at_resume"] = engine_weights(self.run)
            if resave_dir is not None:
                if rank == 0:
                    Path(resave_dir).mkdir(parents=True)
                dist.barrier()
                state, _ = checkpoint._sharded_state_dict(self.run, is_loading=False)
                dist_checkpointing.save(state, str(resave_dir))
            return step

    loop.build_run, loop.grpo_step, loop.Checkpointer = capture_run, step_and_capture, Resaving
    cfg = load_config("tiny_cpu", overrides)
    validate(cfg, world_size=world_size)
    loop.train(cfg)
    if rank != 0:
        return None
    return {"steps": captured["steps"], "at_resume": captured.get("at_resume"),
            "metrics": _metrics(cfg.logging.output_dir)}


def _metrics(out_dir):
    by_step = {}
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    return by_step


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
    print(f"\n{label}: step {step} after the resume vs the uninterrupted run: max |weight diff| "
          f"{worst_abs:.3g} = {worst_abs / LR:.3g} lr; |update diff| / |update| {worst_rel:.3g}; loss "
          f"{got['actor/loss']:.9g} vs {want['actor/loss']:.9g}; grad norm {got['actor/grad_norm']:.9g} vs "
          f"{want['actor/grad_norm']:.9g}")
    assert worst_rel <= UPDATE_RTOL, label
    assert worst_abs <= UPDATE_ATOL_LR * LR, label


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
    at_dp2 = run_distributed(_train, 2, ([*FAST, f"checkpoint.resume={step_3}", f"logging.output_dir={tmp_path / 'dp2'}"],
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
