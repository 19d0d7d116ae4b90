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

    def apply(self, h: torch.Tensor) -> torch.Tensor:
        """W h for a batch of rows: (B, d_in) → (B, d_out)."""
        return (h @ self.V.to(h.dtype)) @ self.U.to(h.dtype).T

    def dense(self) -> torch.Tensor:
        """W = U Vᵀ (d_out, d_in); for tests and small models only."""
        return self.U @ self.V.T


def choose_form(n: int, d_in: int) -> str:
    return "primal" if d_in < n else "dual"


def ridge_fit(
    h: torch.Tensor,
    y: torch.Tensor,
    lam: float,
    *,
    form: Form = "auto",
    dtype: torch.dtype = torch.float64,
) -> Factors:
    """Ridge from h (N, d_in) to y (N, d_out) as factors W = U Vᵀ, with W h ≈ y row-wise."""
    assert h.ndim == 2 and y.ndim == 2, f"expected 2-D h and y, got {tuple(h.shape)}, {tuple(y.shape)}"
    assert h.shape[0] == y.shape[0], f"h has {h.shape[0]} rows but y has {y.shape[0]}"
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
    return Factors(U=U.float().cpu().contiguous(), V=V.float().cpu().contiguous(), form=form)


def _balance(U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """U Vᵀ = (P S)(Q)ᵀ with Q orthonormal; drops directions with zero singular value."""
    qv, rv = torch.linalg.qr(V)  # V = Qv Rv, Qv (d_in, m)
    p, s, qt = torch.linalg.svd(U @ rv.T, full_matrices=False)  # U Rvᵀ = P S Qᵀ
    tol = s.max().clamp(min=torch.finfo(s.dtype).tiny) * max(U.shape + V.shape) * torch.finfo(
        s.dtype
    ).eps
    keep = s > tol
    return p[:, keep] * s[keep], qv @ qt.T[:, keep]


def truncate(f: Factors, rank: int) -> Factors:
    """The best rank-`rank` approximation of W = U Vᵀ (Eckart–Young), as balanced factors.

    Balanced factors are already SVD-ordered (U's columns by decreasing norm), but factors
    from elsewhere need not be, so they are rebalanced first (a QR and a thin SVD of r
    columns: cheap). Serving cost grows with the rank on some paths (vLLM's LoRA gathers a
    vocab × rank matrix per sampled row), which is what cutting the rank buys.
    """
    if rank < 1:
        raise ValueError(f"rank must be ≥ 1, got {rank}")
    if rank >= f.U.shape[1]:
        return f
    U, V = _balance(f.U.double(), f.V.double())
    return Factors(U=U[:, :rank].float().contiguous(), V=V[:, :rank].float().contiguous(),
                   form=f.form)


def mean_shift(y: torch.Tensor) -> torch.Tensor:
    """The constant-mapping baseline (paper appendix): c* = mean_j (h_icl − h_zs)(x_j). (d_out,)"""
    return y.double().mean(0).float()
