"""LoRA adapters beside megatron-core's tensor-parallel linear layers.

One `LoraAdapter` serves one Megatron linear layer and holds one (A, B) pair per HF projection fused into
it (linear_qkv: q, k, v; linear_fc1: gate, up), named as PEFT names them, so that an adapter maps to PEFT's
tensors one to one. The adapter is a sibling module of its linear layer (`linear_qkv_lora` next to
`linear_qkv`): the base's parameter names, checkpoint keys and conversion rules stay as they are, and
a forward hook on the base adds the adapter's output to the base's.

Tensor parallelism (the base's TP group):
  column-parallel base (output rows split): A is whole on every rank, B holds this rank's rows of each
      projection. h = x A^T is computed whole on every rank; its gradient is all-reduced over TP
      (copy_to_tensor_model_parallel_region), so A's gradient and the input's are whole on every rank.
      With sequence parallelism the input is gathered first, its gradient split back without a reduction.
  row-parallel base (input columns split): A holds this rank's input columns, B is whole; the partial
      h = x_local A_local^T is all-reduced over TP (as the base reduces its output), with sequence
      parallelism the adapter's output is then scattered over the sequence like the base's.
Fused layouts follow convert/transforms.py: linear_qkv per query group [q heads, k, v]; linear_fc1
[gate rows; up rows] on each rank.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

import torch

Parallel = Literal["column", "row"]


@dataclass(frozen=True)
class AdapterShape:
    """Where one adapter sits and how big its tensors are on this rank."""
    parallel: Parallel
    projections: tuple[str, ...]        # HF projections fused into the base, in the fused order
    trained: tuple[str, ...]            # those that carry an adapter (target_modules)
    in_features: int                    # this rank's input width (row-parallel: a TP part of it)
    out_features: tuple[int, ...]       # per projection: this rank's rows (column) or all rows (row)
    groups: int                         # fused row interleave: local query groups (qkv), else 1


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear layer; see the module doc."""

    def __init__(self, shape: AdapterShape, rank: int, alpha: float, dropout: float, *, peft_prefix: str, tp_group,
                 sequence_parallel: bool, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.shape = shape
        self.peft_prefix = peft_prefix  # "base_model.model.model.layers.{i}.self_attn.": PEFT's names of its tensors
        self.rank = rank
        self.scale = alpha / rank
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.enabled = True
        self.dropout_p = dropout
        outs = dict(zip(shape.projections, shape.out_features))
        self.lora_A = torch.nn.ParameterDict({
            name: torch.nn.Parameter(torch.empty(rank, shape.in_features, dtype=dtype, device=device))
            for name in shape.trained})
        self.lora_B = torch.nn.ParameterDict({
            name: torch.nn.Parameter(torch.zeros(outs[name], rank, dtype=dtype, device=device))
            for name in shape.trained})
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        # megatron's gradient norm (and clipping) counts a TP-split tensor on every rank, others on TP rank 0
        for _, param in self.split_tensors():
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=self.tp_split_axis(), stride=1)

    def tp_split_axis(self) -> int:
        """The axis of A (row-parallel) or B (column-parallel) split over TP: 1 for A, 0 for B."""
        return 0 if self.shape.parallel == "column" else 1

    def split_tensors(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(key, parameter) of the tensors split over TP, keys as in state_dict()."""
        which = "lora_B" if self.shape.parallel == "column" else "lora_A"
        for name, param in getattr(self, which).items():
            yield f"{which}.{name}", param

    def reset_parameters(self, generator: torch.Generator) -> None:
        """PEFT's init: A kaiming-uniform(a=sqrt(5)) over its full input width, B zero. The generator must
        give every TP rank the same draws (A is whole, or cut from the same whole matrix)."""
        tp = torch.distributed.get_world_size(self.tp_group) if self.tp_group is not None else 1
        rank = torch.distributed.get_rank(self.tp_group) if self.tp_group is not None else 0
        for name, a in self.lora_A.items():
            full_in = a.shape[1] * (tp if self.shape.parallel == "row" else 1)
            whole = torch.empty(a.shape[0], full_in, dtype=torch.float32)
            bound = 1 / math.sqrt(full_in)  # kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            whole.uniform_(-bound, bound, generator=generator)
            if self.shape.parallel == "row":
                whole = whole[:, rank * a.shape[1]:(rank + 1) * a.shape[1]]
            with torch.no_grad():
                a.copy_(whole)
                self.lora_B[name].zero_()

    # -- forward -------------------------------------------------------------------------------------
    def hook(self, module, args, kwargs, output):
        """Forward hook on the base linear layer: (output + adapter(x), bias)."""
        if not self.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + self.delta(x).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        tp = self.tp_group is not None and torch.distributed.get_world_size(self.tp_group) > 1
        names = list(self.lora_A)
        if self.shape.parallel == "column":
            if self.sequence_parallel and tp:
                x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                                  group=self.tp_group)
            h = self._dropout(x) @ torch.cat([self.lora_A[n] for n in names]).t()
            if tp:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            parts = dict(zip(names, (part @ self.lora_B[n].t() for n, part in zip(names, h.split(self.rank, -1)))))
            lead = h.shape[:-1]
            outs = [parts[p] if p in parts else h.new_zeros(*lead, rows)
                    for p, rows in zip(self.shape.projections, self.shape.out_features)]
            return fuse_rows(outs, self.shape.groups, dim=-1) * self.scale
        # row-parallel: a single projection (o_proj, down_proj)
        (name,) = names
        h = self._dropout(x) @ self.lora_A[name].t()
        if tp:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        out = (h @ self.lora_B[name].t()) * self.scale
        if self.sequence_parallel and tp:
            out = mappings.scatter_to_sequence_parallel_region(out, group=self.tp_group)
        return out

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """PEFT's lora_dropout, in training passes only: log-prob passes (no grad) stay deterministic."""
        if self.dropout_p and self.training and torch.is_grad_enabled():
            return torch.nn.functional.dropout(x, self.dropout_p)
        return x

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of W + scale * B A, in the base weight's layout and dtype."""
        if self.shape.parallel == "row":
            (name,) = list(self.lora_A)
            delta = self.lora_B[name].float() @ self.lora_A[name].float()
        else:
            parts = [self.lora_B[p].float() @ self.lora_A[p].float() if p in self.lora_A
                     else weight.new_zeros(rows, weight.shape[1], dtype=torch.float32)
                     for p, rows in zip(self.shape.projections, self.shape.out_features)]
            delta = fuse_rows(parts, self.shape.groups, dim=0)
        return (weight.float() + self.scale * delta).to(weight.dtype)

    # -- distributed checkpointing ----------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron dist_checkpointing: the TP-split tensors with their axis, the others replicated, so a
        checkpoint of one layout loads into another."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        axes = {key: self.tp_split_axis() for key, _ in self.split_tensors()}
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


def fuse_rows(parts: Sequence[torch.Tensor], groups: int, dim: int) -> torch.Tensor:
    """Megatron's fused row order from per-projection rows along `dim`: each part cut into `groups`
    equal blocks, block g of every part side by side, then block g + 1 ([q_g, k_g, v_g, ...] for
    linear_qkv with groups = query groups; [gate; up] for linear_fc1 with groups = 1)."""
    dim = dim % parts[0].dim()
    blocks = [p.unflatten(dim, (groups, p.shape[dim] // groups)) for p in parts]
    return torch.cat(blocks, dim=dim + 1).flatten(dim, dim + 1)


def adapters_of(model_chunks: Sequence[torch.nn.Module]) -> list[LoraAdapter]:
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, LoraAdapter)]


@contextlib.contextmanager
def adapters_off(model_chunks: Sequence[torch.nn.Module]):
    """The base model for the block (the KL reference of a LoRA run: no second copy of the weights)."""
    adapters = adapters_of(model_chunks)
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True
