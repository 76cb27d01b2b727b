"""Log-probs and entropy of the targets under each token's truncated sampling distribution, from
tensor-parallel logit shards (sampling-support replay).

A rollout engine that samples with top-k / top-p / min-p draws token y_t from the renormalised
distribution over a support set S_t (y_t in S_t). The trainer replays that distribution: with
z = logits / temperature (fp32),

    logp_t   = z[y] - lse_S(z),          lse_S(z) = m + log S,   S = sum_{j in S_t} exp(z_j - m)
    entropy  = -sum_{j in S_t} p_j log p_j = log S - W / S,      W = sum_{j in S_t} exp(z_j - m) (z_j - m)
    d logp / dz_j    = 1[j = y] - p_j                       for j in S_t, 0 elsewhere
    d entropy / dz_j = -p_j (z_j - E_p[z]),  E_p[z] = m + W / S,   for j in S_t, 0 elsewhere

`support` is [..., K] global token ids padded with -1. Each TP rank gathers only the support ids
inside its shard's true-vocabulary columns, so its statistics are the same m / S / W / target logit
as ops.vocab_parallel computes over a whole shard, restricted to the support; a rank (or row)
holding none of a row's ids reports m = -inf, S = W = 0, which `combine_stats` treats as a shard
without mass. Across TP the statistics are combined exactly as there: one MAX and one SUM
all_reduce, whatever the number of chunks; the backward needs no communication and scatters the
gradient into the support columns of a zero tensor in the logits' dtype.

Memory: the tokens are walked in chunks of `chunk_size` rows; a chunk holds the int64 gather index
(8 B), two bool masks (2 B) and at most three fp32 temporaries (12 B) per (row, support slot):
about 22 B x rows x K at the peak of forward or backward (the support check before the forward
needs about 12 B for int32 ids). The default chunk keeps one fp32 [rows, K] buffer at ~4 MiB (CPU)
/ 128 MiB (GPU), i.e. 256 / 8192 rows for K = 4096, so for T = 4096 tokens and K = top_k = 4096
(SGLang's default --sampling-mask-max-tokens) the whole batch is one GPU chunk of 4096 x 4096:
~350 MiB of temporaries (~22 MiB per 256-row chunk on CPU), plus the gradient (the logits' shape
and dtype, as for the full-vocabulary op) and [T]-sized statistics. No [rows, V/tp] chunk is ever
upcast to fp32, so when K << V/tp this path is cheaper than ops.vocab_parallel in both memory and
arithmetic (it touches T x K logits, not T x V/tp).

Determinism: every row's reductions are a max (exact) and pairwise sums made of elementwise adds
(`row_sum`), so a token's log-prob, entropy and gradient have the same bits whatever the chunk
size, the other rows of the batch, or the batch's K (the -1 padding after a row's ids). Across TP
ranks the result is as batch-invariant as the SUM all_reduce: with two ranks a + b = b + a
exactly; with more, a ring's summation order may depend on the tensor's length.

Outputs are fp32; ignored positions (ignore_mask True, or target == ignore_index) give 0 and
receive no gradient, whatever their support holds. At every kept position the support must be
non-empty, hold the target, hold only ids in [0, vocab_size) besides the -1 padding and repeat
none (a repeat would count its probability twice); otherwise a one-line ValueError names the flat
position and the token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.ops.vocab_parallel import (
    TokenStats, VocabShard, _check_args, _prepare_upstream, combine_stats, default_chunk_size, empty_stats,
    flatten_ignored, outputs_from_stats, resolve_vocab_shard)

PAD_ID = -1


@dataclass(frozen=True)
class SupportChunk:
    """Where one chunk's support entries sit in this rank's logit shard."""

    index: torch.Tensor  # int64 [c, K]: local column of each entry; 0 where `member` is False
    member: torch.Tensor  # bool [c, K]: an id in this shard's true-vocabulary columns, at a kept row
    is_target: torch.Tensor  # bool [c, K]: the member entry that is the row's target (at most one)


def row_chunks(n: int, chunk_size: int) -> list[slice]:
    return [slice(r0, min(r0 + chunk_size, n)) for r0 in range(0, n, chunk_size)]


def support_chunk(support_rows: torch.Tensor, target_rows: torch.Tensor, kept_rows: torch.Tensor,
                  shard: VocabShard) -> SupportChunk:
    # in the ids' own dtype (the trainer's are int32) until the one int64 copy gather needs
    local = support_rows - shard.start  # the -1 padding lands below 0 on every rank
    member = (local >= 0) & (local < shard.valid) & kept_rows.unsqueeze(1)
    is_target = member & (support_rows == target_rows.to(support_rows.dtype).unsqueeze(1))
    return SupportChunk(local.masked_fill_(~member, 0).long(), member, is_target)


def support_logits(logits_rows: torch.Tensor, chunk: SupportChunk, temperature: float) -> torch.Tensor:
    """fp32 [c, K] z = logits / T at the chunk's support entries (finite garbage at non-members)."""
    z = logits_rows.gather(1, chunk.index).float()
    if temperature != 1.0:
        z.div_(temperature)  # the same op as ops.vocab_parallel's scaled_chunk, so the same bits
    return z


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 of a [c, K] tensor (K >= 1) by pairwise folding, as if K were padded with
    zeros to a power of two. Only elementwise adds, paired by position in the row: a row's sum has
    the same bits whatever the other rows and however much -1 padding the batch's K adds after its
    ids (torch's reduction kernels choose their order from the whole tensor's shape)."""
    width = x.shape[1]
    while width > 1:
        half = 1 << ((width - 1).bit_length() - 1)  # the largest power of two below width
        folded = x[:, :half].clone()
        folded[:, : width - half] += x[:, half:width]
        x, width = folded, half
    return x[:, 0]


def accumulate_support_stats(z: torch.Tensor, chunk: SupportChunk, rows: slice, stats: TokenStats) -> None:
    """Fills stats[rows] from one chunk of support logits z (destroyed). A row with no member keeps
    m = -inf, S = W = 0, as combine_stats expects of a shard without mass."""
    outside = ~chunk.member
    masked = z.masked_fill(outside, float("-inf"))
    m = masked.amax(dim=1)
    stats.max[rows] = m
    # the target's logit, picked exactly: a max over its one member entry (-inf on other ranks)
    target = masked.masked_fill_(~chunk.is_target, float("-inf")).amax(dim=1)
    stats.target_logit[rows] = torch.where(chunk.is_target.any(dim=1), target, 0.0)
    del masked
    shift = torch.where(torch.isfinite(m), m, 0.0)  # -inf - -inf would be NaN
    d = z.sub_(shift.unsqueeze(1)).masked_fill_(outside, 0.0)
    e = d.exp().masked_fill_(outside, 0.0)  # then e * d is 0, never 0 * -inf, at non-members
    stats.sum_exp[rows] = row_sum(e)
    if stats.weighted is not None:
        stats.weighted[rows] = row_sum(e.mul_(d))


def support_outputs(stats: TokenStats, shard: VocabShard,
                    ignored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                                    Optional[torch.Tensor]]:
    """(logp, lse, entropy, E_p[z]) after the TP combine. An ignored row may have an empty support
    (lse = -inf, E_p[z] = NaN): both are set to 0 there so the backward never computes with them."""
    logp, lse, entropy, mean_z = outputs_from_stats(combine_stats(stats, shard), ignored)
    lse = torch.where(ignored, 0.0, lse)
    if mean_z is not None:
        mean_z = torch.where(ignored, 0.0, mean_z)
    return logp, lse, entropy, mean_z


def support_grad(z: torch.Tensor, chunk: SupportChunk, rows: slice, lse: torch.Tensor,
                 mean_z: Optional[torch.Tensor], grad_logp: torch.Tensor,
                 grad_entropy: Optional[torch.Tensor]) -> torch.Tensor:
    """d(loss)/dz at the chunk's support entries, fp32 [c, K] (in z's storage), 0 at non-members:
        dz_j = g_lp (1[j = y] - p_j) - g_H p_j (z_j - E_p[z]),   p_j = exp(z_j - lse)
    grad_logp / grad_entropy: upstream grads already divided by T and zeroed where ignored."""
    p = torch.sub(z, lse[rows].unsqueeze(1)).exp_().masked_fill_(~chunk.member, 0.0)
    g_lp = grad_logp[rows].unsqueeze(1)
    if grad_entropy is None:
        grad = p.mul_(g_lp).neg_()
    else:
        grad = z.sub_(mean_z[rows].unsqueeze(1)).mul_(grad_entropy[rows].unsqueeze(1)).add_(g_lp).mul_(p).neg_()
    return grad.add_(torch.where(chunk.is_target, g_lp, 0.0))


def scatter_support_grad(out_rows: torch.Tensor, chunk: SupportChunk, grad: torch.Tensor) -> None:
    """Adds the [c, K] support gradient into out_rows [c, V/tp] (zeros, in the logits' dtype). An
    add, not a scatter: the non-members all point at column 0 and carry exact zeros. In slices of
    the full-vocabulary op's chunk rows: torch's CPU scatter_add_ of bf16 works on an fp32 copy of
    its whole destination ([c, V/tp] x 4 bytes: 2.3 GiB measured for 4096 x 151,936 in one piece)."""
    step = default_chunk_size(out_rows.shape[1], out_rows.device)
    for rows in row_chunks(out_rows.shape[0], step):
        out_rows[rows].scatter_add_(1, chunk.index[rows], grad[rows].to(out_rows.dtype))


def check_support_shape(support: torch.Tensor, targets: torch.Tensor) -> None:
    if support.dim() != targets.dim() + 1 or support.shape[:-1] != targets.shape:
        raise ValueError(f"support {tuple(support.shape)} must be targets {tuple(targets.shape)} + [K]")
    if support.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"support must hold int32 or int64 token ids, got {support.dtype}")


def _bad_rows(ids: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [c]: the support of the row is empty, lacks the target, holds an id outside the
    vocabulary (other than the padding) or repeats one."""
    outside = ((ids < PAD_ID) | (ids >= vocab_size)).any(dim=1)
    missing = ~(ids == targets.unsqueeze(1)).any(dim=1)  # an empty support lacks its target too
    ordered = ids.sort(dim=1).values
    repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != PAD_ID)).any(dim=1)
    return outside | missing | repeated


