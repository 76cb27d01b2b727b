"""Log-probs and entropy of target tokens from tensor-parallel logit shards, chunked over tokens.

Each TP rank holds logits[..., V/tp] for the vocabulary slice [rank*V/tp, (rank+1)*V/tp). With
z = logits / temperature restricted to the true vocabulary (megatron pads V to a multiple of
128*TP; the padded columns carry no probability):

    logp_t   = z[target] - lse(z),               lse(z) = m + log S,  S = sum_j exp(z_j - m)
    entropy  = lse(z) - sum_j p_j z_j  = log S - W / S,               W = sum_j exp(z_j - m) (z_j - m)
    d logp / dz = onehot(target) - p,   d entropy / dz = -p * (z - E_p[z]),   E_p[z] = m + W / S

Memory: the forward walks the tokens in chunks of `chunk_size` rows, upcasts one chunk at a time
to fp32 and keeps only per-token statistics (m, log S, E_p[z], the target logit); the backward
recomputes the softmax chunk by chunk from the saved logits and writes the gradient in the
logits' dtype. The largest temporaries are a few fp32 [chunk_size, V/tp] buffers. Across TP
ranks the per-token statistics are combined with two all_reduces (a MAX of m, then one SUM of a
[3, T] stack), whatever the number of chunks; the backward needs no communication.

Outputs are fp32 (GRPO ratios need them); ignored positions (ignore_mask True, or target ==
ignore_index) give 0 and receive no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# Default chunk sizes are chosen by element count so that one fp32 chunk stays small: on CPU a
# chunk fits in L2/L3 (4 MiB), on GPU it is big enough to keep the kernels busy (128 MiB).
CPU_CHUNK_ELEMENTS = 1 << 20
CUDA_CHUNK_ELEMENTS = 1 << 25


def default_chunk_size(local_vocab: int, device: torch.device, elements: Optional[int] = None) -> int:
    """Rows per chunk so that a [rows, local_vocab] fp32 buffer has about `elements` entries."""
    if elements is None:
        elements = CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CPU_CHUNK_ELEMENTS
    return max(1, elements // max(local_vocab, 1))


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logit columns sit in the (padded) vocabulary, and its TP group."""

    group: Optional[dist.ProcessGroup]  # None means a single rank: no communication
    world_size: int
    start: int  # global index of local column 0
    local_size: int  # columns in the shard, padding included
    valid: int  # leading local columns that belong to the true vocabulary (0..local_size)


def resolve_vocab_shard(local_size: int, vocab_size: Optional[int],
                        tp_group: Optional[dist.ProcessGroup]) -> VocabShard:
    """The TP group is tp_group, else megatron's tensor-model-parallel group when megatron is
    initialised, else none (TP=1: the shard is the whole, possibly padded, vocabulary)."""
    if tp_group is None:
        tp_group = _megatron_tp_group()
    if tp_group is None:
        world_size, rank = 1, 0
    else:
        world_size, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    padded = local_size * world_size
    if vocab_size is None:
        vocab_size = padded
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit the logit shards: {world_size} TP rank(s) x "
            f"{local_size} columns = {padded}. If the logits are TP-sharded, initialise megatron "
            f"(launch.parallel.initialize_model_parallel) or pass tp_group")
    start = rank * local_size
    valid = min(max(vocab_size - start, 0), local_size)
    return VocabShard(tp_group if world_size > 1 else None, world_size, start, local_size, valid)


def _megatron_tp_group() -> Optional[dist.ProcessGroup]:
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


@dataclass
class TokenStats:
    """Per-token statistics over the full vocabulary (after `combine_stats`), all fp32 [N]."""

    max: torch.Tensor  # m
    sum_exp: torch.Tensor  # S = sum exp(z - m)
    weighted: Optional[torch.Tensor]  # W = sum exp(z - m) (z - m); None without entropy
    target_logit: torch.Tensor  # z[target] on the rank that owns the target, 0 elsewhere


def empty_stats(n: int, device: torch.device, with_entropy: bool) -> TokenStats:
    f32 = dict(dtype=torch.float32, device=device)
    return TokenStats(torch.full((n,), float("-inf"), **f32), torch.zeros(n, **f32),
                      torch.zeros(n, **f32) if with_entropy else None, torch.zeros(n, **f32))


def scaled_chunk(logits_chunk: torch.Tensor, shard: VocabShard, temperature: float,
                 buffer: torch.Tensor) -> torch.Tensor:
    """fp32 copy of the chunk's valid columns divided by the temperature, written into buffer."""
    z = buffer[: logits_chunk.shape[0], : shard.valid]
    z.copy_(logits_chunk[:, : shard.valid])
    if temperature != 1.0:
        z.div_(temperature)  # the same op as dense `logits.float() / T`, so bit-identical
    return z


