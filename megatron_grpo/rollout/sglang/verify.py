"""After a weight sync: do the engines hold what the trainer pushed?

Checks, each naming the tensor and the engine on a mismatch (WeightVerificationError stops the run):
- checksums against the trainer: from the tensors it pushed, the trainer computes what SGLang's
  `/weights_checker {"action": "checksum"}` must report for each of its (fused, TP-sharded)
  parameters on each TP rank (expected_checksums.py), and every engine must report exactly that: the
  same parameters, bitwise the same values. This works with one engine. Where the layout is not
  predicted (MoE fused experts, MLA, a quantized or dtype=auto engine, an engine whose parameters
  are not SGLang's fused ones), ChecksumPlan says so once and the next check stands in.
- consistency: the engines not checked against the trainer must report the same checksums as each
  other, per TP size (an engine that missed or half-applied an update disagrees).
- values: for a sample of the pushed tensors, `/get_weights_by_name` returns the engine's first rows,
  which must equal the trainer's exactly (after rounding to the engine's dtype, bf16 or fp16, if it
  serves in another dtype than it was sent). SGLang skips names its model does not know without an
  error, so this also catches a push the engine silently ignored. Not every SGLang model
  implements get_weights_by_name (Llama does; Qwen2/Qwen3 in 0.5.23 do not): where it answers with
  an error, the value check is reported as unavailable. With engine TP > 1 only tensors whose first
  rows live on TP rank 0 are sampled (not o_proj / down_proj, which are split along columns).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from megatron_grpo.errors import MegatronGRPOError
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.expected_checksums import ChecksumPrediction, EngineLayout, ModelLayout
from megatron_grpo.rollout.sglang.weight_sync import EngineTarget

ROW_SPLIT_SUFFIXES = ("o_proj.weight", "down_proj.weight")  # TP splits these along dim 1
FUSED_SUFFIXES = ("qkv_proj.weight", "gate_up_proj.weight")  # SGLang's stacked parameters
log = logging.getLogger(__name__)


class WeightVerificationError(MegatronGRPOError):
    """An engine does not hold the weights the trainer pushed."""


@dataclass
class WeightSample:
    """What is taken from the pushed tensors while they stream past: the first `rows` rows of every
    tensor outside the decoder layers (embeddings, final norm, LM head) and up to
    `max_layer_tensors` of layer 0, and (`prediction`) the checksums the engines must report."""

    rows: int = 2
    max_layer_tensors: int = 8
    tp_size: int = 1
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    prediction: ChecksumPrediction | None = None

    def wants(self, name: str) -> bool:
        if self.tp_size > 1 and name.endswith(ROW_SPLIT_SUFFIXES):
            return False
        if ".layers." not in name:
            return True
        return ".layers.0." in name and sum(".layers." in n for n in self.tensors) < self.max_layer_tensors

    def tap(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            if self.wants(name):
                self.tensors[name] = tensor[: self.rows].detach().to("cpu", copy=True)
            if self.prediction is not None:
                self.prediction.add(name, tensor)
            yield name, tensor

    def merge(self, other: "WeightSample") -> None:
        """Adds what another sender took (per-stage sync: each stage's sender fills its own)."""
        self.tensors.update(other.tensors)
        if self.prediction is not None and other.prediction is not None:
            self.prediction.merge(other.prediction)


class ChecksumPlan:
    """Which engines' checksums the trainer can predict, from the model (`model`: the served
    models.hf_config.ModelArchitecture; None: none) and each engine's /server_info (read once per
    URL: a restarted engine keeps its arguments). Says once per reason why an engine is not
    predicted."""

    def __init__(self, client: SGLangClient, model=None):
        self.client = client
        self.model = None if model is None else ModelLayout.of(model)
        self._layouts: dict[str, EngineLayout | str] = {}
        self._told: set[str] = set()

    def sample(self, targets: Sequence[EngineTarget]) -> WeightSample:
        sample = WeightSample(tp_size=max(t.tp_size for t in targets))
        layouts = {layout for layout in (self.layout(t.url) for t in targets) if layout is not None}
        if layouts:
            sample.prediction = ChecksumPrediction(self.model, tuple(sorted(layouts, key=repr)))
        return sample

    def layout(self, url: str) -> EngineLayout | None:
        """The engine's layout, when the trainer can predict its checksums."""
        if self.model is None:
            return None
        if isinstance(self.model, str):
            self.tell(self.model)
            return None
        if url not in self._layouts:
            try:
                info = self.client.call(url, "/server_info", method="GET", timeout_s=60.0)
            except SGLangError as exc:
                self.tell(f"{url}: cannot read /server_info ({exc})")
                return None
            layout = EngineLayout.of(info or {})
            if isinstance(layout, EngineLayout):
                layout = self.model.problem(layout) or layout
            self._layouts[url] = layout
        layout = self._layouts[url]
        if isinstance(layout, str):
            self.tell(f"{url}: {layout}")
            return None
        return layout

    def tell(self, reason: str) -> None:
        if reason not in self._told:
            self._told.add(reason)
            log.warning("weight sync verification: the engine's checksums are not predicted from the trainer's "
                        "tensors (%s); engines are compared with each other instead", reason)


@dataclass(frozen=True)
class VerifyReport:
    value_checked: int  # tensors compared by value (0: the engines' model cannot answer)
    engines: int
    trainer_checked: int = 0  # parameters checked against the trainer's by checksum, on the least-checked engine
    checksums: int = 0  # checksums compared with the trainer's (every engine, every TP rank)

    def metrics(self) -> dict[str, float]:
        return {"sync/verified": 1.0, "sync/verified_tensors": float(max(self.value_checked, self.trainer_checked)),
                "sync/checksums_verified": float(self.checksums)}


def verify_engines(client: SGLangClient, targets: Sequence[EngineTarget], sample: WeightSample,
                   plan: ChecksumPlan | None = None) -> VerifyReport:
    checked = 0
    for target in targets:
        checked = max(checked, _check_values(client, target.url, sample))
    answers = {t.url: _checksums(client, t.url) for t in targets}
    per_engine, compared, others = [], 0, []
    for target in targets:
        layout = plan.layout(target.url) if plan is not None and sample.prediction is not None else None
        count = None
        if layout is not None and layout in sample.prediction.layouts:
            count = _check_against_trainer(target.url, answers[target.url], sample.prediction.expected(layout), plan)
        if count is None:
            others.append(target)
            per_engine.append(0)
        else:
            per_engine.append(count // max(layout.tp_size, 1))
            compared += count
    _check_consistency(others, answers)
    return VerifyReport(value_checked=checked, engines=len(targets), trainer_checked=min(per_engine, default=0),
                        checksums=compared)


def _check_values(client: SGLangClient, url: str, sample: WeightSample) -> int:
    """Compares the sampled tensors; returns how many were compared (0 = the model cannot answer)."""
    unknown, checked = [], 0
    for name, sent in sample.tensors.items():
        try:
            got = client.call(url, "/get_weights_by_name", {"name": name, "truncate_size": sample.rows})
        except SGLangError as exc:
            if exc.status != 400:  # 400 "Get parameter by name failed": no such name, or no such method
                raise
            got = None
        if got is None:
            unknown.append(name)
            continue
        engine = torch.tensor(got, dtype=torch.float32)
        if not _same_values(sent, engine):
            diff = (sent.float().reshape(engine.shape) - engine).abs().max().item() \
                if sent.numel() == engine.numel() else float("nan")
            raise WeightVerificationError(
                f"weight sync verification failed: {url} holds different values for {name!r} than the trainer "
                f"pushed (first {sample.rows} rows, shape {tuple(engine.shape)} vs {tuple(sent.shape)}, max |diff| "
                f"{diff:.3g}); the engine ignored or mis-loaded that tensor")
        checked += 1
    if checked and unknown:  # the engine answers by name, but not for these: it never loaded them
        raise WeightVerificationError(
            f"weight sync verification failed: {url} has no parameter {unknown[0]!r} that the trainer pushed "
            f"(SGLang skips unknown names without an error); unknown: {unknown}")
    return checked


def _same_values(sent: torch.Tensor, engine: torch.Tensor) -> bool:
    if sent.numel() != engine.numel():
        return False
    sent = sent.reshape(engine.shape)
    return any(torch.equal(sent.to(dtype).float(), engine) for dtype in (sent.dtype, torch.bfloat16, torch.float16))


def _checksums(client: SGLangClient, url: str) -> list[dict[str, str]]:
    """Per TP rank, the engine's checksum of each parameter."""
    answer = client.call(url, "/weights_checker", {"action": "checksum"})
    ranks = [rank["checksums"] for rank in (answer or {}).get("ranks") or []]
    if not ranks:
        raise WeightVerificationError(f"{url}/weights_checker returned no checksums: {answer!r}")
    return ranks


def _check_against_trainer(url: str, ranks: list[dict[str, str]], expected: list[dict[str, str]],
                           plan: ChecksumPlan) -> int | None:
    """Every parameter of every TP rank against the trainer's prediction; returns how many were
    compared, or None when the engine's parameters are not SGLang's fused ones (not predicted)."""
    fused = {name for name in expected[0] if name.endswith(FUSED_SUFFIXES)}
    if fused and not fused & set(ranks[0]):
        example = sorted(fused)[0]
        plan.tell(f"{url} holds no {example} but {sorted(ranks[0])[:3]}...: not SGLang's fused parameters")
        return None
    if len(ranks) != len(expected):
        raise WeightVerificationError(f"weight sync verification failed: {url} reports {len(ranks)} TP ranks, "
                                      f"its /server_info says {len(expected)}")
    compared = 0
    for rank, (got, want) in enumerate(zip(ranks, expected)):
        unknown = sorted(set(want) - set(got))
        if unknown:
            raise WeightVerificationError(
                f"weight sync verification failed: {url} has no parameter {unknown[0]!r} that the trainer's tensors "
                f"make (SGLang skips unknown names without an error); missing: {unknown}")
        unpushed = sorted(set(got) - set(want))
        if unpushed:
            raise WeightVerificationError(
                f"weight sync verification failed: the trainer pushed nothing for {url}'s parameter {unpushed[0]!r} "
                f"(TP rank {rank}); not pushed: {unpushed}")
        for name in sorted(want):
            if got[name] != want[name]:
                raise WeightVerificationError(
                    f"weight sync verification failed: {url} holds other values for {name!r} (TP rank {rank}) than "
                    f"the trainer pushed (checksum {got[name]}, expected {want[name]}); the engine ignored or "
                    f"mis-loaded that tensor")
            compared += 1
    return compared


def _check_consistency(targets: Sequence[EngineTarget], answers: dict[str, list[dict[str, str]]]) -> None:
    reference: dict[int, tuple[str, list[dict[str, str]]]] = {}
    for target in targets:
        ranks = answers[target.url]
        if target.tp_size not in reference:
            reference[target.tp_size] = (target.url, ranks)
            continue
        first_url, first = reference[target.tp_size]
        for rank, (want, got) in enumerate(zip(first, ranks)):
            for tensor in sorted(set(want) | set(got)):
                if want.get(tensor) != got.get(tensor):
                    raise WeightVerificationError(
                        f"weight sync verification failed: engines {first_url} and {target.url} disagree on "
                        f"{tensor!r} (TP rank {rank}) after the same update")
