"""Eval scores its rows with the request training uses: a reward keyed on data_source scores eval
rows as it scores training rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_grpo.config import load_config
from megatron_grpo.data.prompts import encode_prompts
from megatron_grpo.data.records import PromptRecord
from megatron_grpo.rewards import RewardRunner
from tests.tiny_hf import save_tiny_model

CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
REWARD = '''
def by_source(prompt, response, ground_truth, extra):
    return float(extra.get("data_source") == "source/a" and "index" in extra)
'''


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_grpo.rollout.local import LocalEngine

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)
    return LocalEngine.from_pretrained(folder, seed=0)


def test_eval_passes_data_source_and_extra_info_to_the_reward(tmp_path, engine):
    from megatron_grpo.trainer.evaluate import evaluate

    (tmp_path / "reward.py").write_text(REWARD)
    records = [PromptRecord("source/a", [{"role": "user", "content": f"q{i}"}], "x", extra_info={"index": i})
               for i in range(3)]
    prompts, _ = encode_prompts(records, engine.tokenizer, max_prompt_length=16, chat_template=CHAT)
    config = load_config(None, ["data.max_response_length=4", "trainer.seed=1"])
    with RewardRunner(f"{tmp_path / 'reward.py'}:by_source", num_workers=0, timeout_s=None) as rewards:
        run = SimpleNamespace(config=config, eval_prompts=prompts, engine=engine, rewards=rewards,
                              tokenizer=engine.tokenizer)
        metrics = evaluate(run)
    assert metrics["eval/reward_mean"] == 1.0 and metrics["eval/pass@1"] == 1.0
