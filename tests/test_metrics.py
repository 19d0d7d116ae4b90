"""metrics: restricted softmax, accuracy and d_NTP against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from ltv_vllm.core.metrics import accuracy, d_ntp, kl_per_query, restricted_log_probs


def test_restricted_distribution_is_renormalised_full_softmax():
    full = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    label_ids = [0, 2, 3]
    p_full = torch.softmax(full.double(), -1)[0, label_ids]
    expected = p_full / p_full.sum()  # paper eq. (2)
    got = restricted_log_probs(full[:, label_ids]).exp()[0]
    torch.testing.assert_close(got, expected)


def test_d_ntp_matches_hand_computed_kl():
    icl = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])  # P = (1/4, 3/4), (1/2, 1/2)
    tv = torch.tensor([[0.0, 0.0], [0.0, math.log(4.0)]])  # Q = (1/2, 1/2), (1/5, 4/5)
    kl1 = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    kl2 = 0.5 * math.log(0.5 / 0.2) + 0.5 * math.log(0.5 / 0.8)
    got = kl_per_query(icl, tv)
    torch.testing.assert_close(got, torch.tensor([kl1, kl2], dtype=torch.float64))
    assert abs(d_ntp(icl, tv) - (kl1 + kl2) / 2) < 1e-6  # float32 inputs
    assert d_ntp(icl, icl) == 0.0
    assert d_ntp(icl, tv) != d_ntp(tv, icl)  # KL(P_icl ‖ P_tv): P_icl is the reference


def test_restricted_label_accuracy():
    # full-vocab argmax would pick token 1 (not a label); restricted to {0, 2} it must not
    full = torch.tensor([[1.0, 9.0, 0.0], [0.0, 9.0, 2.0], [3.0, 9.0, 2.9]])
    label_ids = [0, 2]
    labels = torch.tensor([0, 1, 1])
    assert accuracy(full[:, label_ids], labels) == 2 / 3


def test_pearson_and_spearman_against_numpy():
    import numpy as np

    from ltv_vllm.core.metrics import pearson, spearman

    x = [0.3, 0.1, 0.1, 0.7, 0.2, 0.9]
    y = [0.6, 0.8, 0.7, 0.5, 0.8, 0.1]
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    # ranks with ties averaged, by hand: x → 4, 1.5, 1.5, 5, 3, 6; y → 3, 5.5, 4, 2, 5.5, 1
    rx, ry = [4, 1.5, 1.5, 5, 3, 6], [3, 5.5, 4, 2, 5.5, 1]
    assert spearman(x, y) == pytest.approx(np.corrcoef(rx, ry)[0, 1])
    assert pearson([1, 2], [3, 4]) is None and pearson([1, 1, 1], [1, 2, 3]) is None


def test_shortfall_warns_when_the_vector_is_below_zero_shot_beyond_noise():
    """The warning's condition against a hand count: 100 queries → noise 1/√100 = 10 points."""
    from ltv_vllm.core.metrics import shortfall

    def m(zs, icl, ltv):
        return {"zero-shot": {"accuracy": zs, "d_ntp": 0.4}, "icl": {"accuracy": icl},
                "ltv": {"accuracy": ltv, "d_ntp": 0.05}}

    # ICL helps, the vector falls 21 points below zero-shot: warned, without the ICL clause
    line = shortfall(m(0.57, 0.80, 0.36), "ltv", 100)
    assert line.startswith("ltv scored 36.0 % on 100 held-out queries, below zero-shot's 57.0 %")
    assert "ICL is below" not in line and "\n" not in line
    # ICL itself below zero-shot (SmolLM2's sst2 through chat): the clause says why
    line = shortfall(m(0.79, 0.61, 0.56), "ltv", 100)
    assert "ICL is below zero-shot too (61.0 %)" in line
    # within noise (10 points at n = 100; 2.5 at n = 1600) or above: nothing
    assert shortfall(m(0.57, 0.80, 0.48), "ltv", 100) is None
    assert shortfall(m(0.57, 0.80, 0.53), "ltv", 1600) is not None
    assert shortfall(m(0.57, 0.80, 0.60), "ltv", 100) is None
    # without n, any gap counts
    assert shortfall(m(0.57, 0.80, 0.56), "ltv", None) is not None
    # a file's metrics are untrusted: missing, None (a non-finite value), wrong types → no line
    for bad in (None, {}, {"ltv": {"accuracy": 0.1}}, {"zero-shot": {"accuracy": 0.9}},
                {"zero-shot": {"accuracy": None}, "ltv": {"accuracy": 0.1}},
                {"zero-shot": {"accuracy": "0.9"}, "ltv": {"accuracy": 0.1}},
                {"zero-shot": {"accuracy": True}, "ltv": {"accuracy": 0.1}},
                {"zero-shot": [0.9], "ltv": {"accuracy": 0.1}}):
        assert shortfall(bad, "ltv", 100) is None
    assert shortfall(m(0.9, 0.9, 0.1), None, 100) is None  # no method recorded
    assert shortfall(m(0.9, 0.9, 0.1), "tv", 100) is None  # not in the metrics
