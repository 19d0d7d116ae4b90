"""Teachers: the distribution a vector is fitted to imitate, as a map on ICL states.

LTV regresses h_zs onto the states an ICL prompt produces (`core.ridge`). A teacher changes
that target before the solve, so the fit stays one closed-form ridge and serving is unchanged:

  * ``icl`` (the default): the prompt's own states, h_icl (the paper's target);
  * ``batch``: batch calibration (Zhou et al. 2023, arXiv 2309.17249): the label
    log-probabilities less their mean over the N unlabeled train queries;
  * ``contextual``: contextual calibration (Zhao et al. 2021): the label probabilities
    divided by those of content-free inputs after the same demonstrations;
  * any of them blended with the gold label of a share of the train queries:
    q = (1 − w) p_teacher + w onehot(y) (a user's labelled CSV holds more labels than a
    prompt's k demonstrations use).

A target distribution q over the K label tokens becomes a target state through the label
head (z = W_C h + b_C, softmax over the K rows is shift-invariant): the smallest change
Δh with W_C Δh = log q − log p + c·1 for some c (the minimum-norm solution over Δh and c).
Only the K label logits move; the rest of the state is the prompt's. Pure tensor functions,
float64 inside (the label Gram is K×K and may be ill-conditioned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ltv_vllm.errors import ArgumentError

CALIBRATIONS = ("icl", "batch", "contextual")
# The gold weight `extract` and `compile` blend in when none is asked and every train query
# carries a label of its task (docs/benchmarks.md, "Teachers": the one k-shot prompt blended
# at 0.8 beat it on both packaged models at no extra pass; without labels: the prompt).
DEFAULT_GOLD_WEIGHT = 0.8
# content-free inputs of contextual calibration (Zhao et al. 2021 average these three)
CONTENT_FREE = ("N/A", "", "[MASK]")


@dataclass(frozen=True)
class TeacherOptions:
    """Which teacher a vector is fitted to; the default reproduces the paper's target.

    `calibration`: one of CALIBRATIONS. `gold_weight` w in [0, 1): the weight of each
    labelled query's gold label in its target (0: no blend). `gold_share` in (0, 1]: the
    share of the N train queries whose label is used (the first ⌈share·N⌉)."""

    calibration: str = "icl"
    gold_weight: float = 0.0
    gold_share: float = 1.0

    def __post_init__(self) -> None:
        if self.calibration not in CALIBRATIONS:
            raise ArgumentError(f"--teacher must be one of {', '.join(CALIBRATIONS)}, got "
                                f"{self.calibration!r}")
        w, s = self.gold_weight, self.gold_share
        if isinstance(w, bool) or not (isinstance(w, int | float) and math.isfinite(w)
                                       and 0.0 <= w < 1.0):
            raise ArgumentError(f"--gold-weight must be in [0, 1) (1 would be a one-hot "
                                f"target with no finite log-probability), got {w}")
        if isinstance(s, bool) or not (isinstance(s, int | float) and math.isfinite(s)
                                       and 0.0 < s <= 1.0):
            raise ArgumentError(f"--gold-share must be in (0, 1], got {s}")

    @property
    def is_default(self) -> bool:
        return self.calibration == "icl" and self.gold_weight == 0.0

    @property
    def name(self) -> str:
        """A short label: icl, batch, contextual, each with +gold(w, share) when blended."""
        base = self.calibration
        if self.gold_weight:
            base += f"+gold(w={self.gold_weight:g}, share={self.gold_share:g})"
        return base

    def record(self) -> dict[str, float | str]:
        """What a vector file records about the teacher that fitted it."""
        return {"calibration": self.calibration, "gold_weight": float(self.gold_weight),
                "gold_share": float(self.gold_share)}

    def gold_rows(self, n: int) -> int:
        """How many of n train queries have their gold label blended in."""
        return 0 if not self.gold_weight else math.ceil(self.gold_share * n - 1e-9)


def label_logprobs(h: torch.Tensor, w_c: torch.Tensor, b_c: torch.Tensor | None) -> torch.Tensor:
    """log softmax over the K label-token logits of states h (n, d) → (n, K), float64."""
    z = h.double() @ w_c.double().T
    if b_c is not None:
        z = z + b_c.double()
    return torch.log_softmax(z, -1)


def calibration_offset(opts: TeacherOptions, logp_train: torch.Tensor,
                       logp_content_free: torch.Tensor | None = None) -> torch.Tensor:
    """The label log-probability offset (K,) the calibration adds to every query.

    batch: −mean_j log p(·|x_j) over the train queries; contextual: −log of the mean
    probability over the content-free inputs (`CONTENT_FREE`); icl: zeros."""
    if opts.calibration == "batch":
        return -logp_train.double().mean(0)
    if opts.calibration == "contextual":
        if logp_content_free is None:
            raise ValueError("contextual calibration needs the content-free inputs' states")
        return -torch.logsumexp(logp_content_free.double(), 0) + math.log(
            logp_content_free.shape[0])
    return torch.zeros(logp_train.shape[-1], dtype=torch.float64)


def target_logprobs(logp: torch.Tensor, offset: torch.Tensor, opts: TeacherOptions,
                    gold: torch.Tensor | None = None) -> torch.Tensor:
    """The teacher's label log-probabilities (n, K): the prompt's, calibrated by `offset`,
    blended with `gold` (n,) label indices on the first `opts.gold_rows(n)` rows."""
    out = torch.log_softmax(logp.double() + offset.double(), -1)
    rows = opts.gold_rows(out.shape[0])
    if rows:
        if gold is None:
            raise ValueError("a gold-label blend needs the train queries' labels")
        w = float(opts.gold_weight)
        onehot = torch.nn.functional.one_hot(gold[:rows].long(), out.shape[1]).double()
        out = out.clone()
        out[:rows] = torch.log((1 - w) * out[:rows].exp() + w * onehot)
    return out


def shift_to(h: torch.Tensor, w_c: torch.Tensor, b_c: torch.Tensor | None,
             target: torch.Tensor) -> torch.Tensor:
    """States whose restricted label distribution is `target` (n, K log-probabilities):
    h + Δh with Δh the minimum-norm solution of W_C Δh = target − log p(h) + c·1 over Δh
    and the free constant c (softmax ignores it). (n, d), h's dtype.

    With G = W_C W_Cᵀ and δ the needed logit change: Δh = W_Cᵀ G⁻¹ (δ + c·1), and
    ‖Δh‖² = (δ + c1)ᵀ G⁻¹ (δ + c1) is least at c = −1ᵀG⁻¹δ / 1ᵀG⁻¹1."""
    w = w_c.double()
    delta = target.double() - label_logprobs(h, w_c, b_c)  # (n, K)
    gram = w @ w.T
    ginv_delta = torch.linalg.solve(gram, delta.T)  # (K, n)
    ginv_one = torch.linalg.solve(gram, torch.ones(w.shape[0], 1, dtype=torch.float64))
    c = -(ginv_delta.sum(0, keepdim=True)) / ginv_one.sum()  # (1, n)
    dh = (w.T @ (ginv_delta + ginv_one * c)).T  # (n, d)
    return (h.double() + dh).to(h.dtype)


def teacher_states(h_icl: torch.Tensor, w_c: torch.Tensor, b_c: torch.Tensor | None,
                   opts: TeacherOptions, offset: torch.Tensor,
                   gold: torch.Tensor | None = None) -> torch.Tensor:
    """The states a vector is fitted to (or scored against): h_icl itself for the default
    teacher (bit for bit), else `shift_to` the teacher's distribution."""
    if opts.calibration == "icl" and not opts.gold_rows(h_icl.shape[0]):
        return h_icl
    return shift_to(h_icl, w_c, b_c,
                    target_logprobs(label_logprobs(h_icl, w_c, b_c), offset, opts, gold))


def fit_targets(opts: TeacherOptions, h_icl: torch.Tensor, h_icl_test: torch.Tensor,
                w_c: torch.Tensor, b_c: torch.Tensor | None, *,
                h_content_free: torch.Tensor | None = None,
                gold: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher of one prompt (or one mean over prompts): (the train target a map is
    fitted to, the test reference it is scored against), float32. The calibration's offset
    comes from the train states (batch) or the content-free inputs' (contextual); the gold
    blend applies to the train target alone (a test query has no label at serving time)."""
    cf = None if h_content_free is None else label_logprobs(h_content_free, w_c, b_c)
    offset = calibration_offset(opts, label_logprobs(h_icl, w_c, b_c), cf)
    target = teacher_states(h_icl, w_c, b_c, opts, offset, gold)
    test = teacher_states(h_icl_test, w_c, b_c, TeacherOptions(calibration=opts.calibration),
                          offset)
    return target.float(), test.float()
