"""algorithm.use_kl_in_reward against verl 0.9.1's own functions (tests/verl_source.py): the
penalised token rewards of ray_trainer.apply_kl_penalty fed to core_algos' GRPO and RLOO outcome
advantages, its current_kl, and the fixed / adaptive controllers' coefficient over 30 steps; then
the trainer with it on 2 data-parallel ranks, and a resume that continues the coefficient."""
from __future__ import annotations

import json
import random
import re
import types
from collections import defaultdict
from typing import Optional

import numpy as np
import pytest
import torch

from megatron_grpo.algo import compute_advantages
from megatron_grpo.algo.kl_in_reward import (AdaptiveKLController, FixedKLController, batch_kl, penalised_scores,
                                             sequence_kl)
from tests.verl_source import verl_definitions

KINDS = ["kl", "abs", "mse", "low_var_kl", "k3+"]


@pytest.fixture(scope="module")
def verl():
    """verl's apply_kl_penalty with the core_algos and torch_functional names it reads."""
    helpers = verl_definitions("utils/torch_functional.py", ["masked_sum", "masked_mean"], {"torch": torch})
    core = verl_definitions("trainer/ppo/core_algos.py",
                            ["AdaptiveKLController", "FixedKLController", "kl_penalty", "kl_penalty_forward",
                             "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage"],
                            {"torch": torch, "np": np, "defaultdict": defaultdict, "Optional": Optional,
                             "AlgoConfig": object})
    trainer = verl_definitions("trainer/ppo/ray_trainer.py", ["apply_kl_penalty"], {
        "torch": torch, "DataProto": object, "masked_mean": helpers["masked_mean"],
        "core_algos": types.SimpleNamespace(**{k: core[k] for k in ("kl_penalty", "AdaptiveKLController")})})
    return types.SimpleNamespace(apply_kl_penalty=trainer["apply_kl_penalty"], **core)


class _Batch(dict):
    """What apply_kl_penalty reads of a DataProto's TensorDict: named tensors and batch_size."""

    @property
    def batch_size(self):
        return torch.Size([len(self["response_mask"])])