def _describe_bad_row(position: int, ids: list[int], target: int, vocab_size: int) -> str:
    real = [i for i in ids if i != PAD_ID]
    if not real:
        return f"the sampling support of flat position {position} (target {target}) is empty"
    outside = [i for i in real if not 0 <= i < vocab_size]
    if outside:
        return (f"the sampling support of flat position {position} holds token {outside[0]}, outside the "
                f"vocabulary [0, {vocab_size}) (pad supports with {PAD_ID})")
    if target not in real:
        return (f"target {target} at flat position {position} is not in its sampling support "
                f"({len(real)} ids); mask the position or send the support it was sampled from")
    seen: set[int] = set()
    for token in real:
        if token in seen:
            return f"the sampling support of flat position {position} lists token {token} twice"
        seen.add(token)
    return f"the sampling support of flat position {position} (target {target}) is invalid"  # not reached


def check_supports(targets: torch.Tensor, support: torch.Tensor, ignored: torch.Tensor, vocab_size: int,
                   chunk_size: int) -> None:
    """Raises a one-line ValueError at the first kept position with a bad support (`_bad_rows`).
    Chunked like the op (the sort copies its rows); one host sync for the whole batch. Every TP
    rank holds the same targets and supports, so all of them raise, before any collective."""
    flat = targets.reshape(-1)
    n = flat.shape[0]
    ids = support.reshape(n, support.shape[-1])
    bad = torch.zeros(n, dtype=torch.bool, device=flat.device)
    for rows in row_chunks(n, chunk_size):
        bad[rows] = _bad_rows(ids[rows], flat[rows].to(ids.dtype), vocab_size) & ~ignored[rows]
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise ValueError(_describe_bad_row(position, ids[position].tolist(), int(flat[position]), vocab_size))


