"""The built-in python_gsm8k environment with a real model, on both engines: a tiny Qwen3 fitted
(teacher forcing) to call the `python` tool runs episodes through the product's multi-turn rollout
(collect_rollout_batch) on the local engine and on SGLang's own server code (tests/sglang_harness).
Its code runs in the sandbox, the printed output comes back as masked observation ids, a failing
call is answered with the error and the episode goes on, the final answer is scored; the engines'
log-probs equal a float64 recomputation and their greedy trajectories are identical."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from itertools import groupby

import pytest
import torch

from megatron_grpo.algo import AdvantageConfig
from megatron_grpo.data.prompts import EncodedPrompt
from megatron_grpo.data.records import PromptRecord
from megatron_grpo.environments.episodes import EpisodeLimits
from megatron_grpo.environments.python_tool import PythonToolEnvironment
from megatron_grpo.environments.sandbox import run_python
from megatron_grpo.rollout.local import LocalEngine
from megatron_grpo.rollout.types import SamplingParams
from megatron_grpo.testing.floats import tolerance
from megatron_grpo.trainer.rollout_phase import MultiTurnSettings, RolloutSettings, collect_rollout_batch
from tests.tiny_hf import EOS_ID, PAD_ID, VOCAB_SIZE, char_tokenizer, float64_logprobs, tiny_model

# Qwen3's layout spelled in the character vocabulary: "<eos>" closes every turn (Qwen's <|im_end|>,
# the token the engines stop on) and is followed by "\n"; a tool message is a user turn holding
# <tool_response>.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
            "[user]\n<tool_response>\n{{ m['content'] }}\n</tool_response><eos>\n"
            "{% else %}[{{ m['role'] }}]\n{{ m['content'] }}<eos>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]\n{% endif %}")
SYSTEM_PROMPT = "Use python."
LIMITS = EpisodeLimits(max_turns=3, max_new_tokens_per_turn=96, max_length=480, step_timeout_s=20.0)
ENV_KWARGS = {"system_prompt": SYSTEM_PROMPT, "timeout_s": 10.0, "cpu_s": 5, "memory_mb": 512}


def tool_call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


@dataclass(frozen=True)
class Episode:
    """A question, the code of each tool call the model is fitted to make before it answers, and
    what each call's observation must show (what Python prints for that code)."""

    question: str
    answer: str
    codes: tuple[str, ...]
    printed: tuple[str, ...]

    @property
    def turns(self) -> list[str]:
        return [tool_call(code) for code in self.codes] + [f"#### {self.answer}"]


EPISODES = (
    Episode("6*7=?", "42", codes=("print(6*7)",), printed=("\n42\n",)),
    # the first call's code does not compile: the error comes back, the model fixes the call
    Episode("9-2=?", "7", codes=("print(9-2", "print(9-2)"), printed=("\nerror\nSyntaxError: ", "\n7\n")),
)


def conversation(episode: Episode) -> list[dict]:
    """The whole conversation: the observations are what the sandbox prints for each call."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": episode.question}]
    limits = PythonToolEnvironment(**ENV_KWARGS).limits
    for turn, code in zip(episode.turns, episode.codes):
        messages += [{"role": "assistant", "content": turn},
                     {"role": "tool", "content": run_python(code, limits).report()}]
    return messages + [{"role": "assistant", "content": episode.turns[-1]}]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render(tokenizer, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def expected_trajectory(tokenizer, messages) -> tuple[list[int], list[int], list[bool]]:
    """(prompt ids, response ids, response mask) of the conversation rendered at once: the mask is
    True on each assistant turn's content and its <eos> (what the engine generates), False on the
    rest; the template's "\\n" after the last <eos> is never generated, so it is not included."""
    prompt = encode(tokenizer, render(tokenizer, messages[:2], generation_prompt=True))
    ids = encode(tokenizer, render(tokenizer, messages, generation_prompt=False))[:-1]
    assert ids[:len(prompt)] == prompt and ids[-1] == EOS_ID
    mask = [False] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(encode(tokenizer, render(tokenizer, messages[:k], generation_prompt=True)))
            generated = encode(tokenizer, message["content"]) + [EOS_ID]
            assert ids[start:start + len(generated)] == generated
            mask[start:start + len(generated)] = [True] * len(generated)
    return prompt, ids[len(prompt):], mask[len(prompt):]


