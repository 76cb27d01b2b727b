"""Resuming with changed settings, and checkpoints that fail to load.

  * A new actor.optim.lr is the one the optimizer uses after a resume: from the same restored
    state and the same rollout, the step's weight update scales by new_lr / old_lr (Adam's
    update, decoupled weight decay included, is linear in lr).
  * The checks that run before anything is restored (resume_plan.check_restorable): the prompt
    sampler must fit the prompts (unless checkpoint.resume=force), a changed batch size continues
    at the same prompt, the optimizer state must be reshardable to the layout.
  * A damaged shard (same size, so complete.json cannot tell) fails torch DCP's read with a
    CheckpointException, a BaseException: the newest checkpoint is skipped with a warning and the
    one before it loads; when none loads, the half-overwritten model is not trained from step 0.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_grpo.errors import CheckpointError
from megatron_grpo.testing.distributed import DistributedChildError, run_distributed
from megatron_grpo.trainer.state.run_folder import RunFolderError
from tests.train_harness import train_capturing

FAST = ["data.max_response_length=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "rollout.n=4", "logging.console=false", "logging.plot=false", "eval.interval=-1"]


@pytest.mark.slow
def test_a_new_lr_is_what_the_optimizer_uses_after_resume(tmp_path):
    old_lr, new_lr = 1.5e-3, 1e-3  # tiny_cpu's lr, and the resumed run's
    first = run_distributed(train_capturing, 1, ([*FAST, "trainer.total_steps=3", "checkpoint.save_interval=2",
                                                  f"logging.output_dir={tmp_path / 'first'}"],), timeout=300)[0]
    step_2 = tmp_path / "first" / "checkpoints" / "step_2"
    resumed = run_distributed(train_capturing, 1, ([*FAST, "trainer.total_steps=3", f"checkpoint.resume={step_2}",
                                                    f"actor.optim.lr={new_lr}",
                                                    f"logging.output_dir={tmp_path / 'resumed'}"],), timeout=300)[0]
    before = first["steps"][2]
    assert all((resumed["at_resume"][n] == w).all() for n, w in before.items())  # the same restored state
    got, want = resumed["metrics"][3], first["metrics"][3]
    assert want["actor/lr"] == old_lr and got["actor/lr"] == new_lr
    assert got["reward/mean"] == want["reward/mean"] and got["actor/grad_norm"] == want["actor/grad_norm"]
    # The update is linear in lr (AdamW: w * (1 - lr wd) - lr / bias_correction * m / (sqrt(v) + eps)
    # on the same m, v and gradient), so the resumed update is the first run's times the lr ratio,
    # up to the fp32 rounding of what forms w3 from w2: 1 - lr wd, w times that, plus the update,
    # each <= 1/2 ulp(|w|) in relative terms, so <= 1.5 ulp per run and 2.5 ulp for the two runs
    # compared (one scaled by the ratio < 1); w3 - w2 itself is exact (Sterbenz). Bound: 4 ulp(|w|).
    ulp = torch.finfo(torch.float32).eps
    worst = 0.0
    for name, w2 in before.items():
        expected = (first["steps"][3][name] - w2) * (new_lr / old_lr)
        actual = resumed["steps"][3][name] - w2
        bound = 4 * ulp * torch.maximum(w2.abs(), first["steps"][3][name].abs())
        worst = max(worst, ((actual - expected).abs() / bound).max().item())
    print(f"\nupdate at the new lr vs the lr ratio x the update at the old one: at most {worst:.3g} x 4 ulp(|w|)")
    assert worst <= 1.0


# ----------------------------------------------------------------------------- checks before restoring


def _candidate(tmp_path, sampler, **trainer_state):
    from megatron_grpo.trainer.state.resume_plan import Candidate

    saved_config = {"parallel": {"use_distributed_optimizer": True}, "data": {"train_batch_size": 8}}
    state = {"step": 2, "sampler": sampler, "layout": {"tp": 1, "pp": 1}, **trainer_state}
    return Candidate(tmp_path / "step_2", 2, state, saved_config, record=None)


def _config(*overrides):
    from megatron_grpo.config import load_config

    return load_config("tiny_cpu", [*FAST, *overrides])


SAMPLER = {"epoch": 1, "batch_in_epoch": 3, "seed": 1, "num_items": 4096, "batch_size": 8, "shuffle": True,
           "drop_last": True}
TP1 = {"tp": 1, "pp": 1}


def test_the_sampler_must_fit_the_prompts_unless_forced(tmp_path):
    from megatron_grpo.trainer.state.resume_plan import check_restorable

    candidate = _candidate(tmp_path, SAMPLER)
    [checked] = check_restorable(_config(), [candidate], {}, num_prompts=4096, layout=TP1)
    assert checked.sampler_state == SAMPLER
    with pytest.raises(RunFolderError, match=r"does not fit these prompts \(num_items: 4096 -> 4000\)"):
        check_restorable(_config(), [candidate], {}, num_prompts=4000, layout=TP1)
    with pytest.raises(RunFolderError, match=r"seed: 1 -> 7"):
        check_restorable(_config("data.seed=7"), [candidate], {}, num_prompts=4096, layout=TP1)
    [forced] = check_restorable(_config("checkpoint.resume=force"), [candidate], {}, num_prompts=4000, layout=TP1)
    assert forced.sampler_state is None and any(c.startswith("sampler: starts over") for c in forced.changes)


def test_a_changed_batch_size_continues_at_the_same_prompt():
    from megatron_grpo.data.sampler import PromptSampler
    from megatron_grpo.trainer.state.resume_plan import continue_at_batch_size

    items = list(range(100))
    old = PromptSampler(items, batch_size=8, seed=3)
    for _ in range(12 + 4):  # one epoch (12 batches) and 4 batches: 32 prompts of epoch 1 drawn
        next(old)
    drawn_in_epoch_1 = set(old.epoch_order(1)[:32])
    state, note = continue_at_batch_size(old.state_dict(), 16)
    assert note == "sampler: epoch 1 had 32 prompts drawn in batches of 8; continues with batch 2 of size 16"
    new = PromptSampler(items, batch_size=16, seed=3)
    new.load_state_dict(state)
    assert next(new) == old.epoch_order(1)[32:48] and not drawn_in_epoch_1 & set(old.epoch_order(1)[32:48])
    state, note = continue_at_batch_size(old.state_dict(), 12)  # 32 = 2 x 12 + 8: skip 4 prompts
    assert state["batch_in_epoch"] == 3 and note.endswith("continues with batch 3 of size 12 (skipping 4 prompts)")


def test_an_optimizer_state_that_reshards_only_over_dp_needs_the_same_tp_pp(tmp_path):
    from megatron_grpo.trainer.state.resume_plan import check_restorable

    old = _candidate(tmp_path, None, layout={"tp": 2, "pp": 2})  # format 1: no optimizer_format, dp_reshardable
    with pytest.raises(RunFolderError, match=r"saved at parallel.tensor=2 pipeline=2 .* 'dp_reshardable' format"):
        check_restorable(_config(), [old], {}, num_prompts=4096, layout=TP1)
    check_restorable(_config(), [old], {}, num_prompts=4096, layout={"tp": 2, "pp": 2})  # any DP
    for model_space in ("fully_reshardable", "fully_sharded_model_space"):  # the format before, the one saved now
        new = _candidate(tmp_path, None, layout={"tp": 2, "pp": 2}, optimizer_format=model_space)
        check_restorable(_config(), [new], {}, num_prompts=4096, layout=TP1)
    with pytest.raises(RunFolderError, match=r"distributed optimizer state; this run has "
                                             r"parallel.use_distributed_optimizer=false"):
        check_restorable(_config("parallel.use_distributed_optimizer=false"), [new], {}, num_prompts=4096,
                         layout=TP1)


def _fake_step(root: Path, step: int, cfg) -> Path:
    """A complete step folder with the files the checks read (no megatron state)."""
    from megatron_grpo.config import to_yaml
    from megatron_grpo.trainer.state.run_folder import run_definition

    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    (path / "config.yaml").write_text(to_yaml(cfg))
    (path / "run.json").write_text(json.dumps({"format": 1, "definition": run_definition(cfg), "shapes": {}}))
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    (path / "complete.json").write_text(json.dumps({"format": 1, "step": step, "files": files}))
    return path


def test_definitions_are_checked_for_every_checkpoint_a_resume_may_load(tmp_path):
    from megatron_grpo.trainer.state.resume_plan import check_definitions

    run = tmp_path / "run"
    _fake_step(run / "checkpoints", 2, _config("trainer.seed=5"))
    here = [f"logging.output_dir={run}"]
    with pytest.raises(RunFolderError, match=r"step_2 was written by another run \(trainer.seed: 5 -> 1\)"):
        check_definitions(_config(*here))
    [forced] = check_definitions(_config(*here, "checkpoint.resume=force"))
    assert forced.step == 2
    assert [c.step for c in check_definitions(_config(*here, "trainer.seed=5", "actor.optim.lr=1e-4"))] == [2]

    # Resuming another folder's checkpoint into a folder that holds a third run's checkpoints.
    other = _fake_step(tmp_path / "other" / "checkpoints", 7, _config())
    with pytest.raises(RunFolderError, match=r"this run saves into .*run/checkpoints, which holds checkpoints "
                                             r"of another run \(trainer.seed: 5 -> 1\)"):
        check_definitions(_config(*here, f"checkpoint.resume={other}"))
    assert [c.step for c in check_definitions(_config(f"logging.output_dir={tmp_path / 'new'}",
                                                      f"checkpoint.resume={other}"))] == [7]


# ----------------------------------------------------------------------------- damaged checkpoints


def _damage(shard: Path) -> None:
    """Same size, other bytes: complete.json's sizes still match."""
    shard.write_bytes(b"\0" * shard.stat().st_size)