def prepare_support(targets: torch.Tensor, support: torch.Tensor, ignore_mask: Optional[torch.Tensor],
                    ignore_index: int, vocab_size: Optional[int], shard: VocabShard,
                    chunk_size: int, checked: bool = False) -> torch.Tensor:
    """Checks the arguments shared by the logits and fused-head entry points; returns ignored [N].
    checked=True: the caller checked the targets and supports' values (no host read here)."""
    check_support_shape(support, targets)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if vocab_size is None:
        vocab_size = shard.local_size * shard.world_size
    ignored = flatten_ignored(targets, ignore_mask, ignore_index, vocab_size, checked)
    if not checked:
        check_supports(targets, support, ignored, vocab_size, chunk_size)
    return ignored


@dataclass(frozen=True)
class SupportBatch:
    """The flattened per-token inputs that every chunk reads, and one chunk's forward / backward.
    The chunk steps are methods, not loop bodies, so a chunk's temporaries are freed before the
    next chunk allocates its own."""

    support: torch.Tensor  # [N, K] global ids, -1 padding
    targets: torch.Tensor  # [N]
    ignored: torch.Tensor  # bool [N]
    shard: VocabShard
    temperature: float
    chunk_size: int

    @staticmethod
    def of(targets: torch.Tensor, support: torch.Tensor, ignored: torch.Tensor, shard: VocabShard,
           temperature: float, chunk_size: int) -> SupportBatch:
        flat = targets.reshape(-1)
        return SupportBatch(support.reshape(flat.shape[0], support.shape[-1]), flat, ignored, shard, temperature,
                            chunk_size)

    def chunks(self) -> list[slice]:
        """No chunk when this shard holds no true vocabulary or the supports are 0-wide (then
        every row is ignored): the statistics stay those of a shard without mass."""
        if self.support.shape[1] == 0 or self.shard.valid == 0:
            return []
        return row_chunks(self.support.shape[0], self.chunk_size)

    def _chunk(self, rows: slice) -> SupportChunk:
        return support_chunk(self.support[rows], self.targets[rows], ~self.ignored[rows], self.shard)

    def accumulate(self, logits_rows: torch.Tensor, rows: slice, stats: TokenStats) -> None:
        """Forward of one chunk: stats[rows] from this rank's logits of those rows [c, V/tp]."""
        chunk = self._chunk(rows)
        accumulate_support_stats(support_logits(logits_rows, chunk, self.temperature), chunk, rows, stats)

    def add_grad(self, logits_rows: torch.Tensor, rows: slice, lse: torch.Tensor, mean_z: Optional[torch.Tensor],
                 grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor], out_rows: torch.Tensor) -> None:
        """Backward of one chunk: adds d loss / d logits into out_rows [c, V/tp] (zeros, in the
        logits' dtype, or the hidden dtype for the fused head)."""
        chunk = self._chunk(rows)
        z = support_logits(logits_rows, chunk, self.temperature)
        scatter_support_grad(out_rows, chunk, support_grad(z, chunk, rows, lse, mean_z, grad_logp, grad_entropy))


