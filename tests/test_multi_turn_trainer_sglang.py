"""The tool recipe (recipes/tiny_cpu_tool.yaml, environment `lookup`) through the real trainer with
rollout.engine=sglang, against SGLang's own server code (tests/sglang_harness): every turn of every
episode is a /generate the server answered, the trajectories are the lookup environment's
conversations, the engine's log-probs equal a float64 recomputation and the trainer's (ratio == 1
at step 1), each step's weights reach the server, and greedy trajectories equal the local engine's."""
from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from megatron_grpo.testing.distributed import run_distributed
from tests.sglang_harness.fixtures import launch_servers, server_settings, sglang_python

RECIPE = "recipes/tiny_cpu_tool.yaml"
STEPS = 2
# Each turn ends at its first digit: a fresh model emits <|im_end|> within a 6-token turn so rarely
# (~1 in 5) that ":" calls the tool in ~1 of 100 episodes; cut at a digit, a turn that starts with
# ":" is a call (":3") in ~1 of 20, so a step of 128 episodes has several multi-turn trajectories.
DIGITS = "0123456789"
STOP_AT_DIGITS = f"rollout.stop=[{','.join(repr(d) for d in DIGITS)}]"
GENERATE_LINE = '"POST /generate HTTP/1.1" 200'  # uvicorn's access log line of one served turn


