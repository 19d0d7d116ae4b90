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
