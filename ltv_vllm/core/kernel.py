"""Kernel LTV: the paper's objective with a nonlinear map, still in closed form (the dual).

Ridge in an RBF kernel's feature space from h_zs to h_icl − h_zs (rows are samples):

    shift(h) = A k(S, h),   k(s, h) = exp(−γ ‖s − h‖²),   A = Yᵀ (K + λI)⁻¹,   K = k(S, S)

with the N train states S as support points: an N × N system, the one the linear dual
already solves, and at inference the cost of one rank-N map per row (a projection onto S,
an exp, an expansion). γ and λ are chosen together by ridge's closed-form leave-one-out
error (`ridge.loo_curve`), one eigendecomposition per γ: no labels, no refits. γ's grid is
scaled by the median squared distance between train states, λ's by K's diagonal (= 1).

Stored like a linear vector (`TaskVector`, map "rbf"): U = A (d_out, N), V = Sᵀ (d, N),
and γ; `TaskVector.delta` applies it, so the transformers hook and vLLM's fused wrapper
(`engine.models`, which calls `delta` on its own rows) compute the same thing. It is not
linear: it cannot be folded into the LM head, carried as a LoRA, or cut to a lower rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ltv_vllm.core.ridge import LooCurve, lam_grid, loo_curve

MAPS = ("linear", "rbf")
# γ candidates, as multiples of 1 / median ‖s_i − s_j‖² (the usual median heuristic, ±1 decade)
GAMMA_FACTORS = (0.1, 0.3, 1.0, 3.0, 10.0)


@dataclass(frozen=True)
class KernelFit:
    U: torch.Tensor     # (d_out, N): A
    V: torch.Tensor     # (d_in, N): the support states Sᵀ
    gamma: float
    lam: float
    loo: dict[str, object]  # per γ: its LOO curve over λ; and the chosen point


def sq_dists(a: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """‖a_i − v_j‖² for rows a (B, d) and columns V (d, N), as one matmul (B, N); clamped
    at 0 (the expansion can round below it)."""
    return ((a * a).sum(-1, keepdim=True) + (V * V).sum(0) - 2 * (a @ V)).clamp(min=0)


def rbf_delta(h: torch.Tensor, U: torch.Tensor, V: torch.Tensor, gamma: float,
              bias: torch.Tensor | None = None,
              rows: slice | torch.Tensor | None = None) -> torch.Tensor:
    """U exp(−γ ‖h − V_j‖²)_j (+ bias) for rows h (B, d_in) → (B, d_out); `rows` keeps only
    some outputs (a TP shard), as `ridge.low_rank_delta`. All tensors on h's device/dtype."""
    if rows is not None:
        U = U[rows]
        bias = bias[rows] if bias is not None else None
    out = torch.exp(-gamma * sq_dists(h, V)) @ U.T
    return out + bias if bias is not None else out


def kernel_fit(h: torch.Tensor, y: torch.Tensor, *,
               gamma_factors: tuple[float, ...] = GAMMA_FACTORS) -> KernelFit:
    """RBF kernel ridge from h (N, d_in) to y (N, d_out), γ and λ by closed-form LOO."""
    H, Y = h.double(), y.double()
    n = H.shape[0]
    D = sq_dists(H, H.T)
    off = D[~torch.eye(n, dtype=torch.bool)]
    med = float(off.median()) if off.numel() else 1.0
    med = med if med > 0 else 1.0
    curves: dict[float, LooCurve] = {}
    for c in gamma_factors:
        K = torch.exp(-(c / med) * D)
        curves[c / med] = loo_curve(K, Y, lam_grid(K))
    gamma, curve = min(curves.items(), key=lambda kv: min(kv[1].errors))
    lam = curve.best
    K = torch.exp(-gamma * D)
    K.diagonal().add_(lam)
    alpha = torch.linalg.solve(K, Y)  # (N, d_out)
    loo = {"median_sq_dist": med, "gamma": gamma, "lam": lam,
           "curves": [{"gamma": g, **c.to_dict()} for g, c in curves.items()]}
    return KernelFit(U=alpha.T.float().contiguous(), V=H.T.float().contiguous(),
                     gamma=float(gamma), lam=float(lam), loo=loo)
