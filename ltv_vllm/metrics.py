"""Label-restricted distributions, accuracy and d_NTP (paper eqs. 2, 3 and "Proposed Metric").

All functions take restricted logits z (n, K): the LM-head logits of the K label tokens.
Softmax over them is the paper's P(c | p; C) = P(c | p) / Σ_c' P(c' | p).
"""

from __future__ import annotations

import torch


def restricted_log_probs(label_logits: torch.Tensor) -> torch.Tensor:
    """log P(c | p; C) for each row: log-softmax over the K label logits. (n, K)"""
    return torch.log_softmax(label_logits.double(), dim=-1)


def predictions(label_logits: torch.Tensor) -> torch.Tensor:
    """argmax_c P(c | p; C): the predicted label index per row. (n,)"""
    return label_logits.argmax(dim=-1)


def accuracy(label_logits: torch.Tensor, labels: torch.Tensor) -> float:
    assert label_logits.shape[0] == labels.shape[0], "one label per row"
    return float((predictions(label_logits) == labels).double().mean())


def kl_per_query(ref_logits: torch.Tensor, other_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref ‖ P_other) per row over the label set, in nats. (n,)"""
    assert ref_logits.shape == other_logits.shape, (
        f"shape mismatch {tuple(ref_logits.shape)} vs {tuple(other_logits.shape)}"
    )
    lp = restricted_log_probs(ref_logits)
    lq = restricted_log_probs(other_logits)
    return (lp.exp() * (lp - lq)).sum(-1)


def d_ntp(icl_logits: torch.Tensor, tv_logits: torch.Tensor) -> float:
    """d_NTP = mean over queries of KL(P_icl ‖ P_tv), both restricted to the label tokens."""
    return float(kl_per_query(icl_logits, tv_logits).mean())


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson's r; None when fewer than 3 points or either side is constant."""
    if len(x) < 3:
        return None
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else None


def _ranks(x: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their average rank (as scipy.stats.rankdata; scipy is not a
    dependency for these few lines)."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's ρ: Pearson's r of the ranks (ties averaged)."""
    return pearson(_ranks(x), _ranks(y)) if len(x) >= 3 else None
