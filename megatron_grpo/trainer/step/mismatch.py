"""Engine-vs-trainer mismatch health, per generated token: how far the trainer's log-probs (at the
weights that sampled the batch) are from the probabilities the tokens were really sampled with.

For every trained response token, delta = trainer log-prob - behaviour log-prob, and the
importance ratio exp(delta). A mean hides what matters (a few tokens far off, or a bias in one
part of the response), so each step reports the distribution:

    mismatch/abs_logp_diff_{p50,p90,p99,max}   |delta|
    mismatch/ratio_{p01,p50,p99,min,max}       exp(delta)
    mismatch/ratio_outside_frac                fraction of tokens with exp(delta) outside [0.9, 1.1]
    mismatch/tokens

and, per split, `_p50`, `_p99` of |delta|, the outside fraction and the token count:
    mismatch/position_{early,middle,late}/...   which third of its response the token is in
    mismatch/engine_<host:port>/...             which engine sampled it (with more than one engine)
    mismatch/staleness_<s>/...                  how many versions behind (asynchronous rollouts)

"Behaviour" is the truncated distribution's log-prob whenever sampling was truncated (top-p /
top-k / min-p) and the engine reported it, so with sampling replay off the figures show the bias
that replay removes. Quantiles come from histograms (20 log-spaced bins per decade, 1e-9 to 1e2:
within 12% of the exact value), so ranks exchange fixed-size counts, not tokens; max and min
are exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlparse

import torch

# |delta| bins: [0, 1e-9), then 20 per decade up to 1e2, then one overflow bin.
_EDGES = torch.cat([torch.zeros(1, dtype=torch.float64), torch.logspace(-9, 2, 221, dtype=torch.float64)])
RATIO_BAND = (math.log(0.9), math.log(1.1))  # delta outside it: ratio outside [0.9, 1.1]
POSITIONS = ("early", "middle", "late")


@dataclass
class DeltaStats:
    """Additive statistics of a set of deltas: histograms of |delta| and of signed delta."""

    abs_hist: torch.Tensor = field(default_factory=lambda: torch.zeros(len(_EDGES), dtype=torch.float64))
    # signed: bins of -delta for delta < 0 and of delta for delta >= 0, side by side
    neg_hist: torch.Tensor = field(default_factory=lambda: torch.zeros(len(_EDGES), dtype=torch.float64))
    count: float = 0.0
    outside: float = 0.0
    max_abs: float = 0.0
    min_delta: float = math.inf
    max_delta: float = -math.inf

    def add(self, delta: torch.Tensor) -> None:
        delta = delta.detach().reshape(-1).to(torch.float64).cpu()
        if delta.numel() == 0:
            return
        magnitude = delta.abs()
        bins = torch.bucketize(magnitude, _EDGES[1:], right=True)
        self.abs_hist += torch.bincount(bins, minlength=len(_EDGES)).to(torch.float64)
        negative = delta < 0
        self.neg_hist += torch.bincount(bins[negative], minlength=len(_EDGES)).to(torch.float64)
        self.count += delta.numel()
        self.outside += float(((delta < RATIO_BAND[0]) | (delta > RATIO_BAND[1])).sum())
        self.max_abs = max(self.max_abs, float(magnitude.max()))
        self.min_delta = min(self.min_delta, float(delta.min()))
        self.max_delta = max(self.max_delta, float(delta.max()))

    def merge(self, other: "DeltaStats") -> None:
        self.abs_hist += other.abs_hist
        self.neg_hist += other.neg_hist
        self.count += other.count
        self.outside += other.outside
        self.max_abs = max(self.max_abs, other.max_abs)
        self.min_delta = min(self.min_delta, other.min_delta)
        self.max_delta = max(self.max_delta, other.max_delta)

    def abs_quantile(self, q: float) -> float:
        """The upper edge of the bin holding the q-quantile of |delta| (capped by the exact max)."""
        return min(_upper_edge(self.abs_hist, q * self.count), self.max_abs)

    def delta_quantile(self, q: float) -> float:
        """The q-quantile of signed delta, to a bin's resolution: negative bins from the largest
        magnitude down, then the non-negative ones up (clipped to the exact min and max)."""
        pos_hist = self.abs_hist - self.neg_hist
        rank = q * self.count
        negatives = float(self.neg_hist.sum())
        if rank < negatives:  # among the negatives, counted from the most negative
            value = -_lower_edge_from_top(self.neg_hist, rank)
        else:
            value = _upper_edge(pos_hist, rank - negatives)
        return min(max(value, self.min_delta), self.max_delta)

    def summary(self, prefix: str, full: bool) -> dict[str, float]:
        if self.count == 0:
            return {}
        out = {f"{prefix}abs_logp_diff_p50": self.abs_quantile(0.5),
               f"{prefix}abs_logp_diff_p99": self.abs_quantile(0.99),
               f"{prefix}ratio_outside_frac": self.outside / self.count, f"{prefix}tokens": self.count}
        if full:
            out.update({f"{prefix}abs_logp_diff_p90": self.abs_quantile(0.9),
                        f"{prefix}abs_logp_diff_max": self.max_abs,
                        f"{prefix}ratio_p01": math.exp(self.delta_quantile(0.01)),
                        f"{prefix}ratio_p50": math.exp(self.delta_quantile(0.5)),
                        f"{prefix}ratio_p99": math.exp(self.delta_quantile(0.99)),
                        f"{prefix}ratio_min": math.exp(self.min_delta), f"{prefix}ratio_max": math.exp(self.max_delta)})
        return out


def _upper_edge(hist: torch.Tensor, rank: float) -> float:
    """Upper edge of the first bin whose cumulative count exceeds `rank`."""
    cumulative = hist.cumsum(0)
    index = int(torch.searchsorted(cumulative, torch.tensor([rank], dtype=torch.float64), right=True)[0])
    index = min(index, len(_EDGES) - 1)
    return float(_EDGES[index + 1]) if index + 1 < len(_EDGES) else math.inf


def _lower_edge_from_top(hist: torch.Tensor, rank: float) -> float:
    """Counting from the largest bin down: the upper edge of the bin holding the rank-th value
    (the magnitude of a negative delta, whose most negative values come first)."""
    flipped = hist.flip(0).cumsum(0)
    index = int(torch.searchsorted(flipped, torch.tensor([rank], dtype=torch.float64), right=True)[0])
    bin_index = len(_EDGES) - 1 - min(index, len(_EDGES) - 1)
    return float(_EDGES[bin_index + 1]) if bin_index + 1 < len(_EDGES) else math.inf


def engine_label(engine: str) -> str:
    """host:port of a server URL (metric names stay short); other names as they are."""
    parsed = urlparse(engine)
    return parsed.netloc or engine or "unknown"


class MismatchHealth:
    """Collects deltas over one step's first pass through its mini-batches (the loss function
    calls `add_rows`, which keeps them on the device), then `reduce` reads them to the host at once,
    and merges every rank's statistics (a collective) into metrics."""

    def __init__(self, sample_engines: list[str], sample_staleness: list[int] | None = None):
        self.sample_engines = [engine_label(e) for e in sample_engines]
        self.sample_staleness = sample_staleness
        self._by_key: dict[str, DeltaStats] = {}
        self._pending: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @property
    def stats(self) -> dict[str, DeltaStats]:
        """This rank's statistics by split (what add_rows kept is taken in first)."""
        self._take_pending()
        return self._by_key

    def _stats(self, key: str) -> DeltaStats:
        return self._by_key.setdefault(key, DeltaStats())

    def add_rows(self, sample_indices: list[int], delta: torch.Tensor, mask: torch.Tensor,
                 fraction: torch.Tensor) -> None:
        """delta, mask, fraction: [rows, w] with row i = sample_indices[i] (rows past them are padding);
        fraction: where in its response each token is, in [0, 1). Kept on the device until `reduce`
        (the loss function calls this for every micro-batch: no host read there)."""
        rows = len(sample_indices)
        self._pending.append((list(sample_indices), delta[:rows].detach(), mask[:rows].detach(),
                              fraction[:rows].detach()))

    def _take_pending(self) -> None:
        """The kept micro-batches' rows to the host in one read per tensor kind, then into the histograms."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        sizes = [delta.numel() for _, delta, _, _ in pending]
        host = [torch.cat([entry[k].reshape(-1) for entry in pending]).cpu().split(sizes) for k in (1, 2, 3)]
        for (indices, delta, _, _), values, keep, fraction in zip(pending, *host):
            shape = delta.shape
            self._add_host_rows(indices, values.reshape(shape), keep.reshape(shape), fraction.reshape(shape))

    def _add_host_rows(self, sample_indices: list[int], delta: torch.Tensor, keep: torch.Tensor,
                       fraction: torch.Tensor) -> None:
        """One micro-batch's rows (host tensors): one histogram update per split, not per row."""
        values = delta[keep]
        row_of_token = keep.nonzero()[:, 0]
        self._stats("").add(values)
        third = (fraction[keep] * 3).clamp(max=2.999).long()
        for i, name in enumerate(POSITIONS):
            self._stats(f"position_{name}/").add(values[third == i])
        self._add_by("engine_{}/", [self.sample_engines[i] for i in sample_indices], values, row_of_token)
        if self.sample_staleness is not None:
            self._add_by("staleness_{}/", [self.sample_staleness[i] for i in sample_indices], values, row_of_token)

    def _add_by(self, key: str, row_labels: list, values: torch.Tensor, row_of_token: torch.Tensor) -> None:
        for label in dict.fromkeys(row_labels):
            rows = torch.tensor([lab == label for lab in row_labels], dtype=torch.bool)
            self._stats(key.format(label)).add(values[rows[row_of_token]])

    def reduce(self, contributes: bool) -> dict[str, float]:
        """Every rank's statistics merged (collective over the world); `contributes`: this rank
        holds distinct tokens (a last pipeline stage, tensor-parallel rank 0)."""
        from megatron_grpo.launch.collectives import all_gather_objects

        merged: dict[str, DeltaStats] = {}
        for part in all_gather_objects(self.stats if contributes else {}):
            for key, stats in part.items():
                merged.setdefault(key, DeltaStats()).merge(stats)
        return mismatch_metrics(merged)


def mismatch_metrics(stats: dict[str, DeltaStats]) -> dict[str, float]:
    """The metrics of merged statistics (see the module docstring)."""
    out: dict[str, float] = {}
    if "" not in stats:
        return out
    out.update(stats[""].summary("mismatch/", full=True))
    engines = [key for key in stats if key.startswith("engine_")]
    for key, value in sorted(stats.items()):
        if key and (not key.startswith("engine_") or len(engines) > 1):
            out.update(value.summary(f"mismatch/{key}", full=False))
    return out
