"""Rewards from models (reward.models, docs/rewards.md): reward models and judges against the real
components. SGLang 0.5.23's own runtime on this CPU (lane 2, marker sglang_runtime) serves /classify
for tiny Qwen3 / Llama *ForSequenceClassification checkpoints and /generate for a tiny judge;
their scores are held to HF transformers' in float64.
Judge parsing meets adversarial answers; combination, failure accounting and timeouts run through
CombinedRewards; a bad recipe is one line naming the key (exit 2)."""
from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_grpo.config import load_config, validate
from megatron_grpo.config.reward_models import ModelScorerConfig
from megatron_grpo.data.synthetic import build_tokenizer
from megatron_grpo.errors import ConfigError
from megatron_grpo.models.tiny import save_tiny_hf_model, save_tiny_hf_reward_model
from megatron_grpo.reward_models import judge_parse
from megatron_grpo.rewards.combined import CombinedRewards, ModelScore
from megatron_grpo.rewards.failures import RewardFailure
from megatron_grpo.rewards.runner import RewardRequest
from megatron_grpo.testing.floats import assert_close_to_float64, tolerance

REPO = Path(__file__).resolve().parents[1]
# Served by SGLang's own runtime: Qwen3 and Llama (SGLang's Qwen2 classification class is Qwen3's sibling, the
# same biased head and LAST pooling; one engine start fewer in the cluster lane's budget).
ARCHITECTURES = ("qwen3", "llama")
# SGLang's Qwen2 / Qwen3 classification heads are nn.Linear(hidden, 1) WITH a bias; HF checkpoints
# have none, so SGLang keeps its random initialisation: every score is shifted by one constant.
# Llama's head has no bias (SGLang's models/qwen2_classification.py, qwen3_classification.py, llama_reward.py).
BIASED_HEAD = {"qwen3": True, "llama": False}


def requests_of_the_task() -> list[RewardRequest]:
    """Synthetic-task samples: prompts and answers of several lengths and contents."""
    answers = ["321", "123", "3", "32100", "", "1 2 3", "33", "0000000"]
    return [RewardRequest(prompt="", response=answer, ground_truth="321", extra={"data_source": "synthetic/digits"},
                          messages=({"role": "user", "content": f"reverse {digits}"},))
            for digits in ("123", "4012") for answer in answers]


def hf_reward_float64(folder: Path, sequences) -> torch.Tensor:
    """HF transformers' AutoModelForSequenceClassification in float64, one sequence per forward."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).double().eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in sequences])


# The longest sums of the tiny models (models/tiny.py: 4 layers, MLP width 128), one per layer.
RM_TERMS = 4 * 128


def scorer_config(folder: Path, **fields) -> ModelScorerConfig:
    return ModelScorerConfig(path=str(folder), **fields)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny reward models of each architecture and a tiny judge, with the synthetic task's tokenizer
    (a Qwen-style chat template, one token per digit)."""
    root = tmp_path_factory.mktemp("models")
    folders = {}
    for arch in ARCHITECTURES:
        folders[arch] = save_tiny_hf_reward_model(arch, root / arch, seed=1, pad_token_id=0)
        build_tokenizer(folders[arch])
    folders["judge"] = save_tiny_hf_model("qwen3", root / "judge", seed=2)
    build_tokenizer(folders["judge"])
    return folders


# ----- judge parsing ---------------------------------------------------------------------------
@pytest.mark.parametrize("answer, value", [("8", 8.0), ("Score: 7.5", 7.5), (" 10 ", 10.0), ("0", 0.0)])
def test_a_judge_number_in_range_is_the_score(answer, value):
    assert judge_parse.parse_number(answer, 0, 10) == value


