"""Paired bootstrap intervals on accuracy differences: how a comparison says "beats".

Two methods scored on the same test queries give per-query scores a_i, b_i (correctness, or
its mean over the runs that share those queries). The difference of their accuracies is
mean(a − b); its 95 % interval resamples the *queries* with replacement (B times, one index
draw for both methods: paired) and takes the 2.5th and 97.5th percentiles of the resampled
means (the percentile bootstrap, Efron & Tibshirani 1993, ch. 13). An average over tasks
resamples each task's queries on its own (a stratified bootstrap) and averages the per-task
differences, so a task with more test queries does not weigh more.

A verdict reads only the interval: "above" where its lower end is > 0, "below" where its upper
end is < 0, else "tie". Pure tensor functions; the draws come from a seeded generator, so an
interval recomputed from the stored per-query records is the same number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BOOTSTRAP_REPS = 10_000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A difference (mean over queries, or over tasks) and its bootstrap interval."""

    diff: float
    lo: float
    hi: float

    @property
    def verdict(self) -> str:
        return "above" if self.lo > 0 else "below" if self.hi < 0 else "tie"

    def record(self) -> dict[str, float | str]:
        return {"diff": self.diff, "lo": self.lo, "hi": self.hi, "verdict": self.verdict}


def _scores(x: Sequence[float] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64).flatten()
    assert t.numel() > 0, "a bootstrap needs at least one query"
    return t


def _percentiles(draws: torch.Tensor, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2
    q = torch.quantile(draws, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return float(q[0]), float(q[1])


def paired_bootstrap(a: Sequence[float] | torch.Tensor, b: Sequence[float] | torch.Tensor, *,
                     reps: int = BOOTSTRAP_REPS, seed: int = 0,
                     level: float = LEVEL) -> Interval:
    """mean(a − b) over paired per-query scores, with its percentile bootstrap interval."""
    return stratified_bootstrap([(a, b)], reps=reps, seed=seed, level=level)


def stratified_bootstrap(pairs: Sequence[tuple[Sequence[float] | torch.Tensor,
                                               Sequence[float] | torch.Tensor]], *,
                         reps: int = BOOTSTRAP_REPS, seed: int = 0,
                         level: float = LEVEL) -> Interval:
    """The mean over strata (tasks) of mean(a − b) within each, every stratum's queries
    resampled on their own. One stratum is `paired_bootstrap`."""
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros(reps, dtype=torch.float64)
    point = 0.0
    for a, b in pairs:
        ta, tb = _scores(a), _scores(b)
        assert ta.shape == tb.shape, f"paired scores differ in length: {ta.numel()}, {tb.numel()}"
        d = ta - tb
        idx = torch.randint(0, d.numel(), (reps, d.numel()), generator=g)
        total += d[idx].mean(1)
        point += float(d.mean())
    total /= len(pairs)
    lo, hi = _percentiles(total, level)
    return Interval(point / len(pairs), lo, hi)
