"""The built-in python_gsm8k environment with a real model, on both engines: a tiny Qwen3 fitted
(teacher forcing) to call the `python` tool runs episodes through the product's multi-turn rollout
(collect_rollout_batch) on the local engine and on SGLang's own server code (tests/sglang_harness).
Its code runs in the sandbox, the printed output comes back as masked observation ids, a failing
call is answered with the error and the episode goes on, the final answer is scored; the engines'
log-probs equal a float64 recomputation and their greedy trajectories are identical. The real
trainer (trainer.loop.train) then runs two GRPO steps from the same model on the same questions."""
from __future__ import annotations

import copy
import dataclasses
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
from megatron_grpo.trainer.rollouts.multi_turn import MultiTurnSettings
from megatron_grpo.trainer.rollouts.rollout_phase import RolloutSettings, collect_rollout_batch
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


def check_python_tool_batch(batch, fitted: FittedModel, n: int = 1) -> None:
    """`batch`: n trajectories per episode of EPISODES, group after group (the rollout's order)."""
    tokenizer = fitted.tokenizer
    assert len(batch.samples) == n * len(EPISODES)
    for k, sample in enumerate(batch.samples):
        episode, messages = EPISODES[k // n], fitted.conversations[k // n]
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
    # three calls ran in the sandbox per n episodes (one per episode + the corrected one), one failed
    assert metrics["multi_turn/tool_calls"] == 3.0 * n and metrics["multi_turn/tool_call_errors"] == 0.0
    assert metrics["multi_turn/sandbox_error"] == 1.0 * n and "multi_turn/template_mismatch" not in metrics
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


# ----- the real trainer -------------------------------------------------------------------------
SAMPLES_PER_PROMPT = 2


def _train_two_steps(rank, world_size, overrides):
    """trainer.loop.train on the recipe with `overrides`, recording what the metrics do not show:
    each step's rollout batch, the ids under step 1's loss mask per sample, the token count its
    loss divides by, and the parameters the engine holds after each weight sync."""
    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer import loop

    batches, loss_targets, token_counts, engine_weights = [], [], [], []
    collect, plan, batch_info, sync = (loop.collect_rollout_batch, loop.plan_micro_batches, loop.global_batch_info,
                                       loop.sync_weights)

    def collect_and_keep(*args, **kwargs):
        batches.append(collect(*args, **kwargs))
        return batches[-1]

    def plan_and_read_targets(samples, *args, **kwargs):
        mini_batches = plan(samples, *args, **kwargs)
        targets = {}
        for micro_batch in (mb for mbs in mini_batches for mb in mbs):
            rows = zip(micro_batch.rows(micro_batch.targets), micro_batch.rows(micro_batch.loss_mask))
            for index, (row_targets, row_mask) in zip(micro_batch.sample_indices, rows):
                targets[index] = row_targets[row_mask].tolist()
        loss_targets.append([targets[i] for i in range(len(samples))])
        return mini_batches

    def batch_info_and_count(micro_batches, cfg):
        info = batch_info(micro_batches, cfg)
        token_counts.append(int(info.num_valid_tokens))
        return info

    def sync_and_read_engine(run, version):
        result = sync(run, version=version)
        engine_weights.append({name: p.detach().clone() for name, p in run.engine.model.named_parameters()})
        return result

    loop.collect_rollout_batch, loop.plan_micro_batches = collect_and_keep, plan_and_read_targets
    loop.global_batch_info, loop.sync_weights = batch_info_and_count, sync_and_read_engine
    cfg = load_config("recipes/tiny_cpu_tool.yaml", overrides)
    validate(cfg, world_size=world_size)
    out = loop.train(cfg)
    with open(out / "metrics.jsonl") as handle:
        records = [json.loads(line) for line in handle]
    return {"records": records, "batches": batches, "loss_targets": loss_targets, "token_counts": token_counts,
            "engine_weights": engine_weights}


@pytest.mark.slow  # a trainer process: megatron-core model, two rollouts with the sandbox, two updates
def test_trainer_runs_two_grpo_steps_on_python_gsm8k(fitted, tmp_path):
    """train() from the fitted model (an HF folder) on the questions as a verl-layout jsonl: step 1
    plays the fitted episodes (sandbox output in the trajectories, reward 1), the trainer's log-probs
    of the generated ids equal the engine's, only generated ids are under the loss, the update
    changes the weights the engine holds, and step 2 samples with them."""
    from megatron_grpo.testing.distributed import run_distributed

    model_dir = tmp_path / "fitted"
    fitted.model.save_pretrained(model_dir)
    fitted.tokenizer.save_pretrained(model_dir)
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(PromptRecord(
        data_source="openai/gsm8k", prompt=[{"role": "user", "content": e.question}], ground_truth=e.answer,
        ability="math", extra_info={"split": "train", "index": i}).to_dict()) + "\n" for i, e in enumerate(EPISODES)))
    overrides = [
        # tiny_cpu's override_config describes its from-scratch model (tied, 128 positions); the
        # fitted folder's config.json is the model (untied, 512 positions)
        f"model.path={model_dir}", "model.override_config={}",
        "data.task=null", "data.task_kwargs={}", f"data.train_files=[{data}]", "data.shuffle=false",
        f"data.chat_template={json.dumps(TEMPLATE)}", "data.max_prompt_length=64",
        f"data.max_response_length={LIMITS.max_length - 64}",
        f"data.train_batch_size={len(EPISODES)}", f"actor.ppo_mini_batch_size={len(EPISODES)}",
        f"rollout.n={SAMPLES_PER_PROMPT}", "rollout.multi_turn.environment=python_gsm8k",
        f"rollout.multi_turn.environment_kwargs={json.dumps(ENV_KWARGS)}",
        f"rollout.multi_turn.max_turns={LIMITS.max_turns}",
        f"rollout.multi_turn.max_new_tokens_per_turn={LIMITS.max_new_tokens_per_turn}",
        f"rollout.multi_turn.max_length={LIMITS.max_length}",
        f"rollout.multi_turn.step_timeout_s={LIMITS.step_timeout_s}",
        # Training samples at temperature 1 (the recipe's); top-k 1 keeps only the most likely token,
        # which the fitted model's margin (> 2 logits) makes the fitted one: the episodes are
        # deterministic (both samples of a prompt identical) while the engine still reports
        # log_softmax(logits / T) before the filter, the log-probs the trainer recomputes.
        "rollout.top_k=1",
        # Every episode earns 1, so GRPO's advantages are all 0 and the policy-gradient term has no
        # gradient: the entropy bonus gives the update one, and without weight decay a changed
        # weight can only come from it. Adam's first step moves every weight by about lr whatever
        # the gradient's size: the recipe's 1.5e-3 (for a model trained from scratch) unlearns the
        # fitted episodes in one step, 1e-5 (a fine-tuning rate) keeps them.
        "actor.entropy_coeff=0.01", "actor.optim.weight_decay=0", "actor.optim.lr=1e-5",
        # the first mini-batch's "old" log-probs from a forward-only pass, not the update's own
        "actor.old_logprob_check_interval=1",
        "reward.function=gsm8k", "trainer.total_steps=2", "eval.interval=-1",
        f"logging.output_dir={tmp_path / 'run'}", "logging.console=false", "logging.plot=false"]
    out = run_distributed(_train_two_steps, 1, (overrides,), timeout=300)[0]
    step1, step2 = out["records"]
    batch = out["batches"][0]

    # step 1: the fitted episodes, token for token (the sandbox's output and error in each
    # trajectory, masked), each answer scored right, the engine's log-probs equal float64's
    check_python_tool_batch(batch, fitted, n=SAMPLES_PER_PROMPT)
    assert step1["reward/mean"] == 1.0 and step1["multi_turn/tool_calls"] == 3.0 * SAMPLES_PER_PROMPT
    assert step1["rollout/weight_version_max"] == 0.0  # the fitted weights sampled it

    # the loss covers exactly the generated ids of each trajectory, and the token-mean divides by their count
    generated = [[t for t, g in zip(s.response_ids, s.response_mask) if g] for s in batch.samples]
    assert out["loss_targets"][0] == generated
    assert out["token_counts"][0] == sum(sum(s.response_mask) for s in batch.samples)

    # the trainer's log-probs of the generated ids against the engine's: each is an fp32 computation
    # within logprob_tolerance of float64, so they differ by at most twice that
    def bound(model64, samples):
        return 2 * max(logprob_tolerance(model64, s.prompt_ids + s.response_ids) for s in samples)

    diff, allowed = step1["actor/logprob_abs_diff_max"], bound(fitted.model64, batch.samples)
    assert 0.0 < diff <= allowed, (diff, allowed)
    assert step1["actor/ratio_max_abs_dev"] == 0.0 and step1["invariant/ratio_dev_first_minibatch"] == 0.0

    # the update had a gradient and reached the engine: every parameter it holds after step 1's
    # sync differs from the fitted one
    assert step1["actor/grad_norm"] > 0.0 and step1["actor/updates_skipped"] == 0.0
    after_step1 = out["engine_weights"][0]
    fitted_weights = dict(fitted.model.named_parameters())
    assert after_step1.keys() == fitted_weights.keys()
    unchanged = [name for name, p in after_step1.items() if torch.equal(p, fitted_weights[name])]
    assert not unchanged, unchanged

    # step 2 sampled with those weights (its engine log-probs are theirs, in float64), still plays
    # the episodes, and the trainer's log-probs still equal the engine's
    model64 = copy.deepcopy(fitted.model64)
    model64.load_state_dict({name: p.double() for name, p in after_step1.items()})
    assert step2["rollout/weight_version_min"] == 1.0
    check_python_tool_batch(out["batches"][1], dataclasses.replace(fitted, model64=model64), n=SAMPLES_PER_PROMPT)
    assert step2["reward/mean"] == 1.0
    diff, allowed = step2["actor/logprob_abs_diff_max"], bound(model64, out["batches"][1].samples)
    assert 0.0 < diff <= allowed, (diff, allowed)
