"""After a weight sync: do the engines hold what the trainer pushed?

Two checks, each naming the tensor and the engine on a mismatch (WeightVerificationError stops the run):
- values: for a sample of the pushed tensors, `/get_weights_by_name` returns the engine's first rows,
  which must equal the trainer's exactly (after rounding to the engine's dtype, bf16 or fp16, if it
  serves in another dtype than it was sent). SGLang skips names its model does not know without an
  error, so this is what catches a push the engine silently ignored. Not every SGLang model
  implements get_weights_by_name (Llama does; Qwen2/Qwen3 in 0.5.23 do not): where it answers with
  an error, the value check is reported as unavailable. With engine TP > 1 only tensors whose first
  rows live on TP rank 0 are sampled (not o_proj / down_proj, which are split along columns).
- consistency: `/weights_checker {"action": "checksum"}` per-tensor checksums must agree between
  engines of the same TP size (an engine that missed or half-applied an update disagrees). The
  checksums are over SGLang's internal (fused, sharded) tensors, so they are compared between
  engines, not with the trainer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from megatron_grpo.errors import MegatronGRPOError
from megatron_grpo.rollout.sglang.client import SGLangClient
from megatron_grpo.rollout.sglang.errors import SGLangError
from megatron_grpo.rollout.sglang.weight_sync import EngineTarget

ROW_SPLIT_SUFFIXES = ("o_proj.weight", "down_proj.weight")  # TP splits these along dim 1


class WeightVerificationError(MegatronGRPOError):
    """An engine does not hold the weights the trainer pushed."""


@dataclass
class WeightSample:
    """The first `rows` rows of pushed tensors, taken while they stream past: every tensor outside
    the decoder layers (embeddings, final norm, LM head) and up to `max_layer_tensors` of layer 0."""

    rows: int = 2
    max_layer_tensors: int = 8
    tp_size: int = 1
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

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
            yield name, tensor


@dataclass(frozen=True)
class VerifyReport:
    value_checked: int  # tensors compared by value (0: the engines' model cannot answer)
    engines: int

    def metrics(self) -> dict[str, float]:
        return {"sync/verified": 1.0, "sync/verified_tensors": float(self.value_checked)}


def verify_engines(client: SGLangClient, targets: Sequence[EngineTarget], sample: WeightSample) -> VerifyReport:
    checked = 0
    for target in targets:
        checked = max(checked, _check_values(client, target.url, sample))
    _check_consistency(client, targets)
    return VerifyReport(value_checked=checked, engines=len(targets))


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


def _check_consistency(client: SGLangClient, targets: Sequence[EngineTarget]) -> None:
    reference: dict[int, tuple[str, list[dict[str, str]]]] = {}
    for target in targets:
        answer = client.call(target.url, "/weights_checker", {"action": "checksum"})
        ranks = [rank["checksums"] for rank in (answer or {}).get("ranks") or []]
        if not ranks:
            raise WeightVerificationError(f"{target.url}/weights_checker returned no checksums: {answer!r}")
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
