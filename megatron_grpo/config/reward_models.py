"""Rewards from models, typed: `reward.models` (reward models and LLM judges, by name) and
`reward.combine` (their weights beside the rule reward `reward.function`). Torch-free: the schema
types these sections with them, config/reward_model_checks.py reports their problems, and
reward_models/ builds the scorers from them.

`reward.models` maps a name to a scorer. It is the list of scorers, each named: the name is the
scorer's metric prefix (reward/<name>/...) and its key in reward.combine, and dotted overrides
reach one scorer (`reward.models.rm.sglang.urls=[http://node2:31000]`), which list items could not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

RULE = "rule"  # reward.combine's name for reward.function's score
CPU_SCORER_KV_TOKENS = 16384  # a launched CPU server's default KV cache (reward.models.<name>.sglang.max_total_tokens)


@dataclass(frozen=True)
class ScorerServerConfig:
    """SGLang servers of one scorer (backend=sglang): given by URL, or launched on `gpus`."""

    # Servers (or one sglang-router) already serving the model; empty = launch them on `gpus`
    # (the trainer on its first node, or the sbatch scripts, which then pass the URLs here).
    urls: list[str] = field(default_factory=list)
    # Name of the environment variable holding the servers' API key (the key stays out of recipes).
    api_key_env: Optional[str] = None
    # GPUs of the node that launched servers use, `tp_size` consecutive ones per server
    # (e.g. [6, 7] with tp_size 1: two servers). Not trainer GPUs: the servers keep their memory.
    gpus: list[int] = field(default_factory=list)
    tp_size: int = 1
    port: int = 31000  # first port of launched servers; server i listens on port + i
    mem_fraction: float = 0.85  # --mem-fraction-static of launched servers
    # Where launched servers run: cuda, or cpu (SGLang's CPU backend, as rollout.sglang.device=cpu); on cpu
    # `gpus` only counts the servers (one per tp_size entries) and no --base-gpu-id is passed.
    device: Literal["cuda", "cpu"] = "cuda"
    cpu_threads: int = 1  # device=cpu: OpenMP threads of each server process (OMP_NUM_THREADS)
    # KV cache of a launched server, in tokens (--max-total-tokens). None: SGLang sizes it from mem_fraction
    # on a GPU; on cpu (where SGLang would size it from the machine's RAM) CPU_SCORER_KV_TOKENS.
    max_total_tokens: Optional[int] = None
    extra_args: list[str] = field(default_factory=list)  # passed to sglang.launch_server untouched
    # The command that starts one server (its flags are appended); empty = `python -m sglang.launch_server`.
    launch_command: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    max_concurrency: int = 4  # batch requests in flight per server
    # Tries of one batch request over the servers (connection errors and HTTP 5xx move to the
    # next server); the last error, naming every URL tried, fails the batch's samples.
    max_retries: int = 3


@dataclass(frozen=True)
class JudgeConfig:
    """A generative judge (kind=judge): the chat model is asked `template`, its answer parsed."""

    # The user message; {prompt} (the last user message of the sample's prompt), {response} and
    # {ground_truth} are filled in. Literal braces are written doubled: {{ }}.
    template: str = ""
    system: Optional[str] = None  # an optional system message before it
    # number: the answer holds exactly one number and it is in [min_value, max_value]; its value is
    # the score. regex: `regex`'s first group (else its whole match), a number in that range.
    # yes_no: P(yes) / (P(yes) + P(no)) of the answer's first token, from the returned log-probs.
    # Anything else (no number, two numbers, out of range, a refusal) is a parse failure: the
    # sample scores reward.models.<name>.failure_score and counts in reward/errors/bad_type.
    parse: Literal["number", "regex", "yes_no"] = "number"
    min_value: float = 0.0
    max_value: float = 10.0
    regex: Optional[str] = None
    yes: str = "Yes"  # yes_no: one token each in the judge's tokenizer
    no: str = "No"
    # yes_no: Yes and No together must hold at least this much of the first token's probability;
    # below it the judge said something else (a refusal): a parse failure.
    min_yes_no_mass: float = 0.5
    max_new_tokens: int = 64  # number / regex answers (greedy); yes_no generates one token


@dataclass(frozen=True)
class ModelScorerConfig:
    """One scorer of reward.models (module docstring)."""

    # reward_model: an HF *ForSequenceClassification folder; the reward is its score of the prompt
    # messages plus the response as the assistant's turn, rendered with the RM's own chat template.
    # judge: a chat model asked judge.template (below).
    kind: Literal["reward_model", "judge"] = "reward_model"
    path: Optional[str] = None  # HF folder or hub id: the weights (backend hf) and always the tokenizer
    # What makes `path` (a local folder then) when it does not exist yet, at the start; None = it must
    # exist (or be a hub id). tiny_rm: reward_models/tiny_rm.py's tiny reward model of the embedded
    # task (deterministic, ~10 s on a CPU; recipes/tiny_cpu_rm.yaml).
    build_if_missing: Optional[Literal["tiny_rm"]] = None
    chat_template: Optional[str] = None  # a Jinja template replacing the tokenizer's own
    # hf: in the trainer's process with transformers (tiny models, CPU or one GPU); sglang: SGLang
    # servers (/classify for reward models, /generate for judges), `sglang` below.
    backend: Literal["hf", "sglang"] = "hf"
    device: Literal["cpu", "cuda"] = "cpu"  # backend hf
    dtype: Literal["float32", "bfloat16"] = "float32"  # backend hf
    batch_size: int = 32  # sequences per forward (hf) or per request (sglang)
    # One batch, from its start: past it the batch's samples fail as timeouts (reward/errors/timeout).
    timeout_s: float = 60.0
    # The score as used: none = as the model gives it; affine = (score - shift) / scale;
    # sigmoid = sigmoid((score - shift) / scale), in (0, 1).
    normalize: Literal["none", "affine", "sigmoid"] = "none"
    shift: float = 0.0
    scale: float = 1.0
    # What a failed sample scores (a call that raised or timed out, a judge answer that does not parse).
    failure_score: float = 0.0
    sglang: ScorerServerConfig = field(default_factory=ScorerServerConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass(frozen=True)
class CombineConfig:
    """The reward of a sample: sum over components of weight x score. Components: "rule"
    (reward.function) and each reward.models name; a component with weight 0 for every data source
    is never run (e.g. {rule: 0} with a reward model alone)."""

    weights: dict[str, float] = field(default_factory=dict)  # a component not named weighs 1.0
    # per data_source: weights for rows of that source, over `weights` (verl's per-source scoring)
    by_data_source: dict[str, dict[str, float]] = field(default_factory=dict)

    def weight(self, component: str, data_source: object) -> float:
        per_source = self.by_data_source.get(data_source, {}) if isinstance(data_source, str) else {}
        if component in per_source:
            return per_source[component]
        return self.weights.get(component, 1.0)

    def active(self, component: str) -> bool:
        """Whether `component` has a non-zero weight for some data source (else it is not run)."""
        if self.weights.get(component, 1.0) != 0:
            return True
        return any(w.get(component, 0.0) != 0 for w in self.by_data_source.values())