def _random_batch(rng: random.Random, groups: int, n: int, width: int):
    lengths = [rng.randint(1, width) for _ in range(groups * n)]
    mask = torch.tensor([[t < length for t in range(width)] for length in lengths], dtype=torch.float32)
    old = -torch.rand(len(lengths), width, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 4
    ref = old + torch.randn(len(lengths), width, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    scores = [float(rng.choice([0.0, 1.0]) + rng.uniform(-0.3, 0.3)) for _ in lengths]
    token_scores = torch.zeros(len(lengths), width)
    for i, length in enumerate(lengths):
        token_scores[i, length - 1] = scores[i]  # verl's reward managers put the score on the last token
    index = np.array([f"g{i // n}" for i in range(len(lengths))], dtype=object)
    return lengths, mask, old, ref, scores, token_scores, index


def _ours(lengths, mask, old, ref, scores, index, kind, beta, estimator):
    kls = [sequence_kl(old[i, :n].tolist(), ref[i, :n].tolist(), None, kind) for i, n in enumerate(lengths)]
    penalised = penalised_scores(torch.tensor(scores, dtype=torch.float64), kls, beta)
    return compute_advantages(estimator, penalised, list(index)), batch_kl(kls)


def test_penalised_advantages_and_batch_kl_equal_verls_on_random_batches(verl):
    """200 random batches (ragged lengths, every estimator kind, random beta): 0 disagreements beyond
    float32 rounding (verl computes in the log-probs' float32, we in float64)."""
    rng = random.Random(0)
    tol = 64 * torch.finfo(torch.float32).eps
    disagreements, compared = [], 0
    for trial in range(200):
        kind, beta, estimator = rng.choice(KINDS), rng.uniform(0.0, 0.5), rng.choice(["grpo", "rloo"])
        lengths, mask, old, ref, scores, token_scores, index = _random_batch(rng, rng.randint(1, 4),
                                                                             rng.randint(2, 5), 12)
        data = types.SimpleNamespace(batch=_Batch(response_mask=mask, token_level_scores=token_scores,
                                                  old_log_probs=old, ref_log_prob=ref))
        controller = verl.FixedKLController(kl_coef=beta)
        data, verl_metrics = verl.apply_kl_penalty(data, controller, kl_penalty=kind)
        advantage_fn = (verl.compute_grpo_outcome_advantage if estimator == "grpo"
                        else verl.compute_rloo_outcome_advantage)
        verl_advantages, _ = advantage_fn(data.batch["token_level_rewards"], mask, index)
        ours, current_kl = _ours(lengths, mask, old, ref, scores, index, kind, beta, estimator)
        for i in range(len(lengths)):
            compared += 1
            want = float(verl_advantages[i, 0])
            if abs(float(ours[i]) - want) > tol * (1 + abs(want) * 10):
                disagreements.append((trial, kind, estimator, i, float(ours[i]), want))
        want_kl = verl_metrics["actor/reward_kl_penalty"]
        if abs(current_kl - want_kl) > tol * (1 + abs(want_kl) * 10):
            disagreements.append((trial, kind, "current_kl", current_kl, want_kl))
    assert compared > 1000 and disagreements == []


def test_masked_tokens_carry_no_penalty():
    """Multi-turn: observation tokens (mask False) neither count in the sum nor in the token mean."""
    kl = sequence_kl([-1.0, -2.0, -3.0], [-1.5, -9.0, -2.0], [True, False, True], "kl")
    assert kl.total == pytest.approx(0.5 + -1.0) and kl.token_mean == pytest.approx(-0.5 / 2)


def test_adaptive_coefficient_follows_verls_controller_for_30_steps(verl):
    """Both controllers stepped with the same 30 observed KLs (inside and outside the ±20 % clip)
    and batch sizes: the coefficients agree bitwise at every step (the same float64 arithmetic)."""
    rng = random.Random(1)
    theirs = verl.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=200)
    ours = AdaptiveKLController(0.05, target=0.1, horizon=200)
    fixed_theirs, fixed_ours = verl.FixedKLController(kl_coef=0.05), FixedKLController(0.05)
    trajectory = []
    for _ in range(30):
        current_kl, batch = rng.uniform(0.0, 0.3), rng.choice([16, 64, 256])
        for controller in (theirs, ours, fixed_theirs, fixed_ours):
            controller.update(current_kl=current_kl, n_steps=batch)
        trajectory.append((ours.value, float(theirs.value)))
        assert fixed_ours.value == fixed_theirs.value == 0.05
    assert all(a == b for a, b in trajectory)
    assert len({round(a, 12) for a, _ in trajectory}) == 30  # it moved every step


# ----- the trainer -------------------------------------------------------------------------------
def _train(rank, world_size, overrides):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.loop import train

    cfg = load_config("tiny_cpu", overrides)
    train(cfg)
    with open(f"{cfg.logging.output_dir}/metrics.jsonl") as handle:
        return [json.loads(line) for line in handle] if rank == 0 else None


@pytest.mark.slow
def test_trainer_applies_kl_in_reward_on_two_dp_ranks_and_resumes_the_coefficient(tmp_path):
    """DP=2: each rank computes the log-probs of half the batch, every rank gets every sequence's
    KL. The logged coefficient follows the adaptive rule from the logged KL step after step, and a
    run resumed from the step-2 checkpoint logs step 3 exactly as the uninterrupted run."""
    from megatron_grpo.testing.distributed import run_distributed

    target, horizon, batch = 0.001, 50, 8 * 4  # a target the run's KL passes: the clip shows too

    def overrides(output, steps):
        return ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                "algorithm.kl_ctrl.kl_coef=0.2", f"algorithm.kl_ctrl.target_kl={target}",
                f"algorithm.kl_ctrl.horizon={horizon}", "data.train_batch_size=8", "rollout.n=4",
                "data.max_response_length=8", "actor.ppo_mini_batch_size=8", "actor.optim.lr=1e-2",
                f"trainer.total_steps={steps}", "checkpoint.save_interval=2", f"logging.output_dir={output}",
                "logging.console=false", "logging.plot=false", "eval.interval=-1"]

    full = run_distributed(_train, 2, (overrides(tmp_path / "full", 3),), timeout=600)[0]
    betas = [r["actor/reward_kl_penalty_coeff"] for r in full]
    kls = [r["actor/reward_kl_penalty"] for r in full]
    assert betas[0] == 0.2 and all(k > 0 for k in kls[1:])
    for step in range(1, 3):
        error = min(max(kls[step - 1] / target - 1, -0.2), 0.2)
        assert betas[step] == pytest.approx(betas[step - 1] * (1 + error * batch / horizon), rel=1e-12)
    step_2 = tmp_path / "full" / "checkpoints" / "step_2"
    resumed = run_distributed(_train, 2, (overrides(tmp_path / "resumed", 3) + [f"checkpoint.resume={step_2}"],),
                              timeout=600)[0]
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["actor/reward_kl_penalty_coeff"] == betas[2]
    assert resumed[0]["actor/reward_kl_penalty"] == kls[2]


@pytest.mark.parametrize("overrides, named", [
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon=0 must be > 0"),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"], "algorithm.kl_ctrl.target_kl=0.0 must be"),
    (["algorithm.kl_ctrl.kl_coef=-0.1"], "algorithm.kl_ctrl.kl_coef=-0.1 must be >= 0"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward"],
     "algorithm.filter_groups.metric=seq_reward with algorithm.use_kl_in_reward=true"),
])
def test_kl_in_reward_settings_that_cannot_work_are_refused_by_key(overrides, named):
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(named)):
        validate(load_config("tiny_cpu", ["algorithm.use_kl_in_reward=true", *overrides]))
