"""Plain data passed between the trainer and rollout engines: requests in, samples out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


def derive_sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request seeded with `seed`.

    The n samples of one seeded request must differ from each other (identical samples would give a
    GRPO group zero advantage), yet each must be reproducible on its own; every engine uses this
    same derivation so that the local engine and SGLang agree on which seed each sample got.
    Sample 0 keeps the seed itself, so a seeded n=1 request is sent to SGLang unchanged."""
    if sample_index == 0:
        return seed
    return (seed * 1_000_003 + sample_index * 7_919 + 1) % (2**63 - 1)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (SGLang's names; temperature 0 means greedy)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0  # 0: off; else drop tokens below min_p x the most likely token's probability
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"sampling min_p must be in [0, 1), got {self.min_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # Accept lists from YAML / JSON but keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not s for s in self.stop):
            raise ValueError("sampling stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncated(self) -> bool:
        """Whether sampling draws from a truncated distribution (top-p, top-k or min-p), so that
        a token's behaviour probability differs from its full-distribution one."""
        return not self.greedy and (self.top_p < 1.0 or self.top_k != -1 or self.min_p > 0.0)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (token ids) to sample `sampling.n` responses for; `group_id` ties them together."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    group_id: str = ""
    # A later request continues this one's prompt + response (an episode's next turn): the local
    # engine keeps its KV cache for it (rollout/kept_kv.py); SGLang's radix cache keeps prefixes anyway.
    keep_kv: bool = False
    # Sampling-support replay (rollout.sampling_replay): every response token comes back with the
    # ids the engine could have drawn it from (Sample.sampling_support).
    return_support: bool = False
    # Routing replay from SGLang (actor.moe_routing_replay): (num_hidden_layers, num_experts_per_tok)
    # of the MoE model; the request asks for SGLang's return_routed_experts and each Sample carries
    # them (Sample.routed_experts) in that shape. None: not asked. The local engine records routes by
    # its own setting (record_routed_experts) and ignores this.
    routed_experts_shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if self.routed_experts_shape is not None:
            shape = tuple(int(d) for d in self.routed_experts_shape)
            if len(shape) != 2 or min(shape) < 1:
                raise ValueError(f"request {self.group_id!r}: routed_experts_shape must be (num_layers, top_k) >= 1, "
                                 f"got {self.routed_experts_shape}")
            object.__setattr__(self, "routed_experts_shape", shape)
        if not self.prompt_ids:
            raise ValueError(f"request {self.group_id!r}: prompt_ids is empty")


@dataclass
class Sample:
    """One generated response. `logprobs[i]` is log_softmax(logits / T)[response_ids[i]] in fp32,
    taken before top-p/top-k/min-p filtering (T = 1 for greedy), SGLang's default.

    With truncated sampling (SamplingParams.truncated) the token was really drawn from the
    truncated, renormalised distribution; `behaviour_logprobs[i]` is that log-prob where the engine
    reports it (the local engine always; SGLang through return_sampling_mask), and
    `sampling_support[i]` the ids of that distribution's support when the request asked for it
    (GenerationRequest.return_support): the trainer then computes its log-probs over the same ids."""

    group_id: str
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    # MoE engines: the experts every position was routed to, SGLang's return_routed_experts layout:
    # int32 [len(prompt) + len(response) - 1, num_hidden_layers, top_k]; the last token is never fed
    # back, so it has none. Dense layers hold -1 (local engine) or 0 (SGLang: its capture buffer is
    # never written there); nothing reads them, the trainer replays MoE layers only. None: a dense
    # model, or not asked for.
    routed_experts: Any = None
    # Truncated sampling: per response token, the log-prob it was sampled with (see above); None
    # where the engine cannot tell (then `logprobs` is the best known behaviour log-prob).
    behaviour_logprobs: list[float] | None = None
    # Sampling-support replay: per response token, the token ids it could have been drawn from
    # (the top-k / top-p / min-p support, sampled token included; [token] for greedy). None: not asked.
    sampling_support: list[list[int]] | None = None
    # Which engine generated it (a server URL, or "local"): the mismatch health splits by engine.
    engine: str = ""
    # Partial rollouts (trainer/rollouts/long_tail.py): the weight version of each response token when the
    # response spans several (weight_version is then the oldest). None: every token is weight_version's.
    token_versions: list[int] | None = None

    @property
    def sampled_logprobs(self) -> list[float]:
        """The behaviour log-probs where known, else the engine's full-distribution ones."""
        return self.behaviour_logprobs if self.behaviour_logprobs is not None else self.logprobs

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if len(self.response_ids) != len(self.logprobs):
            raise ValueError(f"sample {self.group_id!r}/{self.sample_index}: {len(self.response_ids)} "
                             f"response ids but {len(self.logprobs)} log-probs")
        for name in ("behaviour_logprobs", "sampling_support", "token_versions"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.response_ids):
                raise ValueError(f"sample {self.group_id!r}/{self.sample_index}: {len(self.response_ids)} "
                                 f"response ids but {len(values)} {name}")


@dataclass(frozen=True)
class RequestFinished:
    """Sent by the local engine's process during a generate call (rollout/engine_process.py): request
    `index`'s samples are final. Defined here, not in that module: the process runs it as __main__,
    where a class would not unpickle in the trainer."""

    index: int
    samples: list[Sample]


@dataclass(frozen=True)
class EngineHealth:
    """What `health()` reports: healthy only if every server / the model answered."""

    healthy: bool
    detail: str = ""
    weight_version: int | None = None

    def __bool__(self) -> bool:
        return self.healthy