def _train(rank, world_size, overrides):
    """Runs the recipe; returns its metrics and step 1's batch: per trajectory its record and the
    ids, mask and engine log-probs the trainer trained on."""
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer import loop

    collect, step_one = loop.collect_rollout_batch, []

    def recording(engine, next_prompts, *args, **kwargs):
        prompts = []

        def recorded():
            drawn = next_prompts()
            prompts.extend(drawn)
            return drawn

        batch = collect(engine, recorded, *args, **kwargs)
        if not step_one:
            n = len(batch.samples) // len(prompts)
            step_one.extend({"record": prompts[i // n].record, "prompt_ids": s.prompt_ids,
                             "response_ids": s.response_ids, "mask": s.response_mask,
                             "logprobs": s.rollout_logprobs} for i, s in enumerate(batch.samples))
        return batch

    loop.collect_rollout_batch = recording
    cfg = load_config(RECIPE, overrides)
    loop.train(cfg)
    with open(f"{cfg.logging.output_dir}/metrics.jsonl") as handle:
        return {"records": [json.loads(line) for line in handle], "step_one": step_one}


@pytest.fixture(scope="module")
def recipe_model(tmp_path_factory):
    """The HF folder the recipe starts from (initialised from its trainer.seed), for the server."""
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.assembly.initial_model import ensure_initial_model

    folder = tmp_path_factory.mktemp("recipe") / "initial_model"
    ensure_initial_model(load_config(RECIPE), folder)
    return folder


@pytest.fixture(scope="module")
def server(recipe_model, tmp_path_factory):
    sglang_python()
    logs = tmp_path_factory.mktemp("logs")
    launcher = launch_servers(logs, [server_settings(recipe_model)])
    yield launcher.servers[0].url, next(logs.glob("sglang-*.log"))
    launcher.shutdown(grace_s=2)


def overrides(recipe_model, output_dir, *extra):
    return [f"model.path={recipe_model}", f"logging.output_dir={output_dir}", "logging.console=false",
            "logging.plot=false", STOP_AT_DIGITS, *extra]


def sglang_overrides(url):
    return ["rollout.engine=sglang", f"rollout.sglang.urls=[{url}]", "rollout.sglang.weight_sync=disk"]


def served_turns(log) -> int:
    return log.read_text(errors="replace").count(GENERATE_LINE)


def replay(sample, tokenizer, kwargs):
    """Plays the trajectory's generated turns to a fresh lookup environment: (reward, tool calls).
    Asserts that generated turns and observations alternate and that the trajectory up to each
    observation reads as the chat template renders the conversation so far: the environment's
    reply after the turn, then the next generation prompt."""
    from megatron_grpo.environments.lookup import LookupEnvironment

    env = LookupEnvironment(**kwargs)
    conversation = env.reset(sample["record"])
    assert sample["prompt_ids"] == ids_of(tokenizer, conversation)
    segments = runs(sample["response_ids"], sample["mask"])
    reward, calls, seen = 0.0, 0, list(sample["prompt_ids"])
    for k, (generated, ids) in enumerate(segments):
        seen += ids
        assert generated == (k % 2 == 0)
        last = k + 1 == len(segments)
        if not generated:  # the observation: the conversation so far, rendered
            assert tokenizer.decode(seen) == render(tokenizer, conversation)
            continue
        ended_by_eos = ids[-1] == tokenizer.eos_token_id
        if not ended_by_eos and tokenizer.decode(ids[-1:]) not in set(DIGITS):
            assert last  # cut by a length limit: not sent to the environment, the episode ends
            continue
        # <|im_end|> is the template's, not content; a stop string is content
        text = tokenizer.decode(ids[:-1] if ended_by_eos else ids)
        result = env.step(text)
        reward += result.reward or 0.0
        calls += int(result.counters.get("tool_calls", 0))
        assert last or not result.done  # an observation follows only a call
        conversation = conversation + [{"role": "assistant", "content": text}] + list(result.observations)
    return reward, calls


def render(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def ids_of(tokenizer, messages):
    return tokenizer(render(tokenizer, messages), add_special_tokens=False)["input_ids"]


def runs(ids, mask):
    """[(generated?, ids)] for the maximal runs of equal mask values."""
    out = []
    for token, generated in zip(ids, mask):
        if out and out[-1][0] == generated:
            out[-1][1].append(token)
        else:
            out.append((generated, [token]))
    return out


def model_info(url):
    with urllib.request.urlopen(f"{url}/model_info", timeout=30) as response:
        return json.load(response)


@pytest.mark.slow  # starts an SGLang test server
def test_lookup_recipe_trains_through_sglang(tmp_path, recipe_model, server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.assembly.prompt_data import SYNTHETIC_EVAL_RECORDS
    from megatron_grpo.trainer.rollouts.multi_turn import MULTI_TURN_ENDS
    from tests.tiny_hf import float64_logprobs

    url, log = server
    served_before = served_turns(log)
    run = run_distributed(_train, 1, (overrides(recipe_model, tmp_path / "run", *sglang_overrides(url),
                                                f"trainer.total_steps={STEPS}", "data.train_batch_size=16",
                                                "actor.ppo_mini_batch_size=16", "rollout.n=8"),), timeout=600)[0]
    records, step_one = run["records"], run["step_one"]
    episodes = 16 * 8
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))

    # The episodes ran through SGLang: the server answered one /generate per turn, no more, no less,
    # the training steps' and the recipe's eval (greedy episodes, at the last step) alike.
    evaluated = [r for r in records if "eval/multi_turn/turns_mean" in r]
    assert [r["step"] for r in evaluated] == [STEPS]
    eval_episodes = SYNTHETIC_EVAL_RECORDS * load_config(RECIPE).eval.n_samples
    turns = [r["multi_turn/turns_mean"] * episodes for r in records]
    turns.append(evaluated[0]["eval/multi_turn/turns_mean"] * eval_episodes)
    assert served_turns(log) - served_before == round(sum(turns))
    for record in records:
        for prefix in ("", "eval/") if "eval/multi_turn/turns_mean" in record else ("",):
            ends = {end: record[f"{prefix}multi_turn/end_{end}_frac"] for end in MULTI_TURN_ENDS}
            assert sum(ends.values()) == pytest.approx(1.0, abs=1e-12)
            assert ends["abort"] == ends["step_timeout"] == 0.0, ends

    # Step 1's trajectories are the lookup environment's conversations (replayed turn by turn), some
    # with a tool call and its reply; the metrics count what they hold.
    tokenizer = AutoTokenizer.from_pretrained(recipe_model)
    kwargs = load_config(RECIPE).rollout.multi_turn.environment_kwargs
    assert len(step_one) == episodes
    played = [replay(sample, tokenizer, kwargs) for sample in step_one]
    first = records[0]
    assert sum(calls for _, calls in played) == first.get("multi_turn/tool_calls", 0.0) > 0
    assert first["multi_turn/turns_mean"] > 1.0
    assert first["reward/mean"] == pytest.approx(sum(reward for reward, _ in played) / episodes, abs=1e-12)
    assert first["multi_turn/generated_tokens_mean"] == sum(sum(s["mask"]) for s in step_one) / episodes

    # The engine's log-probs of the generated ids (observation ids carry none) equal one float64 pass
    # of the recipe's initial model over the whole trajectory, and (ratio == 1) the trainer's.
    reference = AutoModelForCausalLM.from_pretrained(recipe_model, dtype=torch.float32).eval()
    for sample in step_one:
        mask = torch.tensor(sample["mask"])
        got = torch.tensor(sample["logprobs"], dtype=torch.float64)
        expected = float64_logprobs(reference, sample["prompt_ids"], sample["response_ids"])
        assert torch.all(got[~mask] == 0)
        # fp32 with a KV cache vs one float64 pass: a few ulps per layer times the sequence length
        length = len(sample["prompt_ids"]) + len(sample["response_ids"])
        torch.testing.assert_close(got[mask], expected[mask], atol=64 * torch.finfo(torch.float32).eps * length,
                                   rtol=0)
    # two fp32 implementations (SGLang's stand-in runs HF's model, the trainer megatron's): a few ulp
    # of log-probs up to ~10 in size
    assert first["actor/logprob_abs_diff_max"] <= 64 * torch.finfo(torch.float32).eps * 10
    assert first["actor/ratio_max_abs_dev"] == 0.0  # the first update's ratio: exactly 1 on its own samples

    # Every step sampled with the weights of the step before (the version SGLang stamped on each
    # turn), and the last sync reached the server too.
    for record in records:
        assert record["rollout/weight_version_min"] == record["rollout/weight_version_max"] == record["step"] - 1
    assert any(r["actor/grad_norm"] > 0 for r in records)  # the syncs carried new weights
    assert model_info(url)["weight_version"] == str(STEPS)


@pytest.mark.slow
def test_greedy_lookup_trajectories_equal_the_local_engines(tmp_path, recipe_model, server):
    """top_k=1: both engines take the argmax (their samplers differ, so seeded sampling is not
    comparable); step 1's trajectories, rewards and multi-turn metrics are the same, and so are the
    recipe's greedy eval episodes after it. (The fresh model's argmax turns are "\\n" x 6, no call:
    greedy episodes with calls are compared in test_sglang_runtime.py (real SGLang), test_python_tool_engines.py.)"""
    url, _ = server
    common = ["trainer.total_steps=1", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "rollout.n=2",
              "rollout.top_k=1"]
    runs_by_engine = {}
    for engine, extra in (("sglang", sglang_overrides(url)), ("local", [])):
        runs_by_engine[engine] = run_distributed(_train, 1, (overrides(recipe_model, tmp_path / engine, *common,
                                                                       *extra),), timeout=600)[0]
    sglang, local = runs_by_engine["sglang"], runs_by_engine["local"]
    for key in ("prompt_ids", "response_ids", "mask"):
        assert [s[key] for s in sglang["step_one"]] == [s[key] for s in local["step_one"]], key
    for a, b in zip(sglang["step_one"], local["step_one"]):
        length = len(a["prompt_ids"]) + len(a["response_ids"])
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]),
                                   atol=64 * torch.finfo(torch.float32).eps * length, rtol=0)
    # and so are the recipe's greedy eval episodes (after the step: the same weights on both engines)
    names = [k for k in local["records"][0] if k.startswith(("multi_turn/", "reward/", "eval/"))]
    assert "eval/multi_turn/turns_mean" in names
    assert {k: sglang["records"][0][k] for k in names} == {k: local["records"][0][k] for k in names}


@pytest.mark.slow
def test_asynchronous_multi_turn_on_sglang_trains(tmp_path, recipe_model, server):
    """rollout.max_staleness=1 with the lookup environment on SGLang's own server code: the next
    step's episodes are generated while a step trains, a turn a weight update aborts is resubmitted
    (matched back by position:
    tests/test_sglang_runtime.py::test_async_generate_resubmits_groups_a_weight_update_aborted),
    and every step trains on episodes at most one weight version old."""
    url, log = server
    before = served_turns(log)
    out = run_distributed(_train, 1, (overrides(recipe_model, tmp_path / "run", f"trainer.total_steps={STEPS}",
                                                "eval.interval=-1", "rollout.max_staleness=1",
                                                *sglang_overrides(url)),), timeout=600)[0]
    records = out["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert record["step"] - 1 - record["rollout/weight_version_min"] <= 1  # the staleness bound
        assert record["multi_turn/turns_mean"] >= 1
    from megatron_grpo.config import load_config

    recipe = load_config(RECIPE)
    episodes = recipe.data.train_batch_size * recipe.rollout.n  # per step, each at least one turn
    assert served_turns(log) - before >= STEPS * episodes
    assert str(model_info(url)["weight_version"]) == str(STEPS)