def accumulate_chunk_stats(z: torch.Tensor, rows: slice, local_targets: torch.Tensor,
                           owned: torch.Tensor, stats: TokenStats) -> None:
    """Fills stats[rows] from one fp32 chunk z (its contents are destroyed)."""
    idx = local_targets[rows].clamp(0, z.shape[1] - 1).unsqueeze(1)
    stats.target_logit[rows] = torch.where(owned[rows], z.gather(1, idx).squeeze(1), 0.0)
    m = z.amax(dim=1)
    stats.max[rows] = m
    d = z.sub_(m.unsqueeze(1))
    if stats.weighted is None:
        stats.sum_exp[rows] = d.exp_().sum(dim=1)
        return
    e = torch.exp(d)
    stats.sum_exp[rows] = e.sum(dim=1)
    stats.weighted[rows] = e.mul_(d).sum(dim=1)


def combine_stats(stats: TokenStats, shard: VocabShard) -> TokenStats:
    """Per-shard statistics -> full-vocabulary statistics: all_reduce MAX of m, one SUM of [S, W, z_t]."""
    if shard.group is None:
        return stats
    m = stats.max.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=shard.group)
    has_mass = stats.sum_exp > 0  # a shard of padding only has m = -inf and S = 0
    delta = torch.where(has_mass, stats.max - m, 0.0)
    scale = torch.where(has_mass, delta.exp(), 0.0)
    parts = [stats.sum_exp * scale, stats.target_logit]
    if stats.weighted is not None:
        # sum e^(z-m)(z-m) = e^(m_l-m) (W_l + (m_l - m) S_l)
        parts.append(scale * (stats.weighted + delta * stats.sum_exp))
    stacked = torch.stack(parts)
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=shard.group)
    weighted = stacked[2] if stats.weighted is not None else None
    return TokenStats(m, stacked[0], weighted, stacked[1])


