"""How one Megatron tensor relates to its HF tensor(s), and how it is split over TP ranks.

Each transform answers two questions, one per direction:
  load_shard(src, hf_names, cfg, tp_rank, tp_size) -> this TP rank's Megatron shard, reading
      only the HF slices it needs (src.read(name, dim, start, stop); dim None = whole tensor);
  to_hf(shards, cfg) -> the HF tensors, from the shards of all TP ranks in rank order
      (a single, unsplit tensor when `tp_split` is False).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_grpo.models.hf_config import ModelArchitecture



class TensorSource(Protocol):
    """Read access to HF tensors by name (convert.hf_io.HFCheckpoint implements it)."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int | None = None,
             stop: int | None = None) -> torch.Tensor: ...


def _part(total: int, rank: int, size: int) -> tuple[int, int]:
    step = total // size
    return rank * step, (rank + 1) * step


class Transform(Protocol):
    tp_split: bool

    def load_shard(self, src: TensorSource, hf_names: tuple[str, ...], cfg: ModelArchitecture,
                   tp_rank: int, tp_size: int) -> torch.Tensor: ...

    def to_hf(self, shards: list[torch.Tensor], cfg: ModelArchitecture) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class Replicated:
    """Same tensor on every TP rank (norm weights)."""
    tp_split: bool = False

    def load_shard(self, src, hf_names, cfg, tp_rank, tp_size):
        return src.read(hf_names[0])

    def to_hf(self, shards, cfg):
        return [shards[0]]


@dataclass(frozen=True)
class Split:
    """One HF tensor cut into equal contiguous TP parts along `dim` (0: column-parallel
    linears, 1: row-parallel linears)."""
    dim: int
    tp_split: bool = True

    def load_shard(self, src, hf_names, cfg, tp_rank, tp_size):
        start, stop = _part(src.shape(hf_names[0])[self.dim], tp_rank, tp_size)
        return src.read(hf_names[0], self.dim, start, stop)

    def to_hf(self, shards, cfg):
        return [torch.cat(shards, dim=self.dim)]


@dataclass(frozen=True)
class VocabRows:
    """Embedding / output rows: padded with zero rows to cfg.padded_vocab_size, then split by rows.
    Export trims the padding."""
    tp_split: bool = True

    def load_shard(self, src, hf_names, cfg, tp_rank, tp_size):
        start, stop = _part(cfg.padded_vocab_size, tp_rank, tp_size)
        real_stop = min(stop, cfg.vocab_size)
        rows = [src.read(hf_names[0], 0, start, real_stop)] if start < real_stop else []
        pad = stop - max(start, real_stop)
        if pad:
            rows.append(torch.zeros(pad, cfg.hidden_size, dtype=rows[0].dtype if rows else torch.float32))
        return torch.cat(rows, dim=0)

    def to_hf(self, shards, cfg):
        return [torch.cat(shards, dim=0)[: cfg.vocab_size]]


@dataclass(frozen=True)
class FusedQKV:
    """q, k, v projections (weights [out, hidden] or biases [out]) fused into linear_qkv, laid
    out per query group: [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...].
    TP ranks own contiguous groups."""
    tp_split: bool = True

    def load_shard(self, src, hf_names, cfg, tp_rank, tp_size):
        q_name, k_name, v_name = hf_names
        g0, g1 = _part(cfg.num_query_groups, tp_rank, tp_size)
        heads_per_group = cfg.num_attention_heads // cfg.num_query_groups
        d = cfg.head_dim
        q = src.read(q_name, 0, g0 * heads_per_group * d, g1 * heads_per_group * d)
        k = src.read(k_name, 0, g0 * d, g1 * d)
        v = src.read(v_name, 0, g0 * d, g1 * d)
        groups = g1 - g0
        tail = q.shape[1:]
        fused = torch.cat([q.reshape(groups, heads_per_group * d, *tail), k.reshape(groups, d, *tail),
                           v.reshape(groups, d, *tail)], dim=1)
        return fused.reshape(groups * (heads_per_group + 2) * d, *tail)

    def to_hf(self, shards, cfg):
        full = torch.cat(shards, dim=0)
        heads_per_group = cfg.num_attention_heads // cfg.num_query_groups
        d = cfg.head_dim
        tail = full.shape[1:]
        per_group = full.reshape(cfg.num_query_groups, (heads_per_group + 2) * d, *tail)
        q, k, v = torch.split(per_group, [heads_per_group * d, d, d], dim=1)
        return [t.reshape(-1, *tail).contiguous() for t in (q, k, v)]


@dataclass(frozen=True)
class FusedGateUp:
    """gate_proj and up_proj fused into linear_fc1 (SwiGLU): each TP rank holds
    cat(gate rows of its part, up rows of its part)."""
    tp_split: bool = True

    def load_shard(self, src, hf_names, cfg, tp_rank, tp_size):
        parts = []
        for name in hf_names:
            start, stop = _part(src.shape(name)[0], tp_rank, tp_size)
            parts.append(src.read(name, 0, start, stop))
        return torch.cat(parts, dim=0)

    def to_hf(self, shards, cfg):
        halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]


@dataclass(frozen=True)
class ExpertTensorParallel:
    """An expert's tensor: `inner`'s split, over the expert tensor-parallel group (rank / size
    bound here by convert.mappings.bind) instead of the TP group the caller passes."""
    inner: Transform
    rank: int
    size: int

    @property
    def tp_split(self) -> bool:
        return self.inner.tp_split

    def load_shard(self, src, hf_names, cfg, tp_rank, tp_size):
        return self.inner.load_shard(src, hf_names, cfg, self.rank, self.size)

    def to_hf(self, shards, cfg):
        return self.inner.to_hf(shards, cfg)