@pytest.mark.parametrize("answer, why", [
    ("The answer is good.", "no number"),
    ("I cannot help with grading this.", "no number"),  # a refusal
    ("7/10", "2 numbers"),
    ("between 6 and 8", "2 numbers"),
    ("11", "outside [0, 10]"),
    ("-1", "outside [0, 10]"),
    ("1e400", "outside [0, 10]"),  # inf
    ("", "no number"),
])
def test_a_judge_answer_that_is_not_one_number_in_range_fails(answer, why):
    with pytest.raises(judge_parse.JudgeParseError, match=re.escape(why)):
        judge_parse.parse_number(answer, 0, 10)


def test_a_regex_reads_one_format_and_refuses_the_rest():
    pattern = r"Score:\s*([0-9.]+)/10"
    assert judge_parse.parse_regex("Reasoning with 3 steps. Score: 7/10", pattern, 0, 10) == 7.0
    for answer, why in (("no score here", "does not match"), ("Score: 12/10", "outside"),
                        ("Score: ./10", "not a number")):
        with pytest.raises(judge_parse.JudgeParseError, match=why):
            judge_parse.parse_regex(answer, pattern, 0, 10)


def test_yes_no_is_the_yes_share_and_a_refusal_fails():
    yes, no = 5, 6
    assert judge_parse.parse_yes_no({yes: math.log(0.6), no: math.log(0.2)}, yes, no, 0.5) == pytest.approx(0.75)
    with pytest.raises(judge_parse.JudgeParseError, match="holds|hold"):  # most mass on another first token
        judge_parse.parse_yes_no({yes: math.log(0.1), no: math.log(0.1)}, yes, no, 0.5)
    with pytest.raises(judge_parse.JudgeParseError, match="no log-probs"):
        judge_parse.parse_yes_no({}, yes, no, 0.5)


# ----- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["reward.models.rm.kind=reward_model"], "reward.models.rm.path: set the model's HF folder"),
    (["reward.models.rm.path=/m", "reward.models.rm.kind=judge"],
     "reward.models.rm.judge.template must contain {response}"),
    (["reward.models.rm.path=/m", "reward.models.rm.kind=judge",
      "reward.models.rm.judge.template='{answer} {response}'"],
     "reward.models.rm.judge.template: unknown field(s) {answer}"),
    (["reward.models.rm.path=/m", "reward.models.rm.judge.parse=regex"],
     "reward.models.rm.judge: set only for kind=judge"),
    (["reward.models.rm.path=/m", "reward.models.rm.backend=sglang"],
     "reward.models.rm.sglang: give the servers' urls, or the gpus"),
    (["reward.models.rm.path=/m", "reward.models.rm.sglang.urls=[http://a:1]"],
     "reward.models.rm.sglang: set only with backend=sglang"),
    (["reward.models.rm.path=/m", "reward.models.rm.backend=sglang", "reward.models.rm.sglang.gpus=[0]",
      "reward.models.rm.sglang.device=cpu", "reward.models.rm.sglang.cpu_threads=0"],
     "reward.models.rm.sglang.cpu_threads=0 must be >= 1"),
    (["reward.models.rm.path=/m", "reward.models.rm.backend=sglang", "reward.models.rm.sglang.gpus=[0]",
      "reward.models.rm.sglang.max_total_tokens=0"], "reward.models.rm.sglang.max_total_tokens=0 must be >= 1"),
    (["reward.models.rm.path=/m", "reward.models.rm.backend=sglang", "reward.models.rm.sglang.gpus=[0]",
      "reward.models.rm.sglang.device=tpu"], "reward.models.rm.sglang.device"),
    (["reward.models.rm.path=/m", "reward.combine.weights={rule: 1, rn: 1}"],
     "reward.combine.weights.rn: no such component"),
    (["reward.models.rm.path=/m", "reward.combine.weights={rule: 0, rm: 0}"], "every component weighs 0"),
    (["reward.models.rule.path=/m"], "reward.models.rule: a scorer's name"),
    (["reward.models.rm.path=/m", "rollout.multi_turn.environment=lookup"],
     "reward.models with rollout.multi_turn.environment='lookup' is not supported yet"),
])
def test_a_bad_reward_model_config_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(load_config("tiny_cpu", overrides))
    assert message in str(info.value)


