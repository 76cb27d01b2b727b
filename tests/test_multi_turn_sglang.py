"""Multi-turn rollouts through SGLang's own server code (tests/sglang_harness): every turn is a
/generate with the trajectory's input_ids; the engine's log-probs of generated ids equal a float64
recomputation over the whole trajectory, and greedy trajectories equal the local engine's."""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.algo import AdvantageConfig
from megatron_grpo.data.prompts import EncodedPrompt
from megatron_grpo.data.records import PromptRecord
from megatron_grpo.environments.episodes import EpisodeLimits
from megatron_grpo.rollout.local import LocalEngine
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
from megatron_grpo.rollout.sglang.weight_sync import DiskTransport, EngineTarget
from megatron_grpo.rollout.types import SamplingParams
from megatron_grpo.trainer.rollouts.rollout_phase import MultiTurnSettings, RolloutSettings, collect_rollout_batch
from tests.sglang_harness.fixtures import launch_servers, save_long_context_model, server_settings, sglang_python
from tests.tiny_hf import char_tokenizer, float64_logprobs, tiny_model

pytestmark = pytest.mark.slow  # starts an SGLang test server

# The character tokenizer has no whitespace: a template spelled without it.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}|{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
LIMITS = EpisodeLimits(max_turns=3, max_new_tokens_per_turn=6, max_length=60, step_timeout_s=10.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sglang_python()
    settings = server_settings(save_long_context_model(tmp_path_factory.mktemp("model")))
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), [settings])
    yield settings.url
    launcher.shutdown(grace_s=5)


def engine_for(url):
    client = SGLangClient([url])
    return SGLangEngine(client, DiskTransport(client, [EngineTarget(url)], "/nonexistent"),
                        options=EngineOptions(health_check_interval_s=0))


def rollout(engine, tokenizer, temperature):
    prompts = []
    for i, key in enumerate(["ab", "xyz"]):
        record = PromptRecord(data_source="t", prompt=[{"role": "user", "content": key}], ground_truth="",
                              extra_info={"index": i})
        text = tokenizer.apply_chat_template(record.prompt, chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(EncodedPrompt(record, text, tokenizer(text, add_special_tokens=False)["input_ids"], False))
    # every ASCII character ends a turn (the model's other ids are Cyrillic): most turns are short
    sampling = SamplingParams(n=3, temperature=temperature, max_new_tokens=6, seed=11,
                              stop_token_ids=tuple(range(2, 96)))
    settings = RolloutSettings(n=3, sampling=sampling, adv_estimator="grpo", advantage_config=AdvantageConfig(),
                               multi_turn=MultiTurnSettings("tests.test_multi_turn:EchoEnvironment", {}, LIMITS,
                                                            chat_template=TEMPLATE))
    return collect_rollout_batch(engine, lambda: prompts, tokenizer, None, settings, step=1, num_prompts=2,
                                 in_trainer_thread=False)


def test_sglang_trajectories_logprobs_and_greedy_equal_the_local_engine(server):
    tokenizer, reference = char_tokenizer(), tiny_model(seed=0, scale=3.0)
    engine = engine_for(server)
    batch = rollout(engine, tokenizer, temperature=1.0)
    assert batch.metrics["multi_turn/turns_mean"] > 1.5
    assert sum(not all(s.response_mask) for s in batch.samples) >= 3
    for sample in batch.samples:
        expected = float64_logprobs(reference, sample.prompt_ids, sample.response_ids)
        mask = torch.tensor(sample.response_mask)
        got = torch.tensor(sample.rollout_logprobs, dtype=torch.float64)
        assert torch.all(got[~mask] == 0)
        # fp32 with a KV cache vs one float64 pass: a few ulps per layer times the sequence length
        tolerance = 64 * torch.finfo(torch.float32).eps * max(1, len(sample.prompt_ids) + len(sample.response_ids))
        torch.testing.assert_close(got[mask], expected[mask], atol=tolerance, rtol=0)
    # greedy: SGLang's trajectories are the local engine's, token for token (prompts, turns, observations)
    greedy = rollout(engine, tokenizer, temperature=0.0)
    local = rollout(LocalEngine(reference, tokenizer), tokenizer, temperature=0.0)
    assert [s.prompt_ids + s.response_ids for s in greedy.samples] == \
        [s.prompt_ids + s.response_ids for s in local.samples]
    assert [s.response_mask for s in greedy.samples] == [s.response_mask for s in local.samples]
    engine.close()