def _train(rank, world_size, overrides):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer import loop

    loop.train(load_config("tiny_cpu", overrides))


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_and_the_previous_one_loads(tmp_path):
    args = [*FAST, "trainer.total_steps=2", "checkpoint.save_interval=1", f"logging.output_dir={tmp_path}"]
    run_distributed(_train, 1, (args,), timeout=300)
    root = tmp_path / "checkpoints"
    _damage(next((root / "step_2" / "model_optim").glob("__0_*.distcp")))
    again = run_distributed(train_capturing, 1, (args,), timeout=300)[0]
    assert sorted(again["steps"]) == [2]  # resumed from step_1, step 2 trained again
    assert json.loads((root / "step_2" / "complete.json").read_text())["step"] == 2  # rewritten, loadable

    # Now the only checkpoint is damaged: the failed read wrote into the model, so no fresh start.
    os.rename(root / "step_1", tmp_path / "step_1-moved-away")
    _damage(next((root / "step_2" / "model_optim").glob("__0_*.distcp")))
    with pytest.raises(DistributedChildError) as info:
        run_distributed(_train, 1, (args,), timeout=300)
    assert CheckpointError.__name__ in str(info.value)
    assert "overwrote part of the model before failing, so the run cannot start from step 0 either" in str(info.value)
