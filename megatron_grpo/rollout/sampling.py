"""One decoding step's token choice for a batch of rows with per-row sampling settings.

Log-probs are log_softmax(logits / T) of the chosen token, computed in fp32 BEFORE top-p / top-k /
min-p filtering (SGLang's default); greedy rows (T = 0) report log_softmax(logits). Rows that
sample from a truncated distribution also get the behaviour log-prob (of the truncated,
renormalised distribution the token was drawn from) and, when asked, the support's token ids.
The truncation rules are SGLang's (`top_k_top_p_min_p_sampling_from_probs_torch`): in descending
probability order, drop rank >= top_k, drop where the mass BEFORE the token exceeds top_p (mass
of the full distribution, not renormalised after top-k), drop below min_p x the largest
probability. Sampling is inverse-CDF with one uniform draw per row from that row's own
torch.Generator, so a row's samples do not depend on which other rows share its batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchSamplingState:
    """Per-row sampling settings as tensors on the logits' device (rows = batch positions)."""

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows (never divided by)
    top_p: torch.Tensor        # [B] float32
    top_k: torch.Tensor        # [B] int64; vocab size when off
    min_p: torch.Tensor        # [B] float32; 0 when off
    greedy: torch.Tensor       # [B] bool
    generators: list[torch.Generator]  # CPU generators, one per row

    def select(self, index: list[int]) -> "BatchSamplingState":
        idx = torch.tensor(index, device=self.temperature.device)
        return BatchSamplingState(self.temperature[idx], self.top_p[idx], self.top_k[idx], self.min_p[idx],
                                  self.greedy[idx], [self.generators[i] for i in index])


@dataclass
class SampledTokens:
    """One decoding step's choice for every row of the batch."""

    tokens: torch.Tensor      # [B] int64
    logprobs: torch.Tensor    # [B] float32, full distribution (see the module docstring)
    behaviour: torch.Tensor   # [B] float32, the truncated distribution's (= logprobs where not truncated)
    supports: list[list[int] | None]  # per row: the support's ids (descending probability) where truncated


_BIG = 2**62


def make_state(temperatures: list[float], top_ps: list[float], top_ks: list[int], seeds: list[int],
               device: torch.device, min_ps: list[float] | None = None) -> BatchSamplingState:
    generators = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
    return BatchSamplingState(
        temperature=torch.tensor(temperatures, dtype=torch.float32, device=device),
        top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
        top_k=torch.tensor([k if k > 0 else _BIG for k in top_ks], dtype=torch.int64, device=device),
        min_p=torch.tensor(min_ps if min_ps is not None else [0.0] * len(temperatures), dtype=torch.float32,
                           device=device),
        greedy=torch.tensor([t == 0.0 for t in temperatures], dtype=torch.bool, device=device),
        generators=generators,
    )


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i]: never a zero-probability entry."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform[:, None] * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def truncation_drop(sorted_probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Bool [B, V]: which entries of the descending-sorted probabilities truncation removes
    (SGLang's rules, see the module docstring; min_p 0 removes nothing)."""
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    rank = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    drop = (mass_before > top_p[:, None]) | (rank[None, :] >= top_k[:, None])
    return drop | (sorted_probs < sorted_probs[:, :1] * min_p[:, None])


def sample_tokens(logits: torch.Tensor, state: BatchSamplingState, want_support: list[bool] | None = None
                  ) -> SampledTokens:
    """The next token of every row of logits [B, V]; `want_support[i]`: row i reports its support."""
    logits = logits.float()
    batch = logits.shape[0]
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    supports: list[list[int] | None] = [None] * batch

    greedy_idx = state.greedy.nonzero().squeeze(1)
    if greedy_idx.numel():
        rows = logits[greedy_idx]
        tok = rows.argmax(-1)
        tokens[greedy_idx] = tok
        logprobs[greedy_idx] = torch.log_softmax(rows, -1).gather(1, tok[:, None]).squeeze(1)
    behaviour = logprobs.clone()

    sample_idx = (~state.greedy).nonzero().squeeze(1)
    if sample_idx.numel():
        idx_list = sample_idx.tolist()
        logp = torch.log_softmax(logits[sample_idx] / state.temperature[sample_idx, None], -1)
        probs = logp.exp()
        uniform = torch.stack([torch.rand((), generator=state.generators[i]) for i in idx_list]).to(logits.device)
        top_p, top_k, min_p = state.top_p[sample_idx], state.top_k[sample_idx], state.min_p[sample_idx]
        truncated = (top_p < 1.0) | (top_k < probs.shape[-1]) | (min_p > 0.0)
        if bool(truncated.any()):
            sorted_probs, sorted_ids = probs.sort(-1, descending=True)
            keep = ~truncation_drop(sorted_probs, top_p, top_k, min_p)
            pick = _inverse_cdf(sorted_probs * keep, uniform)
            tok = sorted_ids.gather(1, pick[:, None]).squeeze(1)
            # behaviour: log p(y) - log(sum over the support of p), from the same fp32 log-probs
            sorted_logp = logp.gather(1, sorted_ids).masked_fill(~keep, float("-inf"))
            behaviour[sample_idx] = torch.where(
                truncated, logp.gather(1, tok[:, None]).squeeze(1) - sorted_logp.logsumexp(-1),
                logp.gather(1, tok[:, None]).squeeze(1))
            # every rule keeps a prefix of the descending order: one copy of the widest prefix
            counts = keep.sum(-1).tolist()
            prefix = sorted_ids[:, :max(counts)].tolist()
            for row, batch_row in enumerate(idx_list):
                if truncated[row] and (want_support is None or want_support[batch_row]):
                    supports[batch_row] = prefix[row][:counts[row]]
        else:
            tok = _inverse_cdf(probs, uniform)
            behaviour[sample_idx] = logp.gather(1, tok[:, None]).squeeze(1)
        tokens[sample_idx] = tok
        logprobs[sample_idx] = logp.gather(1, tok[:, None]).squeeze(1)
    return SampledTokens(tokens, logprobs, behaviour, supports)