def local_targets_and_ownership(targets: torch.Tensor, ignored: torch.Tensor,
                                shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    local = targets - shard.start
    owned = (~ignored) & (local >= 0) & (local < shard.valid)
    return local, owned


def flatten_ignored(targets: torch.Tensor, ignore_mask: Optional[torch.Tensor], ignore_index: int,
                    vocab_size: int, checked: bool = False) -> torch.Tensor:
    """Bool [N] of ignored positions; raises if a kept position has a target outside the vocab
    (a host read of the check's result; checked=True: the caller checked them, e.g. on the host)."""
    flat = targets.reshape(-1)
    ignored = flat == ignore_index
    if ignore_mask is not None:
        if ignore_mask.shape != targets.shape:
            raise ValueError(f"ignore_mask shape {tuple(ignore_mask.shape)} != targets shape {tuple(targets.shape)}")
        ignored = ignored | ignore_mask.reshape(-1).to(torch.bool)
    if checked:
        return ignored
    bad = (~ignored) & ((flat < 0) | (flat >= vocab_size))
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise ValueError(f"target {int(flat[pos])} at flat position {pos} is outside the vocabulary "
                         f"[0, {vocab_size}) and not ignored (mask it or set it to {ignore_index})")
    return ignored


def outputs_from_stats(stats: TokenStats,
                       ignored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                                       Optional[torch.Tensor]]:
    """(logp, log S + m = lse, entropy, E_p[z]) per token; logp and entropy are 0 where ignored."""
    log_s = stats.sum_exp.log()
    lse = stats.max + log_s
    logp = torch.where(ignored, 0.0, stats.target_logit - lse)
    if stats.weighted is None:
        return logp, lse, None, None
    ratio = stats.weighted / stats.sum_exp
    entropy = torch.where(ignored, 0.0, log_s - ratio)
    return logp, lse, entropy, stats.max + ratio


def chunk_grad(z: torch.Tensor, rows: slice, lse: torch.Tensor, mean_z: Optional[torch.Tensor],
               grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
               local_targets: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(z) for one fp32 chunk z = logits/T (in place; returns z).

    grad_logp / grad_entropy are the upstream grads already divided by T and zeroed where ignored:
        dz = g_lp * (onehot - p) - g_H * p * (z - E_p[z])
    """
    g_lp = grad_logp[rows].unsqueeze(1)
    if grad_entropy is None:
        p = z.sub_(lse[rows].unsqueeze(1)).exp_()
        grad = p.mul_(-g_lp)
    else:
        p = torch.sub(z, lse[rows].unsqueeze(1)).exp_()
        grad = z.sub_(mean_z[rows].unsqueeze(1)).mul_(grad_entropy[rows].unsqueeze(1)).add_(g_lp).mul_(p).neg_()
        del p
    # + g_lp at each owned target column; rows owning none add -0.0 at column 0, which leaves every
    # value as it is, bit for bit (x + -0.0 == x): no host read of which rows own one
    own = owned[rows]
    columns = torch.where(own, local_targets[rows], 0)
    grad[torch.arange(grad.shape[0], device=grad.device), columns] += torch.where(own, grad_logp[rows], -0.0)
    return grad


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignored, temperature, shard, chunk_size, with_entropy):
        x = logits.reshape(-1, shard.local_size)
        n = x.shape[0]
        local, owned = local_targets_and_ownership(targets.reshape(-1), ignored, shard)
        stats = empty_stats(n, x.device, with_entropy)
        buffer = torch.empty(min(chunk_size, max(n, 1)), shard.local_size, dtype=torch.float32, device=x.device)
        if shard.valid > 0:
            for r0 in range(0, n, chunk_size):
                rows = slice(r0, min(r0 + chunk_size, n))
                z = scaled_chunk(x[rows], shard, temperature, buffer)
                accumulate_chunk_stats(z, rows, local, owned, stats)
        del buffer
        stats = combine_stats(stats, shard)
        logp, lse, entropy, mean_z = outputs_from_stats(stats, ignored)
        ctx.save_for_backward(logits, local, owned, ignored, lse, mean_z)
        ctx.meta = (temperature, shard, chunk_size)
        shape = targets.shape
        if with_entropy:
            return logp.view(shape), entropy.view(shape)
        return logp.view(shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        logits, local, owned, ignored, lse, mean_z = ctx.saved_tensors
        temperature, shard, chunk_size = ctx.meta
        g_lp, g_h = _prepare_upstream(grad_logp, grad_entropy, ignored, temperature, lse)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gx = grad.view(-1, shard.local_size)
        x = logits.reshape(-1, shard.local_size)
        n = x.shape[0]
        if shard.valid < shard.local_size:
            gx[:, shard.valid:] = 0  # padded columns carry no probability and no gradient
        if shard.valid > 0:
            buffer = torch.empty(min(chunk_size, max(n, 1)), shard.local_size, dtype=torch.float32, device=x.device)
            for r0 in range(0, n, chunk_size):
                rows = slice(r0, min(r0 + chunk_size, n))
                z = scaled_chunk(x[rows], shard, temperature, buffer)
                gx[rows, : shard.valid] = chunk_grad(z, rows, lse, mean_z, g_lp, g_h, local, owned)
        return grad, None, None, None, None, None, None


def _prepare_upstream(grad_logp, grad_entropy, ignored, temperature, like):
    """Upstream grads flattened, fp32, zeroed at ignored positions and divided by T (dz/dlogits = 1/T)."""
    def prep(g):
        if g is None:
            return None
        g = g.reshape(-1).to(torch.float32)
        return torch.where(ignored, 0.0, g) / temperature

    g_lp = prep(grad_logp)
    if g_lp is None:
        g_lp = torch.zeros_like(like)
    return g_lp, prep(grad_entropy)


def _check_args(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} + [V/tp]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _run(logits, targets, temperature, vocab_size, ignore_mask, ignore_index, tp_group, chunk_size,
         with_entropy, checked=False):
    _check_args(logits, targets, temperature)
    shard = resolve_vocab_shard(logits.shape[-1], vocab_size, tp_group)
    ignored = flatten_ignored(targets, ignore_mask, ignore_index, shard.local_size * shard.world_size
                              if vocab_size is None else vocab_size, checked)
    if chunk_size is None:
        chunk_size = default_chunk_size(shard.local_size, logits.device)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _VocabParallelLogProbs.apply(logits, targets, ignored, float(temperature), shard, int(chunk_size),
                                        with_entropy)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                            vocab_size: Optional[int] = None, ignore_mask: Optional[torch.Tensor] = None,
                            ignore_index: int = -100, tp_group: Optional[dist.ProcessGroup] = None,
                            chunk_size: Optional[int] = None) -> torch.Tensor:
    """log softmax(logits / temperature)[target] over the TP-sharded vocabulary, fp32, shape of targets.

    logits: [..., V/tp] (bf16/fp16/fp32) this rank's shard; targets: [...] global token ids.
    vocab_size: the true vocabulary (columns >= it are padding); default: all columns are real.
    ignore_mask: bool [...] True where the position is ignored (as is target == ignore_index).
    tp_group: default megatron's tensor-model-parallel group, or none if megatron is not initialised.
    chunk_size: token rows per chunk; default keeps one fp32 chunk at ~4 MiB (CPU) / 128 MiB (GPU).
    """
    return _run(logits, targets, temperature, vocab_size, ignore_mask, ignore_index, tp_group, chunk_size, False)


def vocab_parallel_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                                        vocab_size: Optional[int] = None, ignore_mask: Optional[torch.Tensor] = None,
                                        ignore_index: int = -100, tp_group: Optional[dist.ProcessGroup] = None,
                                        chunk_size: Optional[int] = None,
                                        checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of softmax(logits / temperature); both differentiable. Same arguments as
    `vocab_parallel_logprobs`; checked=True: the targets were checked by the caller (the trainer
    checks a mini-batch's on the host, check_targets_on_host), so no host read here."""
    return _run(logits, targets, temperature, vocab_size, ignore_mask, ignore_index, tp_group, chunk_size, True,
                checked)
