"""DAPO's soft overlong punishment (reward.overlong_buffer) against verl 0.9.1's own DAPO reward
manager (build/verl-0.9.1/verl/workers/reward_manager/dapo.py, scripts/install_verl_code.sh), its
verl-key translation, and where the trainer applies it: added to each score, with the group
filter reading the score before it (metric acc / score) or after it (seq_reward)."""
from __future__ import annotations

import random
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_grpo.rewards.overlong import OverlongPenalty
from tests.requirements import missing

REPO = Path(__file__).resolve().parents[1]
VERL_DAPO = REPO / "build/verl-0.9.1/verl/workers/reward_manager/dapo.py"


def _verl_dapo_manager_class():
    """verl's DAPORewardManager from its file. The module's imports (verl.protocol pulls Ray and
    tensordict, which do not install here) are stood in for by the four names it uses; the
    penalty arithmetic in __call__ is verl's, unchanged."""
    if not VERL_DAPO.is_file():
        missing("verl 0.9.1's code is not in build/verl-0.9.1 (bash scripts/install_verl_code.sh)")
    import importlib.util

    class AbstractRewardManager:
        def _extract_reward_from_rm_scores(self, data, return_dict=False):
            return None  # no reward-model scores in the batch: verl's rule-based path

    stubs = {"verl": types.SimpleNamespace(DataProto=object),
             "verl.utils.reward_score": types.SimpleNamespace(default_compute_score=None),
             "verl.workers.reward_manager": types.SimpleNamespace(register=lambda name: (lambda cls: cls)),
             "verl.workers.reward_manager.abstract": types.SimpleNamespace(AbstractRewardManager=AbstractRewardManager)}
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("verl_reference_dapo", VERL_DAPO)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module.DAPORewardManager


class _Item:  # what verl's manager reads of one DataProtoItem
    def __init__(self, prompt_len: int, response_len: int, width: int, score: float):
        mask = torch.zeros(prompt_len + width, dtype=torch.long)
        mask[:prompt_len + response_len] = 1
        self.batch = {"prompts": torch.ones(prompt_len, dtype=torch.long),
                      "responses": torch.ones(width, dtype=torch.long), "attention_mask": mask}
        self.non_tensor_batch = {"reward_model": {"ground_truth": str(score)}, "data_source": "test"}


class _Batch:
    def __init__(self, items):
        self.items = items
        self.batch = {"responses": torch.stack([i.batch["responses"] for i in items])}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class _Tokenizer:
    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def test_penalty_equals_verls_dapo_reward_manager_on_random_lengths():
    manager_class = _verl_dapo_manager_class()
    rng = random.Random(0)
    disagreements, cases = [], 0
    for max_len, buffer, factor in [(20480, 4096, 1.0), (1024, 128, 0.5), (64, 64, 2.0), (33, 1, 1.0)]:
        config = types.SimpleNamespace(enable=True, len=buffer, penalty_factor=factor, log=True)
        manager = manager_class(_Tokenizer(), num_examine=0, compute_score=lambda **kw: float(kw["ground_truth"]),
                                max_resp_len=max_len, overlong_buffer_cfg=config)
        lengths = [rng.randint(1, max_len) for _ in range(60)] + [1, max_len - buffer, max_len - buffer + 1, max_len]
        scores = [rng.choice([0.0, 1.0, -1.0, 0.25]) for _ in lengths]
        items = [_Item(rng.randint(1, 5), length, max_len, score) for length, score in zip(lengths, scores)]
        result = manager(_Batch(items), return_dict=True)
        verl_rewards = [float(result["reward_tensor"][i, length - 1]) for i, length in enumerate(lengths)]
        ours = OverlongPenalty(max_response_length=max_len, length=buffer, penalty_factor=factor)
        for length, score, theirs in zip(lengths, scores, verl_rewards):
            mine = score + ours(length)
            # verl's reward tensor is float32: one float32 rounding of the same value
            if abs(mine - theirs) > torch.finfo(torch.float32).eps * max(1.0, abs(mine)):
                disagreements.append((max_len, buffer, factor, length, score, mine, theirs))
            cases += 1
        assert [p < 0 for p in map(ours, lengths)] == result["reward_extra_info"]["overlong"]
    assert cases == 4 * 64 and not disagreements, disagreements[:5]