@dataclass(frozen=True)
class FittedModel:
    model: torch.nn.Module    # fp32, what the engines serve
    model64: torch.nn.Module  # the same weights in float64: the log-prob reference
    tokenizer: object
    conversations: list[list[dict]]


def logprob_tolerance(model64, ids: list[int]) -> float:
    """An fp32 log-prob (logit minus log-sum-exp, each rounded relative to the largest logit) vs
    float64: twice the fp32 rounding bound of the longest sum on the way (the softmax over the
    vocabulary or attention over the sequence), relative to the largest |logit| of the trajectory."""
    with torch.no_grad():
        scale = float(model64(input_ids=torch.tensor([ids])).logits.abs().max())
    return 2 * tolerance(torch.float32, terms=max(VOCAB_SIZE, len(ids))) * scale


def fit(tokenizer, conversations, max_steps: int = 400, lr: float = 1e-2, margin: float = 2.0) -> torch.nn.Module:
    """A tiny Qwen3 fitted by teacher forcing (cross-entropy on the assistant tokens only, the
    conversations as one padded batch) until its greedy choice is the target at every assistant
    position by at least `margin` logits: then greedy decoding replays the conversations exactly."""
    model = tiny_model(seed=0).train()  # Qwen3 has no dropout: train-mode logits are eval-mode logits
    trajectories = [expected_trajectory(tokenizer, messages) for messages in conversations]
    width = max(len(p) + len(r) for p, r, _ in trajectories) - 1
    inputs = torch.full((len(trajectories), width), PAD_ID)
    targets = torch.full((len(trajectories), width), PAD_ID)
    trained = torch.zeros(len(trajectories), width, dtype=torch.bool)
    for row, (prompt, response, mask) in enumerate(trajectories):
        ids = prompt + response  # right padding: the padded tail comes after every trained position
        inputs[row, :len(ids) - 1], targets[row, :len(ids) - 1] = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
        trained[row, len(prompt) - 1:len(ids) - 1] = torch.tensor(mask)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(max_steps):
        logits = model(input_ids=inputs).logits[trained]
        target = targets[trained]
        with torch.no_grad():
            chosen = logits.gather(1, target[:, None]).squeeze(1)
            runner_up = logits.scatter(1, target[:, None], float("-inf")).max(1).values
        if float((chosen - runner_up).min()) > margin:
            return model.eval()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(logits, target).backward()
        optimizer.step()
    raise AssertionError(f"the tiny model did not fit the conversations in {max_steps} steps")


@pytest.fixture(scope="module")
def fitted() -> FittedModel:
    tokenizer = char_tokenizer(whitespace=True)
    conversations = [conversation(e) for e in EPISODES]
    # one thread: the tiny model's matmuls gain nothing from a second, which on shared cores mostly
    # waits for the first (measured: 4 s with one thread, 7-26 s with two on 2 busy cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = fit(tokenizer, conversations)
    finally:
        torch.set_num_threads(threads)
    return FittedModel(model, copy.deepcopy(model).double(), tokenizer, conversations)


def rollout(engine, tokenizer):
    prompts = []
    for i, episode in enumerate(EPISODES):
        record = PromptRecord(data_source="gsm8k", prompt=[{"role": "user", "content": episode.question}],
                              ground_truth=episode.answer, extra_info={"index": i})
        text = render(tokenizer, record.prompt, generation_prompt=True)
        prompts.append(EncodedPrompt(record, text, encode(tokenizer, text), False))
    sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=LIMITS.max_new_tokens_per_turn)
    settings = RolloutSettings(n=1, sampling=sampling, adv_estimator="grpo", advantage_config=AdvantageConfig(),
                               multi_turn=MultiTurnSettings("python_gsm8k", dict(ENV_KWARGS), LIMITS,
                                                            chat_template=TEMPLATE))
    return collect_rollout_batch(engine, lambda: prompts, tokenizer, None, settings, step=1,
                                 num_prompts=len(prompts), in_trainer_thread=False)