def _folder_problem(folder: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config("tiny_cpu", [f"reward.models.rm.path={folder}", *overrides]))
    return str(info.value)


def test_a_causal_lm_as_reward_model_is_refused_before_loading(models, tmp_path):
    """A *ForCausalLM folder would load with a random score head: refused from config.json and the
    weights' names, for the in-process backend and for servers launched here; a classifier config over
    a causal LM's weights is refused too (no score.* tensor)."""
    message = _folder_problem(models["judge"])
    assert f"reward.models.rm.path={models['judge']} is a causal LM (Qwen3ForCausalLM)" in message
    assert "*ForSequenceClassification" in message
    assert "is a causal LM" in _folder_problem(models["judge"], "reward.models.rm.backend=sglang",
                                               "reward.models.rm.sglang.gpus=[0]")
    relabelled = tmp_path / "relabelled"
    shutil.copytree(models["judge"], relabelled)
    config = json.loads((relabelled / "config.json").read_text())
    (relabelled / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForSequenceClassification"]}))
    message = _folder_problem(relabelled)
    assert "its weights hold no score head (no score.* / classifier.* tensor" in message
    validate(load_config("tiny_cpu", [f"reward.models.rm.path={models['qwen3']}"]))  # a reward model passes


def test_a_reward_model_as_judge_is_named_in_one_line(models):
    message = _folder_problem(models["qwen3"], "reward.models.rm.kind=judge",
                              "reward.models.rm.judge.template='rate {response}'")
    assert message == (f"reward.models.rm.path={models['qwen3']} is a reward model (Qwen3ForSequenceClassification), "
                       "not a chat model: a judge generates its answer: a chat model (*ForCausalLM); this one scores "
                       "as kind=reward_model")


def test_the_in_process_backend_reads_the_load_report(models):
    """A hub id's folder is not local for the recipe check: the in-process backend refuses the same
    mistakes from transformers' loading info."""
    from megatron_grpo.reward_models.hf_backend import HFBackend

    with pytest.raises(ConfigError, match=r"reward.models.rm.path=.*: the weights have no score head \(score.weight"):
        HFBackend(str(models["judge"]), "reward_model", "cpu", "float32", "reward.models.rm")
    with pytest.raises(ConfigError, match=r"reward.models.rm.path=.* is a reward model .*not a chat model"):
        HFBackend(str(models["qwen3"]), "judge", "cpu", "float32", "reward.models.rm")


def test_a_missing_local_rm_folder_is_named_without_asking_the_hub(monkeypatch, tmp_path):
    """outputs/rm with ./outputs here is a local path: named missing at once, never sent to the hub
    (whose retries took about a minute)."""
    import transformers

    from megatron_grpo.reward_models.build import build_scorer

    def no_hub(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    with pytest.raises(ConfigError) as info:
        build_scorer("rm", ModelScorerConfig(path="outputs/rm"), tmp_path)
    assert str(info.value) == ("reward.models.rm.path=outputs/rm: no such file or folder (a local path: ./outputs is "
                               "a folder here; a Hugging Face hub id is written org/name)")


def test_build_if_missing_builds_the_folder_once_and_whole(monkeypatch, tmp_path):
    """reward.models.<name>.build_if_missing=tiny_rm: the builder writes beside the path and the folder
    is renamed into place (an interrupted build leaves no half model); an existing folder is kept."""
    from megatron_grpo.reward_models import tiny_rm
    from megatron_grpo.reward_models.build import build_if_missing

    calls = []

    def fake_builder(out):
        calls.append(Path(out))
        Path(out).mkdir()
        (Path(out) / "config.json").write_text("{}")
        return tiny_rm.TinyRewardModel(Path(out), 1.0, 2.0)

    monkeypatch.setattr(tiny_rm, "train_tiny_reward_model", fake_builder)
    target = tmp_path / "outputs" / "tiny_rm"
    (tmp_path / "outputs" / "tiny_rm.partial").mkdir(parents=True)  # an interrupted earlier build
    cfg = ModelScorerConfig(path=str(target), build_if_missing="tiny_rm")
    build_if_missing("reward.models.rm", cfg)
    assert calls == [tmp_path / "outputs" / "tiny_rm.partial"]
    assert (target / "config.json").is_file() and not calls[0].exists()
    build_if_missing("reward.models.rm", cfg)
    assert len(calls) == 1  # there now: not rebuilt
    build_if_missing("reward.models.rm", ModelScorerConfig(path=str(tmp_path / "other")))
    assert len(calls) == 1 and not (tmp_path / "other").exists()  # no build_if_missing: nothing built
    with pytest.raises(ConfigError, match="reward.models.rm.build_if_missing=tiny_rm builds a reward model; this "
                                          "scorer is a judge"):
        validate(load_config("tiny_cpu_rm", ["reward.models.rm.kind=judge",
                                             "reward.models.rm.judge.template='rate {response}'"]))


def test_the_cli_refuses_a_bad_scorer_with_exit_2_before_building(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.train", "tiny_cpu", f"logging.output_dir={tmp_path}",
                           "reward.models.judge.path=/m", "reward.models.judge.kind=judge",
                           "reward.models.judge.judge.template=rate {respones}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "reward.models.judge.judge.template" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "initial_model").exists()


# ----- combination, failures, timeouts (scorers that need no model) ----------------------------
class FakeScorer:
    """A ModelScorer whose scores and failures the test sets: value(request) -> float, or raises."""

    def __init__(self, name, value, batch_size=3, concurrency=2, timeout_s=5.0, failure_score=-1.0, delay_s=0.0):
        self.name, self.value = name, value
        self.description = f"reward.models.{name} (fake)"
        self.batch_size, self.concurrency, self.timeout_s = batch_size, concurrency, timeout_s
        self.failure_score, self.delay_s = failure_score, delay_s
        self.batches: list[int] = []

    def score(self, requests):
        self.batches.append(len(requests))
        time.sleep(self.delay_s)
        return [ModelScore(self.value(r)) for r in requests]

    def close(self):
        pass


def _request(i: int, source: str) -> RewardRequest:
    return RewardRequest(prompt=f"p{i}", response=str(i), ground_truth=str(i), extra={"data_source": source})


def test_components_are_weighted_per_data_source_and_streamed_in_key_order():
    def weight(component, source):
        return {("rm", "b"): 0.0, ("judge", "a"): 0.5}.get((component, source), 1.0)

    rm, judge = FakeScorer("rm", lambda r: float(r.response)), FakeScorer("judge", lambda r: 10.0)
    rewards = CombinedRewards(None, [rm, judge], weight, max_error_frac=0.5)
    stream = rewards.stream()
    groups = {key: [_request(4 * key + j, "ab"[key % 2]) for j in range(4)] for key in (2, 0, 1)}
    for key, group in groups.items():  # out of order, as groups finish
        stream.submit(key, group)
    result = stream.result()
    expected = []
    for key in (0, 1, 2):
        for r in groups[key]:
            source = r.extra["data_source"]
            expected.append(weight("rm", source) * float(r.response) + weight("judge", source) * 10.0)
    assert result.scores == expected
    assert sum(rm.batches) == 8  # source b weighs rm 0: its samples never reach it
    assert max(rm.batches + judge.batches) <= 3  # batch_size
    assert result.metrics["reward/errors"] == 0 and result.metrics["reward/judge/mean"] == 10.0


def test_failed_and_timed_out_samples_score_the_failure_value_and_count():
    class Raising(FakeScorer):
        def score(self, requests):
            if any(r.response == "1" for r in requests):
                raise ConnectionError("http://rm:1/classify unreachable")
            return [ModelScore(None, "bad_type", "no number") if r.response == "2" else ModelScore(1.0)
                    for r in requests]

    scorer = Raising("rm", None, batch_size=2, failure_score=-1.0)
    rewards = CombinedRewards(None, [scorer], lambda c, s: 1.0, max_error_frac=0.8)
    result = rewards.score([_request(i, "a") for i in range(6)])
    # batches (0, 1) -> raised, (2, 3) -> bad_type for 2, (4, 5) -> ok
    assert result.scores == [-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    assert result.errors == [True, True, True, False, False, False]
    assert result.metrics["reward/errors/raised"] == 2 and result.metrics["reward/errors/bad_type"] == 1
    slow = FakeScorer("slow", lambda r: 1.0, batch_size=1, concurrency=1, timeout_s=0.2, delay_s=1.0)
    started = time.perf_counter()
    rewards = CombinedRewards(None, [slow], lambda c, s: 1.0, max_error_frac=1.0)
    result = rewards.score([_request(i, "a") for i in range(2)])
    assert result.metrics["reward/errors/timeout"] == 2 and result.scores == [-1.0, -1.0]
    assert time.perf_counter() - started < 0.9  # the second batch did not wait for the first one's hung call
    with pytest.raises(RewardFailure, match=r"scorer reward.models.rm \(fake\) failed on 3 of 6 calls.*unreachable"):
        CombinedRewards(None, [Raising("rm", None, batch_size=2)], lambda c, s: 1.0, max_error_frac=0.4).score(
            [_request(i, "a") for i in range(6)])


# ----- the in-process backend (transformers) ----------------------------------------------------
def test_in_process_reward_model_equals_hf_float64(models):
    from megatron_grpo.reward_models.build import build_scorer

    requests = requests_of_the_task()
    scorer = build_scorer("rm", scorer_config(models["qwen3"], batch_size=5), Path("unused"))
    scores = [o.score for o in scorer.score(requests)]
    sequences = [scorer.renderer.ids(conv, generation_prompt=False) for conv in map(_conversation, requests)]
    assert_close_to_float64(torch.tensor(scores), hf_reward_float64(models["qwen3"], sequences),
                            dtype=torch.float32, terms=RM_TERMS, name="in-process reward")
    sigmoid = build_scorer("rm", scorer_config(models["qwen3"], normalize="sigmoid", shift=0.1, scale=0.5), Path("u"))
    assert [o.score for o in sigmoid.score(requests[:3])] == pytest.approx(
        [1 / (1 + math.exp(-(s - 0.1) / 0.5)) for s in scores[:3]], rel=1e-6)


def _conversation(request):
    from megatron_grpo.reward_models.render import conversation

    return conversation(request)


# ----- SGLang 0.5.23's own runtime on this CPU (build/sglang-runtime-venv) --------------------------
# These tests run in lane 2's interpreter (marker sglang_runtime); the real runtime serves /classify and
# the judge's /generate on a CPU as on a GPU.
REAL_SCORER_FLAGS = ("--dtype", "float32", "--skip-server-warmup")


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """name -> URL of a real CPU server: qwen3 (a reward model, SGLang's classification flags as the
    scorer passes them) and judge started by the tests' launcher; llama launched by a scorer itself
    (reward.models.<name>.sglang.gpus with device=cpu, the trainer's path), all at the same time. The
    launched scorer is "launched"; closing it at the end must stop its server."""
    from megatron_grpo.config.reward_models import ScorerServerConfig
    from megatron_grpo.launch.env import free_server_port
    from megatron_grpo.reward_models.build import RM_SERVER_SEED, build_scorer
    from megatron_grpo.rollout.sglang.launcher import SGLangLauncher
    from tests.sglang_runtime_fixtures import real_server_settings, runtime_env, runtime_python

    rm_flags = ("--is-embedding", "--random-seed", str(RM_SERVER_SEED))
    settings = {name: real_server_settings(models[name], extra_args=rm_flags if name != "judge" else ())
                for name in ("qwen3", "judge")}
    # Started from this (the main) thread, then waited for after the scorer's own server: a server
    # started from a helper thread gets its parent-death SIGTERM when that thread ends
    # (launch/lifetime.py), which is how an earlier version of this fixture lost its servers in CI.
    started = SGLangLauncher(servers=list(settings.values()), log_dir=tmp_path_factory.mktemp("logs"),
                             env=runtime_env())
    started.start()
    launched = None
    try:
        sglang = ScorerServerConfig(gpus=[0], port=free_server_port(), device="cpu",
                                    launch_command=[runtime_python(), "-m", "sglang.launch_server"],
                                    extra_args=[*REAL_SCORER_FLAGS, "--nccl-port", str(free_server_port())])
        launched = build_scorer("rm", scorer_config(models["llama"], backend="sglang", sglang=sglang),
                                tmp_path_factory.mktemp("rm-logs"))
        started.wait_healthy(timeout_s=300, poll_s=0.5)
    except BaseException:
        if launched is not None:
            launched.close()
        started.shutdown(grace_s=2)
        raise
    yield {**{name: server.url for name, server in settings.items()}, "llama": launched.backend.urls[0],
           "launched": launched}
    [process] = launched.backend.launcher.processes
    launched.close()
    started.shutdown(grace_s=2)
    assert process.process.poll() is not None, "the scorer's close() left its server running"


def sglang_scorer(name: str, folder: Path, urls, **fields):
    from megatron_grpo.config.reward_models import ScorerServerConfig
    from megatron_grpo.reward_models.build import build_scorer

    sglang = ScorerServerConfig(urls=list(urls), max_retries=fields.pop("max_retries", 3))
    return build_scorer(name, scorer_config(folder, backend="sglang", sglang=sglang, **fields), Path("unused"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.sglang_runtime
def test_classify_scores_equal_hf_sequence_classification(models, servers, arch):
    """/classify (SGLang's head and LAST pooling) against AutoModelForSequenceClassification in
    float64 on the same token ids: equal for Llama; for Qwen2 / Qwen3 equal up to one constant,
    SGLang's randomly initialised score bias (see BIASED_HEAD)."""
    requests = requests_of_the_task()
    scorer = sglang_scorer("rm", models[arch], [servers[arch]], batch_size=len(requests))
    scores = torch.tensor([o.score for o in scorer.score(requests)], dtype=torch.float64)
    sequences = [scorer.renderer.ids(_conversation(r), generation_prompt=False) for r in requests]
    reference = hf_reward_float64(models[arch], sequences)
    offset = scores - reference
    allowed = tolerance(torch.float32, RM_TERMS) * float(reference.abs().max())
    assert float((offset - offset[0]).abs().max()) <= 2 * allowed, "not one constant offset"
    if BIASED_HEAD[arch]:
        assert abs(float(offset[0])) > 100 * allowed  # SGLang's bias is there, as on a GPU server
        scores = scores - float(offset.mean())
    assert_close_to_float64(scores, reference, dtype=torch.float32, terms=RM_TERMS, name=f"{arch} /classify")
    assert reference.std() > 10 * allowed  # the inputs are told apart: the comparison means something


@pytest.mark.sglang_runtime
def test_v1_classify_gives_probabilities_not_a_reward(models, servers):
    """Why the client uses /classify: SGLang's /v1/classify answers softmax over the labels, 1.0 for
    every input of a one-output reward model."""
    from megatron_grpo.rollout.sglang.http_json import request_json

    answers = [request_json(servers["llama"], "/v1/classify", {"model": "rm", "input": ids})["data"][0]["probs"]
               for ids in ([1, 5, 10, 15, 2], [1, 6, 10, 17, 16, 2])]
    assert answers == [[1.0], [1.0]]


@pytest.mark.sglang_runtime
def test_sglang_router_does_not_route_classify(servers, tmp_path):
    """Why reward-model servers are given one by one (the client spreads and fails over itself):
    the real sglang-router 0.3.2 in front of a classification server answers 404 to /classify."""
    import urllib.error
    import urllib.request

    from tests.sglang_runtime_fixtures import launch_real_router

    router = launch_real_router(tmp_path / "router", [servers["llama"]])
    try:
        request = urllib.request.Request(router.router.url + "/classify", data=b'{"input_ids": [[1, 5, 7]]}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
    finally:
        router.shutdown(grace_s=2)
    assert refused.value.code == 404


@pytest.mark.sglang_runtime
def test_a_judge_scores_alike_through_sglang_and_in_process(models, servers):
    """yes_no: P(yes) / (P(yes) + P(no)) of the first answer token equals HF's float64 value;
    number: SGLang's greedy answer is the in-process backend's, parsed the same way."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.config.reward_models import JudgeConfig
    from megatron_grpo.reward_models.build import build_scorer

    requests = requests_of_the_task()[:6]
    yes_no = JudgeConfig(template="{prompt} -> {response}? ({ground_truth})", parse="yes_no", yes="1", no="0",
                         min_yes_no_mass=1e-6)
    judge = sglang_scorer("judge", models["judge"], [servers["judge"]], kind="judge", judge=yes_no)
    remote = [o.score for o in judge.score(requests)]
    model = AutoModelForCausalLM.from_pretrained(models["judge"], dtype=torch.float32).double().eval()
    yes, no = judge.yes_no
    for request, value in zip(requests, remote):
        from megatron_grpo.reward_models.render import judge_messages

        ids = judge.renderer.ids(judge_messages(request, yes_no), generation_prompt=True)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
        expected = torch.exp(logprobs[yes]) / (torch.exp(logprobs[yes]) + torch.exp(logprobs[no]))
        assert_close_to_float64(torch.tensor([value]), expected.reshape(1), dtype=torch.float32, terms=RM_TERMS)
    number = JudgeConfig(template="{response}", parse="number", min_value=0, max_value=99999, max_new_tokens=6)
    here = build_scorer("judge", scorer_config(models["judge"], kind="judge", judge=number), Path("unused"))
    there = sglang_scorer("judge", models["judge"], [servers["judge"]], kind="judge", judge=number)
    prompts = [here.renderer.ids(judge_messages(r, number), generation_prompt=True) for r in requests]
    assert [r.text for r in there.backend.generate(prompts, 6)] == [r.text for r in here.backend.generate(prompts, 6)]
    assert [(o.score, o.kind) for o in there.score(requests)] == [(o.score, o.kind) for o in here.score(requests)]


@pytest.mark.sglang_runtime
def test_a_scorer_launches_its_servers_on_its_gpus(models, servers):
    """reward.models.<name>.sglang.gpus without urls: the trainer's process started the llama server
    (the servers fixture, with device=cpu; the runtime venv's python through sglang.launch_command)
    with SGLang's classification flags, one seed and a capped KV cache, and scores through it as a
    scorer given its URL does (the fixture's teardown checks that close() stops it)."""
    from megatron_grpo.config.reward_models import CPU_SCORER_KV_TOKENS

    launched = servers["launched"]
    [process] = launched.backend.launcher.processes
    command = " ".join(process.cmd)
    assert f"--device cpu --sleep-on-idle --max-total-tokens {CPU_SCORER_KV_TOKENS} --is-embedding --random-seed 0" \
        in command and "--base-gpu-id" not in command
    given = sglang_scorer("rm", models["llama"], [servers["llama"]])
    requests = requests_of_the_task()[:4]
    assert [o.score for o in launched.score(requests)] == [o.score for o in given.score(requests)]


@pytest.mark.sglang_runtime
def test_dead_and_slow_rm_servers_follow_the_engine_fault_rules(models, servers):
    """At start a server that does not answer, or serves a generation model, is one error naming it;
    while scoring a dead server is failed over to a live one; all dead, or slower than timeout_s,
    the samples fail, counted, and past max_error_frac the run stops naming the URL."""
    from megatron_grpo.launch.env import free_server_port
    from megatron_grpo.reward_models.sglang_backend import ScorerServerError

    dead = f"http://127.0.0.1:{free_server_port()}"
    with pytest.raises(ScorerServerError, match=f"reward.models.rm: its SGLang server does not answer: .*{dead}"):
        sglang_scorer("rm", models["llama"], [dead])
    with pytest.raises(ScorerServerError, match=f"{servers['judge']} serves .* as a generation model"):
        sglang_scorer("rm", models["llama"], [servers["judge"]])
    requests = requests_of_the_task()[:4]
    both = sglang_scorer("rm", models["llama"], [servers["llama"]], batch_size=1)
    expected = [o.score for o in both.score(requests)]
    both.backend.rotation.set_urls([dead, servers["llama"]])  # the first one died after the start
    assert [o.score for o in both.score(requests)] == expected
    both.backend.rotation.set_urls([dead])
    rewards = CombinedRewards(None, [both], lambda c, s: 1.0, max_error_frac=0.5)
    with pytest.raises(RewardFailure, match=f"failed on 4 of 4 calls \\(raised 4\\).*{dead}/classify"):
        rewards.score(requests)
    slow = sglang_scorer("rm", models["llama"], [servers["llama"]], max_retries=1)
    slow.backend.timeout_s = 0.3
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:  # accepts, never answers
        slow.backend.rotation.set_urls([f"http://127.0.0.1:{silent.getsockname()[1]}"])
        result = CombinedRewards(None, [slow], lambda c, s: 1.0, max_error_frac=1.0).score(requests)
    assert result.metrics["reward/errors/timeout"] == len(requests), result.metrics


# ----- the tiny recipe learns from its reward model ---------------------------------------------------
def _train_recipe(rank, world_size, recipe, overrides):
    import json

    from megatron_grpo.config import load_config, validate
    from megatron_grpo.trainer.loop import train

    cfg = load_config(recipe, overrides)
    validate(cfg, world_size=world_size)
    train(cfg)
    with open(Path(cfg.logging.output_dir) / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


@pytest.mark.slow
def test_tiny_rm_recipe_learns_the_preferred_property(tmp_path):
    """recipes/tiny_cpu_rm.yaml as shipped: its start builds the RM, which is not there yet
    (build_if_missing, deterministic); the share of answers starting with 0 (reward/leading_zero, the
    rule's probe, which scores 0) goes from <= 0.3 to >= 0.8, and the reward model's score (the whole
    reward) rises with it. The suite's one run of it."""
    from megatron_grpo.reward_models.build import BUILD_RECORD
    from megatron_grpo.testing.distributed import run_distributed

    records = run_distributed(_train_recipe, 1, ("tiny_cpu_rm", [
        f"reward.models.rm.path={tmp_path / 'rm'}", f"logging.output_dir={tmp_path / 'run'}", "trainer.total_steps=36",
        "logging.console=false", "logging.plot=false"]), timeout=600)[0]
    rm = json.loads((tmp_path / "rm" / BUILD_RECORD).read_text())
    assert rm["heldout_accuracy"] >= 0.95 and rm["margin"] > 1  # the RM prefers the property on unseen pairs
    share = [r["reward/leading_zero"] for r in records]
    rm_score = [r["reward/rm/mean"] for r in records]
    assert share[0] <= 0.3 and sum(share[-3:]) / 3 >= 0.8, [round(s, 2) for s in share]
    assert sum(rm_score[-3:]) / 3 > rm_score[0] + 3, [round(s, 2) for s in rm_score]  # measured: -4.5 -> 1.5
    assert all(r["reward/mean"] == pytest.approx(r["reward/rm/mean"], abs=1e-9) for r in records)  # the RM's alone
    assert all(r["reward/errors"] == 0 for r in records)