def test_verl_dapo_arguments_translate_and_validate():
    """The reward part of verl's DAPO example scripts (both spellings of the reward section), at a
    length that the tiny recipe's micro-batches hold."""
    from megatron_grpo.config import validate
    from megatron_grpo.config.from_verl import parse_command_line, translate
    from megatron_grpo.config.loader import load_config

    for section, manager in (("reward_model", "reward_model.reward_manager=dapo"),
                             ("reward", "reward.reward_manager.name=dapo")):
        args = [manager, f"+{section}.reward_kwargs.overlong_buffer_cfg.enable=True",
                f"+{section}.reward_kwargs.overlong_buffer_cfg.len=256",
                f"+{section}.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                f"+{section}.reward_kwargs.overlong_buffer_cfg.log=False",
                f"+{section}.reward_kwargs.max_resp_len=1024", "data.max_response_length=1024",
                "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"]
        translation = translate(parse_command_line(args))
        assert {k: v for k, v in translation.values.items() if k.startswith("reward.overlong")} == {
            "reward.overlong_buffer.enable": True, "reward.overlong_buffer.len": 256,
            "reward.overlong_buffer.penalty_factor": 1.0, "reward.overlong_buffer.log": False,
            "reward.overlong_buffer.max_response_length": 1024}
        assert not translation.unmapped and not translation.changed, (translation.unmapped, translation.changed)
        overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in translation.values.items()
                     if k.startswith(("reward.overlong", "algorithm.filter", "data.max_response"))]
        validate(load_config("tiny_cpu", overrides))
    # another manager ignores overlong_buffer_cfg in verl: said so, nothing set
    translation = translate(parse_command_line(["reward_model.reward_manager=naive",
                                                "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True"]))
    assert not any(k.startswith("reward.overlong") for k in translation.values)
    assert any("only verl's dapo reward manager" in line for line in translation.changed), translation.changed


@pytest.mark.parametrize("overrides, message", [
    (["reward.overlong_buffer.enable=true"], "reward.overlong_buffer.len=0 must be > 0"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=999"],
     "reward.overlong_buffer.len=999 is longer than the response cap"),
    (["algorithm.filter_groups.metric=accuracy"], "algorithm.filter_groups.metric='accuracy' must be one of acc"),
])
def test_bad_overlong_and_filter_settings_are_named(overrides, message):
    from megatron_grpo.config import validate
    from megatron_grpo.config.loader import load_config
    from megatron_grpo.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(load_config("tiny_cpu", overrides))


class _LengthsEngine:
    """Answers every prompt with responses of the given lengths, in sample order."""

    weight_version = 0

    def __init__(self, lengths):
        self.lengths = lengths

    def generate(self, requests, on_request_done=None):
        from megatron_grpo.rollout.engine import report_each_request
        from megatron_grpo.rollout.types import Sample

        return report_each_request(requests, [
            Sample(group_id=r.group_id, sample_index=i, prompt_ids=list(r.prompt_ids), response_ids=[7] * length,
                   logprobs=[-0.5] * length, finish_reason="length", weight_version=0)
            for r in requests for i, length in enumerate(self.lengths)], on_request_done)


def _constant_score(prompt, response, ground_truth, extra):
    return 1.0


def _rollout(metric: str):
    from megatron_grpo.algo import AdvantageConfig
    from megatron_grpo.data.prompts import EncodedPrompt
    from megatron_grpo.data.records import PromptRecord
    from megatron_grpo.errors import MegatronGRPOError
    from megatron_grpo.rewards.runner import RewardRunner
    from megatron_grpo.rollout.types import SamplingParams
    from megatron_grpo.trainer.rollouts.rollout_phase import RolloutSettings, collect_rollout_batch

    record = PromptRecord(data_source="test", prompt=[{"role": "user", "content": "q"}], ground_truth="a")
    prompts = [EncodedPrompt(record=record, text="q", input_ids=[1, 2], truncated=False)]
    rewards = RewardRunner(f"{__file__}:_constant_score", num_workers=0, timeout_s=None)
    settings = RolloutSettings(n=4, sampling=SamplingParams(n=4, max_new_tokens=16, seed=1), adv_estimator="grpo",
                               advantage_config=AdvantageConfig(), filter_groups=True, max_generation_rounds=2,
                               overlong=OverlongPenalty(max_response_length=16, length=8, penalty_factor=1.0),
                               filter_on_penalised=metric == "seq_reward")
    try:
        return collect_rollout_batch(_LengthsEngine([4, 8, 12, 16]), lambda: prompts, _Tokenizer(), rewards,
                                     settings, step=1, num_prompts=1, in_trainer_thread=False)
    except MegatronGRPOError as error:
        return error
    finally:
        rewards.close()


def test_the_penalty_reaches_the_advantages_and_the_filter_reads_the_chosen_metric():
    """Every response scores 1; lengths 4, 8, 12, 16 of a 16-token cap with an 8-token buffer lose
    0, 0, 0.5 and 1. Filtered on seq_reward, the group differs and trains (advantages from
    1, 1, 0.5, 0); filtered on acc (DAPO's recipe), all four agree and the group is dropped."""
    batch = _rollout("seq_reward")
    scores = torch.tensor([1.0, 1.0, 0.5, 0.0], dtype=torch.float64)
    expected = (scores - scores.mean()) / (scores.std() + 1e-6)
    assert [s.advantage for s in batch.samples] == pytest.approx(expected.tolist(), rel=1e-12)
    assert batch.metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.375)
    assert batch.metrics["reward/overlong_frac"] == 0.5 and batch.metrics["reward/mean"] == pytest.approx(0.625)
    error = _rollout("acc")
    assert "had non-zero reward variance after 2 generation rounds" in str(error), error
