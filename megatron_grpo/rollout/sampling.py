"""One decoding step's token choice for a batch of rows with per-row sampling settings.

Log-probs are log_softmax(logits / T) of the chosen token, computed in fp32 BEFORE top-p / top-k
filtering (SGLang's default and the trainer's definition); greedy rows (T = 0) report
log_softmax(logits). Sampling is inverse-CDF with one uniform draw per row from that row's own
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
    greedy: torch.Tensor       # [B] bool
    generators: list[torch.Generator]  # CPU generators, one per row

    def select(self, index: list[int]) -> "BatchSamplingState":
        idx = torch.tensor(index, device=self.temperature.device)
        return BatchSamplingState(self.temperature[idx], self.top_p[idx], self.top_k[idx], self.greedy[idx],
                                  [self.generators[i] for i in index])


_BIG = 2**62


def make_state(temperatures: list[float], top_ps: list[float], top_ks: list[int], seeds: list[int],
               device: torch.device) -> BatchSamplingState:
    generators = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
    return BatchSamplingState(
        temperature=torch.tensor(temperatures, dtype=torch.float32, device=device),
        top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
        top_k=torch.tensor([k if k > 0 else _BIG for k in top_ks], dtype=torch.int64, device=device),
        greedy=torch.tensor([t == 0.0 for t in temperatures], dtype=torch.bool, device=device),
        generators=generators,
    )


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i]: never a zero-probability entry."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform[:, None] * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def sample_tokens(logits: torch.Tensor, state: BatchSamplingState) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (token ids [B] int64, log-probs [B] float32) for logits [B, V]."""
    logits = logits.float()
    batch = logits.shape[0]
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)

    greedy_idx = state.greedy.nonzero().squeeze(1)
    if greedy_idx.numel():
        rows = logits[greedy_idx]
        tok = rows.argmax(-1)
        tokens[greedy_idx] = tok
        logprobs[greedy_idx] = torch.log_softmax(rows, -1).gather(1, tok[:, None]).squeeze(1)

    sample_idx = (~state.greedy).nonzero().squeeze(1)
    if sample_idx.numel():
        idx_list = sample_idx.tolist()
        logp = torch.log_softmax(logits[sample_idx] / state.temperature[sample_idx, None], -1)
        probs = logp.exp()
        uniform = torch.stack([torch.rand((), generator=state.generators[i]) for i in idx_list]).to(logits.device)
        top_p, top_k = state.top_p[sample_idx], state.top_k[sample_idx]
        if bool(((top_p < 1.0) | (top_k < probs.shape[-1])).any()):
            sorted_probs, sorted_ids = probs.sort(-1, descending=True)
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            rank = torch.arange(probs.shape[-1], device=probs.device)
            drop = (mass_before > top_p[:, None]) | (rank[None, :] >= top_k[:, None])
            pick = _inverse_cdf(sorted_probs.masked_fill(drop, 0.0), uniform)
            tok = sorted_ids.gather(1, pick[:, None]).squeeze(1)
        else:
            tok = _inverse_cdf(probs, uniform)
        tokens[sample_idx] = tok
        logprobs[sample_idx] = logp.gather(1, tok[:, None]).squeeze(1)
    return tokens, logprobs