def support_forward(batch: "SupportBatch", logits_of_rows, n: int, device: torch.device,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                                 Optional[torch.Tensor]]:
    """(logp, lse, entropy, E_p[z]) of n token rows; logits_of_rows(rows) gives a chunk's logits
    (a slice of the shard, or the fused head's matmul)."""
    stats = empty_stats(n, device, with_entropy)
    for rows in batch.chunks():
        batch.accumulate(logits_of_rows(rows), rows, stats)
    return support_outputs(stats, batch.shard, batch.ignored)


def shaped(logp: torch.Tensor, entropy: Optional[torch.Tensor], shape: torch.Size, with_entropy: bool):
    """The autograd Functions' outputs in the targets' shape."""
    if with_entropy:
        return logp.view(shape), entropy.view(shape)
    return logp.view(shape)


class _SupportLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, support, ignored, temperature, shard, chunk_size, with_entropy):
        x = logits.reshape(-1, shard.local_size)
        batch = SupportBatch.of(targets, support, ignored, shard, temperature, chunk_size)
        logp, lse, entropy, mean_z = support_forward(batch, lambda rows: x[rows], x.shape[0], x.device, with_entropy)
        ctx.save_for_backward(logits, batch.support, batch.targets, ignored, lse, mean_z)
        ctx.meta = (shard, temperature, chunk_size)  # SupportBatch's order
        return shaped(logp, entropy, targets.shape, with_entropy)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        logits, support, targets, ignored, lse, mean_z = ctx.saved_tensors
        batch = SupportBatch(support, targets, ignored, *ctx.meta)
        g_lp, g_h = _prepare_upstream(grad_logp, grad_entropy, ignored, batch.temperature, lse)
        grad = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        gx = grad.view(-1, batch.shard.local_size)
        x = logits.reshape(-1, batch.shard.local_size)
        for rows in batch.chunks():
            batch.add_grad(x[rows], rows, lse, mean_z, g_lp, g_h, gx[rows])
        return grad, None, None, None, None, None, None, None


