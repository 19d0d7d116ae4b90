"""Closed-form ridge regression for LTV, returned as low-rank factors.

Paper notation (columns are samples): H (d_in × N) holds h_zs(x_j), Y (d_out × N) holds the
targets (h_icl − h_zs, or logits for cross-model transfer). Here rows are samples:
`h` is Hᵀ (N, d_in) and `y` is Yᵀ (N, d_out).

    W* = argmin ‖Y − W H‖²_F + λ‖W‖²_F
       = Y Hᵀ (H Hᵀ + λI)⁻¹        primal: a d_in × d_in system
       = Y (Hᵀ H + λI)⁻¹ Hᵀ        dual:   an N × N system

Both give W as factors of rank ≤ N, never a dense d_out × d_in matrix:
    dual:   W = [Y (HᵀH + λI)⁻¹] Hᵀ     primal: W = Y [(HHᵀ + λI)⁻¹ H]ᵀ
and the cheaper system is solved (d_in < N → primal, else dual). The raw factors multiply
large numbers that cancel (Hᵀh is O(‖h‖²)), which bf16/fp32 serving would not survive, so
they are rebalanced through a thin SVD into W = U Vᵀ with V orthonormal (d_in, r) and
U = P·diag(s) (d_out, r): applying W is a projection followed by a small expansion. Exactly
zero directions are dropped, so r ≤ min(N, d_in).

Precision: the solve runs in float64 by default. Post-norm hidden states have entries of
order 1–100, so HᵀH's condition number is about (σ_max² + λ)/λ — easily 1e6–1e8 at λ=5,
where float32's 7 digits would be spent. At these sizes (N ≤ a few thousand) float64 costs
milliseconds. `dtype=torch.float32` is there for very large problems on an accelerator.
Factors are returned as float32 on the CPU (the storage convention of TaskVector).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Form = Literal["auto", "primal", "dual"]


@dataclass(frozen=True)
class Factors:
    U: torch.Tensor  # (d_out, r)
    V: torch.Tensor  # (d_in, r)
    form: str        # "primal" | "dual": which system was solved
    # (Vᵀ H)(Vᵀ H)ᵀ / N (r, r): the training states' second moment in V's coordinates, so a
    # later rank cut can weigh directions by how much the states use them (see `truncate`).
    gram: torch.Tensor | None = None
    lam: float | None = None       # the λ fitted with (chosen by `loo` under lam="auto")
    loo: LooCurve | None = None    # lam="auto": the leave-one-out curve it was chosen on

    def apply(self, h: torch.Tensor) -> torch.Tensor:
        """W h for a batch of rows: (B, d_in) → (B, d_out); h float32 like the factors."""
        return low_rank_delta(h, self.U, self.V)

    def dense(self) -> torch.Tensor:
        """W = U Vᵀ (d_out, d_in); for tests and small models only."""
        return self.U @ self.V.T


def low_rank_delta(
    h: torch.Tensor,
    U: torch.Tensor,
    V: torch.Tensor,
    bias: torch.Tensor | None = None,
    rows: slice | torch.Tensor | None = None,
) -> torch.Tensor:
    """U (Vᵀ h) + bias for rows h (B, d_in) → (B, d_out): every LTV map's shift, in one place.

    A projection onto r directions then a small expansion, never a dense d_out × d_in
    product. `rows` keeps only some outputs (a vocabulary shard, the label tokens of a
    logit-space vector): U[rows] and bias[rows]. All tensors must already share h's device
    and dtype (`TaskVector.to` casts a vector once); this function never casts.
    """
    if rows is not None:
        U = U[rows]
        bias = bias[rows] if bias is not None else None
    out = (h @ V) @ U.T
    return out + bias if bias is not None else out


def choose_form(n: int, d_in: int) -> str:
    return "primal" if d_in < n else "dual"


def ridge_fit(
    h: torch.Tensor,
    y: torch.Tensor,
    lam: float | Literal["auto"],
    *,
    form: Form = "auto",
    dtype: torch.dtype = torch.float64,
) -> Factors:
    """Ridge from h (N, d_in) to y (N, d_out) as factors W = U Vᵀ, with W h ≈ y row-wise.

    lam="auto": λ with the least closed-form leave-one-out error on `lam_grid` (no labels,
    no refits; `loo_curve`)."""
    assert h.ndim == 2 and y.ndim == 2, (
        f"expected 2-D h and y, got {tuple(h.shape)}, {tuple(y.shape)}"
    )
    assert h.shape[0] == y.shape[0], f"h has {h.shape[0]} rows but y has {y.shape[0]}"
    loo = None
    if lam == "auto":
        hd = h.to(torch.float64)
        loo = loo_curve(hd @ hd.T, y)
        lam = loo.best
    if not isinstance(lam, int | float):
        raise ValueError(f"lam must be a number or 'auto', got {lam!r}")
    if lam <= 0:
        raise ValueError(f"lam must be > 0 (the ridge penalty), got {lam}")
    n, d_in = h.shape
    if form == "auto":
        form = choose_form(n, d_in)  # type: ignore[assignment]
    H = h.to(dtype).T  # (d_in, N)
    Y = y.to(dtype).T  # (d_out, N)
    if form == "dual":
        gram = H.T @ H  # (N, N)
        gram.diagonal().add_(lam)
        # (HᵀH + λI) is symmetric, so U = Y G⁻¹ = (G⁻¹ Yᵀ)ᵀ.
        U = torch.linalg.solve(gram, Y.T).T  # (d_out, N)
        V = H
    elif form == "primal":
        cov = H @ H.T  # (d_in, d_in)
        cov.diagonal().add_(lam)
        V = torch.linalg.solve(cov, H)  # (d_in, N)
        U = Y
    else:
        raise ValueError(f"form must be auto, primal or dual, got {form!r}")
    U, V = _balance(U, V)
    A = V.T @ H  # (r, N): the training states in V's coordinates
    return Factors(U=U.float().cpu().contiguous(), V=V.float().cpu().contiguous(), form=form,
                   gram=(A @ A.T / n).float().cpu(), lam=float(lam), loo=loo)


def _balance(U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """U Vᵀ = (P S)(Q)ᵀ with Q orthonormal; drops directions with zero singular value."""
    qv, rv = torch.linalg.qr(V)  # V = Qv Rv, Qv (d_in, m)
    p, s, qt = torch.linalg.svd(U @ rv.T, full_matrices=False)  # U Rvᵀ = P S Qᵀ
    tol = s.max().clamp(min=torch.finfo(s.dtype).tiny) * max(U.shape + V.shape) * torch.finfo(
        s.dtype
    ).eps
    keep = s > tol
    return p[:, keep] * s[keep], qv @ qt.T[:, keep]


def truncate(f: Factors, rank: int, *, head_gram: torch.Tensor | None = None) -> Factors:
    """The rank-`rank` W_r closest to W = U Vᵀ where it matters: min ‖M (W − W_r) H‖_F.

    H are the states W is applied to, known through `f.gram` = (Vᵀ H)(Vᵀ H)ᵀ/N (without it,
    VᵀV: every input direction alike, i.e. plain Eckart–Young on W); M is what the output
    goes through next, known through `head_gram` = MᵀM (the LM head's Gram W_lmᵀ W_lm for a
    hidden-space vector; none, i.e. M = I, for a logit-space one). A plain SVD of W keeps the
    directions with the largest gain, which are not the ones the states use or the head
    reads: on SmolLM2 a rank-128 cut of that kind gave up most of the fit (bench rank).

    With gram = L Lᵀ and head_gram = Rᵀ R the error is ‖R (U − U') L‖_F over W_r = U' Vᵀ
    (W_r keeps W's row space: outside it H has nothing of W's to lose), so
    R U' L = [R U L]_rank (a truncated SVD) — a generalised reduced-rank regression.
    Returns balanced factors (V orthonormal) and the gram in their coordinates.
    """
    if rank < 1:
        raise ValueError(f"rank must be ≥ 1, got {rank}")
    if rank >= f.U.shape[1]:
        return f
    U, V = f.U.double(), f.V.double()
    G = f.gram.double() if f.gram is not None else V.T @ V
    L = torch.linalg.cholesky(_jitter(G))  # G = L Lᵀ
    X = U @ L
    R = None
    if head_gram is not None:
        R = torch.linalg.cholesky(_jitter(head_gram.double())).T  # MᵀM = Rᵀ R, R upper
        X = R @ X
    P, s, Qt = torch.linalg.svd(X, full_matrices=False)
    Ur = P[:, :rank] * s[:rank]
    if R is not None:
        Ur = torch.linalg.solve_triangular(R, Ur, upper=True)
    # W_r = Ur Q_rᵀ L⁻¹ Vᵀ: its input factor is V L⁻ᵀ Q_r
    Vr = V @ torch.linalg.solve_triangular(L.T, Qt[:rank].T, upper=True)
    Ub, Vb = _balance(Ur, Vr)
    C = torch.linalg.lstsq(V, Vb).solution  # Vb = V C, so (Vbᵀ H) = Cᵀ (Vᵀ H)
    return Factors(U=Ub.float().contiguous(), V=Vb.float().contiguous(), form=f.form,
                   gram=(C.T @ G @ C).float(), lam=f.lam, loo=f.loo)


def head_gram(w: torch.Tensor) -> torch.Tensor:
    """MᵀM (d, d) in float64 for an output map M (vocab, d): `truncate`'s head weighting."""
    w = w.double()
    return w.T @ w


def _jitter(G: torch.Tensor) -> torch.Tensor:
    """G + εI with ε relative to G's scale, so a merely semi-definite Gram factorises."""
    eps = 1e-10 * float(G.diagonal().mean().clamp(min=1e-30))
    return G + eps * torch.eye(G.shape[0], dtype=G.dtype, device=G.device)


# λ candidates for `--lam auto`, as multiples of the Gram's mean diagonal (the states' mean
# squared norm): hidden-state scales differ by orders of magnitude between models, so a fixed
# absolute grid (like the paper's λ = 5 everywhere) would mean different things on each.
LAM_GRID_EXPONENTS = tuple(e / 4 for e in range(-24, 5))  # 10^-6 … 10^1, quarter decades


@dataclass(frozen=True)
class LooCurve:
    """Closed-form leave-one-out error of ridge at each λ, and the λ it picks."""

    lams: tuple[float, ...]
    errors: tuple[float, ...]  # mean over samples of ‖y_i − ŷ_{−i}(h_i)‖²

    @property
    def best(self) -> float:
        return self.lams[min(range(len(self.lams)), key=self.errors.__getitem__)]

    def to_dict(self) -> dict[str, list[float]]:
        return {"lams": list(self.lams), "errors": list(self.errors)}


def lam_grid(K: torch.Tensor) -> tuple[float, ...]:
    scale = float(K.diagonal().double().mean().clamp(min=1e-30))
    return tuple(scale * 10.0 ** e for e in LAM_GRID_EXPONENTS)


def loo_curve(K: torch.Tensor, y: torch.Tensor, lams: tuple[float, ...] | None = None
              ) -> LooCurve:
    """Leave-one-out error of kernel ridge with Gram K (N, N) and targets y (N, d_out), for
    every λ from one eigendecomposition: with K = Q diag(e) Qᵀ the fit is ŷ = S y with
    S = Q diag(e / (e + λ)) Qᵀ, and ridge's leave-one-out residual is (y_i − ŷ_i) / (1 − S_ii)
    (Allen 1974), so no refit is needed. Linear ridge is K = H Hᵀ (rows as samples)."""
    K, Y = K.double(), y.double()
    e, Q = torch.linalg.eigh(K)
    e = e.clamp(min=0)
    QtY = Q.T @ Y
    Q2 = Q * Q
    lams = lams if lams is not None else lam_grid(K)
    errs = []
    for lam in lams:
        f = e / (e + lam)
        resid = Y - Q @ (f[:, None] * QtY)
        lev = Q2 @ f  # S_ii
        errs.append(float(((resid / (1 - lev)[:, None]) ** 2).sum(1).mean()))
    return LooCurve(tuple(float(x) for x in lams), tuple(errs))


def mean_shift(y: torch.Tensor) -> torch.Tensor:
    """The constant-mapping baseline (paper appendix): c* = mean_j (h_icl − h_zs)(x_j). (d_out,)"""
    return y.double().mean(0).float()
