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
    from megatron_grpo.trainer.evaluation.evaluate import evaluate

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


class LookupPlayer:
    """An engine that plays the lookup task: it calls the tool with the prompt's key, then answers
    with the tool's value for the keys in `knows` and with "x" (no position right) for the others."""

    weight_version = 0

    def __init__(self, tokenizer, knows):
        self.tokenizer, self.knows = tokenizer, set(knows)
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, requests, on_request_done=None):  # RolloutEngine.generate's signature
        from megatron_grpo.rollout.engine import report_each_request
        from megatron_grpo.rollout.types import Sample

        samples = []
        for r in requests:
            text = self.tokenizer.decode(list(r.prompt_ids))
            turns = [t.split("\n", 1)[1].split("<|im_end|>")[0] for t in text.split("<|im_start|>")[1:-1]]
            key = turns[0]
            reply = f":{key}" if len(turns) == 1 else (turns[-1] if key in self.knows else "x")
            ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.end]
            samples.append(Sample(r.group_id, 0, list(r.prompt_ids), ids, [0.0] * len(ids), "stop", 0,
                                  matched_stop=self.end))
        return report_each_request(requests, samples, on_request_done)


def test_eval_with_an_environment_scores_its_episodes(tmp_path):
    from transformers import AutoTokenizer

    from megatron_grpo.data.synthetic import build_tokenizer
    from megatron_grpo.trainer.evaluation.evaluate import evaluate

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    keys = ["01", "23", "32", "10"]
    records = [PromptRecord("synthetic", [{"role": "user", "content": k}], k, extra_info={"digits": k, "index": i})
               for i, k in enumerate(keys)]
    prompts, _ = encode_prompts(records, tokenizer, max_prompt_length=16)
    config = load_config("recipes/tiny_cpu_tool.yaml", ["eval.n_samples=2", "eval.pass_k=[1,2]"])
    run = SimpleNamespace(config=config, eval_prompts=prompts, engine=LookupPlayer(tokenizer, knows=keys[:2]),
                          rewards=None, tokenizer=tokenizer)
    metrics = evaluate(run)
    # every episode: a call with the right key (0.2), then the value (0.8) or "x" (0)
    assert metrics["eval/reward_mean"] == pytest.approx((2 * 1.0 + 2 * 0.2) / 4)
    assert metrics["eval/pass@1"] == metrics["eval/pass@2"] == 0.5
    assert metrics["eval/multi_turn/turns_mean"] == 2.0 and metrics["eval/multi_turn/tool_calls"] == 8.0
    assert metrics["eval/multi_turn/end_done_frac"] == 1.0