def observation_texts(sample, tokenizer) -> list[str]:
    """The stretches of a trajectory's response the engine did not generate (mask False), decoded."""
    runs = groupby(zip(sample.response_ids, sample.response_mask), key=lambda pair: pair[1])
    return [tokenizer.decode([token for token, _ in run], skip_special_tokens=False)
            for generated, run in runs if not generated]


def check_python_tool_batch(batch, fitted: FittedModel) -> None:
    tokenizer = fitted.tokenizer
    for sample, episode, messages in zip(batch.samples, EPISODES, fitted.conversations):
        # the sandbox's output is in the trajectory, wrapped by the template, after every call (the
        # failing one's error too, and the episode went on to the corrected call)
        observations = observation_texts(sample, tokenizer)
        assert len(observations) == len(episode.printed) and all(
            o.startswith("\n[user]\n<tool_response>\n") and printed in o and
            o.endswith("</tool_response><eos>\n[assistant]\n")
            for o, printed in zip(observations, episode.printed)), observations
        # ids and mask are the whole conversation rendered at once, masked off on every id the
        # engine did not generate (the observations and the template around them)
        prompt, response, mask = expected_trajectory(tokenizer, messages)
        assert (sample.prompt_ids, sample.response_ids) == (prompt, response)
        assert sample.response_mask == mask
        # the engine's log-probs of generated ids: one float64 forward over the whole trajectory
        expected = float64_logprobs(fitted.model64, sample.prompt_ids, sample.response_ids)
        got = torch.tensor(sample.rollout_logprobs, dtype=torch.float64)
        generated = torch.tensor(sample.response_mask)
        assert torch.all(got[~generated] == 0)
        torch.testing.assert_close(got[generated], expected[generated], rtol=0,
                                   atol=logprob_tolerance(fitted.model64, sample.prompt_ids + sample.response_ids))
    metrics = batch.metrics
    # three calls ran in the sandbox (one per episode + the corrected one), one of them failed
    assert metrics["multi_turn/tool_calls"] == 3.0 and metrics["multi_turn/tool_call_errors"] == 0.0
    assert metrics["multi_turn/sandbox_error"] == 1.0 and "multi_turn/template_mismatch" not in metrics
    assert metrics["multi_turn/end_done_frac"] == 1.0 and metrics["multi_turn/turns_mean"] == 2.5
    assert metrics["reward/min"] == metrics["reward/max"] == 1.0  # both final answers scored correct


@pytest.fixture(scope="module")
def local_batch(fitted):
    return rollout(LocalEngine(fitted.model, fitted.tokenizer), fitted.tokenizer)


def test_local_engine_runs_the_python_tool(fitted, local_batch):
    check_python_tool_batch(local_batch, fitted)


@pytest.mark.slow  # starts an SGLang test server
def test_sglang_runs_the_python_tool_like_the_local_engine(fitted, local_batch, tmp_path_factory):
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
    from megatron_grpo.rollout.sglang.weight_sync import DiskTransport, EngineTarget
    from tests.sglang_harness.fixtures import launch_servers, server_settings, sglang_python

    sglang_python()
    folder = tmp_path_factory.mktemp("fitted")
    fitted.model.save_pretrained(folder)
    fitted.tokenizer.save_pretrained(folder)
    settings = server_settings(folder)
    launcher = launch_servers(tmp_path_factory.mktemp("logs"), [settings])
    try:
        client = SGLangClient([settings.url])
        engine = SGLangEngine(client, DiskTransport(client, [EngineTarget(settings.url)], "/nonexistent"),
                              options=EngineOptions(health_check_interval_s=0))
        try:
            batch = rollout(engine, fitted.tokenizer)
        finally:
            engine.close()
    finally:
        launcher.shutdown(grace_s=5)
    check_python_tool_batch(batch, fitted)
    # greedy: token for token the local engine's trajectories (prompts, turns, observations, masks)
    assert [s.prompt_ids + s.response_ids for s in batch.samples] == \
        [s.prompt_ids + s.response_ids for s in local_batch.samples]
    assert [s.response_mask for s in batch.samples] == [s.response_mask for s in local_batch.samples]