def _run(logits, targets, support, temperature, vocab_size, ignore_mask, ignore_index, tp_group, chunk_size,
         with_entropy, checked=False):
    _check_args(logits, targets, temperature)
    shard = resolve_vocab_shard(logits.shape[-1], vocab_size, tp_group)
    if chunk_size is None:
        chunk_size = default_chunk_size(max(support.shape[-1] if support.dim() else 1, 1), logits.device)
    ignored = prepare_support(targets, support, ignore_mask, ignore_index, vocab_size, shard, int(chunk_size),
                              checked)
    return _SupportLogProbs.apply(logits, targets, support, ignored, float(temperature), shard, int(chunk_size),
                                  with_entropy)


def vocab_parallel_support_logprobs(logits: torch.Tensor, targets: torch.Tensor, support: torch.Tensor, *,
                                    temperature: float = 1.0, vocab_size: Optional[int] = None,
                                    ignore_mask: Optional[torch.Tensor] = None, ignore_index: int = -100,
                                    tp_group: Optional[dist.ProcessGroup] = None,
                                    chunk_size: Optional[int] = None) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature) renormalised over each token's support,
    fp32, shape of targets.

    logits: [..., V/tp] this rank's shard; targets: [...] global token ids; support: integer
    [..., K] global token ids, padded with -1 (K: the largest support of the batch).
    chunk_size: token rows per chunk; default keeps one fp32 [rows, K] buffer at ~4 MiB (CPU) /
    128 MiB (GPU). Other arguments as ops.vocab_parallel.vocab_parallel_logprobs."""
    return _run(logits, targets, support, temperature, vocab_size, ignore_mask, ignore_index, tp_group,
                chunk_size, False)


def vocab_parallel_support_logprobs_and_entropy(
        logits: torch.Tensor, targets: torch.Tensor, support: torch.Tensor, *, temperature: float = 1.0,
        vocab_size: Optional[int] = None, ignore_mask: Optional[torch.Tensor] = None, ignore_index: int = -100,
        tp_group: Optional[dist.ProcessGroup] = None, chunk_size: Optional[int] = None,
        checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of the truncated distribution; both differentiable. Same arguments as
    `vocab_parallel_support_logprobs`; checked as in ops.vocab_parallel.vocab_parallel_logprobs_and_entropy."""
    return _run(logits, targets, support, temperature, vocab_size, ignore_mask, ignore_index, tp_group,
                chunk_size, True, checked)
