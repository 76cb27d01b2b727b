"""The two kinds of model scorer (rewards/combined.py's ModelScorer) over any ScorerBackend:
RewardModelScorer (the RM's score of the rendered conversation, normalised) and JudgeScorer (the
judge's answer parsed by judge.parse). A call that fails as a whole raises (every sample of it
then fails, counted by kind); a judge answer that does not parse fails only its sample."""
from __future__ import annotations

import math
from typing import Sequence

from megatron_grpo.config.reward_models import ModelScorerConfig
from megatron_grpo.reward_models import judge_parse
from megatron_grpo.reward_models.backend import ScorerBackend
from megatron_grpo.reward_models.render import ChatRenderer, conversation, judge_messages, single_token
from megatron_grpo.rewards.combined import ModelScore
from megatron_grpo.rewards.runner import RewardRequest


def normalized(value: float, cfg: ModelScorerConfig) -> float:
    if cfg.normalize == "none":
        return value
    z = (value - cfg.shift) / cfg.scale
    if cfg.normalize == "affine":
        return z
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))  # no overflow either side


class _Scorer:
    def __init__(self, name: str, cfg: ModelScorerConfig, backend: ScorerBackend, renderer: ChatRenderer):
        self.name, self.cfg, self.backend, self.renderer = name, cfg, backend, renderer
        kind = "reward model" if cfg.kind == "reward_model" else "judge"
        self.description = f"reward.models.{name} ({kind} {cfg.path}, {backend.where})"
        self.batch_size = cfg.batch_size
        self.concurrency = backend.concurrency
        self.timeout_s = cfg.timeout_s
        self.failure_score = cfg.failure_score

    def _finite(self, value: float) -> ModelScore:
        if not math.isfinite(value):
            return ModelScore(None, "nan", f"{self.description} gave the non-finite score {value}")
        score = normalized(value, self.cfg)
        return ModelScore(score) if math.isfinite(score) else ModelScore(None, "nan", f"{self.description}: "
                                                                          f"normalize gave {score} from {value}")

    def close(self) -> None:
        self.backend.close()


class RewardModelScorer(_Scorer):
    def score(self, requests: Sequence[RewardRequest]) -> list[ModelScore]:
        sequences = [self.renderer.ids(conversation(r), generation_prompt=False) for r in requests]
        return [self._finite(value) for value in self.backend.classify(sequences)]


class JudgeScorer(_Scorer):
    def __init__(self, name: str, cfg: ModelScorerConfig, backend: ScorerBackend, renderer: ChatRenderer):
        super().__init__(name, cfg, backend, renderer)
        judge, key = cfg.judge, f"reward.models.{name}.judge"
        self.yes_no = None
        if judge.parse == "yes_no":
            tokenizer = renderer.tokenizer
            self.yes_no = (single_token(tokenizer, judge.yes, f"{key}.yes"),
                           single_token(tokenizer, judge.no, f"{key}.no"))

    def score(self, requests: Sequence[RewardRequest]) -> list[ModelScore]:
        judge = self.cfg.judge
        prompts = [self.renderer.ids(judge_messages(r, judge), generation_prompt=True) for r in requests]
        replies = self.backend.generate(prompts, 1 if self.yes_no else judge.max_new_tokens, self.yes_no)
        outcomes = []
        for reply in replies:
            try:
                if judge.parse == "number":
                    value = judge_parse.parse_number(reply.text, judge.min_value, judge.max_value)
                elif judge.parse == "regex":
                    value = judge_parse.parse_regex(reply.text, judge.regex, judge.min_value, judge.max_value)
                else:
                    value = judge_parse.parse_yes_no(reply.first_token_logprobs, *self.yes_no, judge.min_yes_no_mass)
            except judge_parse.JudgeParseError as exc:
                outcomes.append(ModelScore(None, "bad_type", f"{self.description}: {exc}"))
                continue
            outcomes.append(self._finite(value))
        return outcomes
