"""Label-restricted distributions, accuracy and d_NTP (paper eqs. 2, 3 and "Proposed Metric");
for regression, numbers parsed from generated text, MSE and parse rate.

All functions take restricted logits z (n, K): the LM-head logits of the K label tokens.
Softmax over them is the paper's P(c | p; C) = P(c | p) / Σ_c' P(c' | p).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

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


def span_basis(V: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis Q (d, r) of the span of V's columns: the directions of h a
    linear map W h = U Vᵀ h reads (the fitted queries' states span them)."""
    q, _ = torch.linalg.qr(V)
    return q


def off_span_share(h: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """‖h − Q Qᵀ h‖ / ‖h‖ per row (n,): the share of each state the map cannot see. Live
    queries unlike the fitted ones sit further outside the span: the statistic that told
    drifted traffic from matched traffic (AUC 0.91–0.94 on SmolLM2-135M,
    benchmarks/results/fidelity_signal_smollm2-135m), where the KL to the ICL prompt did
    not."""
    h = h.to(q.dtype)
    rest = h - (h @ q) @ q.T
    return torch.linalg.vector_norm(rest, dim=-1) / torch.linalg.vector_norm(
        h, dim=-1).clamp_min(1e-30)


class LiveSample(NamedTuple):
    """One request's fidelity, from the two distributions' top-N log-probabilities
    (`live_sample`): KL(P_icl ‖ P_tv) and whether their argmax agree, or None for both when
    the tokens it needs were not all among the top N (`over` is then "incomplete")."""

    kl: float | None
    agree: bool | None
    over: str  # "labels" | "top" | "incomplete"


def live_sample(icl: Mapping[int, float], tv: Mapping[int, float],
                labels: Sequence[int]) -> LiveSample:
    """d_NTP's per-query term for one live request, from the token → log-probability maps a
    server returns (each the top N of the full vocabulary). With labels: over the label tokens
    (as `d_ntp`: both restricted to them), exact when every label is in both maps, else
    incomplete — a label missing from a top N is not known, and no stand-in value is used.
    Without labels: over the tokens in both maps, each distribution renormalized over them
    (at least two), and the agreement of the full distributions' top tokens."""
    if labels:
        if any(t not in icl or t not in tv for t in labels):
            return LiveSample(None, None, "incomplete")
        z_icl = torch.tensor([[icl[t] for t in labels]], dtype=torch.float64)
        z_tv = torch.tensor([[tv[t] for t in labels]], dtype=torch.float64)
        return LiveSample(float(kl_per_query(z_icl, z_tv)[0]),
                          bool(predictions(z_icl)[0] == predictions(z_tv)[0]), "labels")
    common = [t for t in icl if t in tv]
    if len(common) < 2:
        return LiveSample(None, None, "incomplete")
    z_icl = torch.tensor([[icl[t] for t in common]], dtype=torch.float64)
    z_tv = torch.tensor([[tv[t] for t in common]], dtype=torch.float64)
    top = max(icl, key=icl.__getitem__) == max(tv, key=tv.__getitem__)
    return LiveSample(float(kl_per_query(z_icl, z_tv)[0]), top, "top")


def untrusted_number(v: Any) -> float | None:
    """A number read from a file's untrusted metrics as a finite float; None for anything
    else (a string, a bool, an int too large for a float, NaN, infinity)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def shortfall(metrics: dict[str, Any] | None, method: str | None,
              n_test: int | None = None) -> str | None:
    """One line when `method`'s held-out accuracy is below zero-shot's by more than noise
    (None otherwise, and when the metrics lack either): serving the vector would lower
    accuracy on prompts like the ones it was scored on. Says whether ICL is below zero-shot
    too (then the vector imitates an ICL that does not help: more queries will not fix it).

    Noise: 1/√n of the test queries (a binomial accuracy's standard error is ≤ 0.5/√n, a
    difference of two ≤ 0.71/√n); without n, any gap. Reads a file's untrusted `metrics`:
    a missing or non-numeric entry is no warning, never an error.
    """

    def acc(name: str | None) -> float | None:
        v = (metrics or {}).get(name) if isinstance(metrics, dict) and name else None
        return untrusted_number(v.get("accuracy") if isinstance(v, dict) else None)

    a_m, a_zs, a_icl = acc(method), acc("zero-shot"), acc("icl")
    if a_m is None or a_zs is None:
        return None
    if not (isinstance(n_test, int) and not isinstance(n_test, bool) and 0 < n_test < 1 << 53):
        n_test = None  # junk in the file (negative, huge): no noise margin, never an error
    noise = 1 / math.sqrt(n_test) if n_test else 0.0
    if a_zs - a_m <= noise:
        return None
    on = f" on {n_test} held-out queries" if n_test else " on the held-out queries"
    line = (f"{method} scored {100 * a_m:.1f} %{on}, below zero-shot's {100 * a_zs:.1f} %: "
            "serving it lowers accuracy on prompts like these")
    if a_icl is not None and a_icl < a_zs:
        return (line + f"; ICL is below zero-shot too ({100 * a_icl:.1f} %) and the vector "
                "imitates ICL, so this model gains nothing from it on this prompt format")
    return line


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


# -- regression: numbers parsed from generated text ----------------------------------------

# A decimal number with an optional sign and exponent: "-1.5", "+.25", "3.", "2e-3".
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def parse_number(text: str, next_input: str | None = "x:") -> float | None:
    """The answer a generation gives: the first number on its first non-empty line.

    Only that line is read, and a line that starts the next demo (`next_input`, the task's
    "x:") has no answer, so a model that skips the answer is unparsed rather than answered
    with an x. Leading text on the line is skipped ("about -1.5" → -1.5); "1.2.3" reads as
    1.2. None when the line has no number or the number is not finite ("1e999").
    """
    line = next((s.strip() for s in text.split("\n") if s.strip()), "")
    if next_input and line.startswith(next_input):
        return None
    m = _NUMBER.search(line)
    if m is None:
        return None
    v = float(m.group())
    return v if math.isfinite(v) else None


def copies(answer: float | None, printed: Sequence[float], decimals: int) -> bool:
    """The answer is one of `printed` as the prompt prints it (to `decimals` places): a
    query's own coordinates (the model echoed the `x: [x₁, …` line) or a demo's label (it
    repeated a y it was shown) rather than a prediction. A real prediction equal to one of
    them is a 1-in-10^decimals coincidence per value."""
    if answer is None:
        return False
    half = 0.5 * 10.0 ** -decimals
    return any(abs(answer - round(v, decimals)) < half for v in printed)


def _mse_of(pairs: list[tuple[float, float]]) -> float:
    return sum((a - t) ** 2 for a, t in pairs) / len(pairs) if pairs else math.nan


def regression_scores(answers: list[float | None], targets: list[float],
                      inputs: Sequence[Sequence[float]] | None = None,
                      decimals: int = 4, demo_labels: Sequence[float] = ()) -> dict[str, Any]:
    """What the answers are and how far they land, per instance.

    `mse`: over every parsed answer; `parse_rate`: parsed / queries. With the queries'
    `inputs`, a parsed answer that `copies` a coordinate of its own x (`echoes_x`), or else a
    demo's label (`echoes_demo`, from `demo_labels`), is an *echo*: `echoes`, `echo_rate`,
    and `mse_own` / `own_rate` over the parsed answers that are not echoes.
    `mse_zero_fill`: MSE over all queries with an unparsed answer replaced by 0 — failures
    scored as *predict 0*, the prior mean of y and the best constant guess: a bound on what
    failing to answer could hide, not a score of the method. `top_answer` / `top_count`: the
    most frequent parsed value and how often it came, `zeros`: how many answers are exactly
    0 (a model that answers one constant, or the best constant, shows here)."""
    assert len(answers) == len(targets), "one answer per target"
    if not targets:
        raise ValueError("no queries to score")
    parsed = [(a, t) for a, t in zip(answers, targets, strict=True) if a is not None]
    filled = [((a if a is not None else 0.0) - t) ** 2 for a, t in zip(answers, targets,
                                                                       strict=True)]
    n = len(targets)
    counts = Counter(a for a, _ in parsed)
    top, top_n = counts.most_common(1)[0] if counts else (None, 0)
    out: dict[str, Any] = {
        "mse": _mse_of(parsed),
        "parse_rate": len(parsed) / n,
        "mse_zero_fill": sum(filled) / len(filled),
        "n": n,
        "parsed": len(parsed),
        "top_answer": top,
        "top_count": top_n,
        "zeros": counts.get(0.0, 0),  # answers of exactly 0: the predict-0 reference's answer
    }
    if inputs is not None:
        assert len(inputs) == n, "one input per target"
        of_x = [copies(a, x, decimals) for a, x in zip(answers, inputs, strict=True)]
        of_demo = [not e and copies(a, demo_labels, decimals) for a, e in
                   zip(answers, of_x, strict=True)]
        echo = [a or b for a, b in zip(of_x, of_demo, strict=True)]
        own = [(a, t) for a, t, e in zip(answers, targets, echo, strict=True)
               if a is not None and not e]
        out |= {"echoes": sum(echo), "echoes_x": sum(of_x), "echoes_demo": sum(of_demo),
                "echo_rate": sum(echo) / n, "own_rate": len(own) / n, "mse_own": _mse_of(own)}
    return out
