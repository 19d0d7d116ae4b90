"""ridge: closed form against a direct torch.linalg.solve of the paper's normal equations."""

from __future__ import annotations

import pytest
import torch

from ltv_vllm.core.ridge import (
    Factors,
    choose_form,
    lam_grid,
    loo_curve,
    mean_shift,
    ridge_fit,
    truncate,
)


def direct_solution(h: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """Paper eq. (closed form): (H Hᵀ + λI) W*ᵀ = H Yᵀ with H = hᵀ, Y = yᵀ."""
    H, Y = h.double().T, y.double().T
    A = H @ H.T + lam * torch.eye(H.shape[0], dtype=torch.float64)
    return torch.linalg.solve(A, H @ Y.T).T  # (d_out, d_in)


@pytest.mark.parametrize("form", ["primal", "dual", "auto"])
@pytest.mark.parametrize("n,d_in,d_out", [(40, 12, 12), (12, 40, 40), (30, 16, 50)])
def test_ridge_matches_direct_solve(form, n, d_in, d_out):
    g = torch.Generator().manual_seed(n * 1000 + d_in)
    h = torch.randn(n, d_in, generator=g) * 3 + 1  # offset: no centering is done
    y = torch.randn(n, d_out, generator=g)
    f = ridge_fit(h, y, lam=5.0, form=form)
    ref = direct_solution(h, y, 5.0)
    assert f.dense().shape == ref.shape
    torch.testing.assert_close(f.dense().double(), ref, atol=1e-5, rtol=1e-4)
    assert f.U.shape[1] <= min(n, d_in)  # rank ≤ N (and ≤ d)
    # V is orthonormal after rebalancing: applying W is a projection then an expansion
    torch.testing.assert_close(f.V.T @ f.V, torch.eye(f.V.shape[1]), atol=1e-5, rtol=0)
    # apply() on rows is W h
    x = torch.randn(5, d_in, generator=g)
    torch.testing.assert_close(f.apply(x).double(), x.double() @ ref.T, atol=1e-4, rtol=1e-4)
    if form == "auto":
        assert f.form == choose_form(n, d_in)


def test_primal_and_dual_agree_and_minimise_the_objective():
    g = torch.Generator().manual_seed(3)
    h, y = torch.randn(25, 20, generator=g), torch.randn(25, 20, generator=g)
    p = ridge_fit(h, y, 2.0, form="primal").dense().double()
    d = ridge_fit(h, y, 2.0, form="dual").dense().double()
    torch.testing.assert_close(p, d, atol=1e-6, rtol=1e-5)

    def objective(w: torch.Tensor) -> float:
        return float(((y.double() - h.double() @ w.T) ** 2).sum() + 2.0 * (w**2).sum())

    base = objective(p)
    for _ in range(5):  # any perturbation increases the (strictly convex) objective
        assert objective(p + 1e-3 * torch.randn(p.shape, generator=g, dtype=torch.float64)) > base


def test_ill_conditioned_states_float64_default():
    """Large, nearly collinear hidden states (as post-norm states are): still exact."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(1, 64, generator=g) * 50
    h = base + 0.01 * torch.randn(32, 64, generator=g)
    y = torch.randn(32, 64, generator=g)
    f = ridge_fit(h, y, 5.0)
    ref = direct_solution(h, y, 5.0)
    rel = (f.dense().double() - ref).norm() / ref.norm()
    assert rel < 1e-5, rel


def test_mean_shift_and_bad_lambda():
    y = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    assert torch.equal(mean_shift(y), torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError, match="lam must be > 0"):
        ridge_fit(torch.ones(2, 2), torch.ones(2, 2), 0.0)


@pytest.mark.parametrize("balanced", [True, False])
def test_truncate_without_weights_is_eckart_young(balanced):
    """No states and no head: the best rank-r approximation of W itself, against an SVD of the
    dense W, for fitted (SVD-ordered) factors and for arbitrary ones."""
    g = torch.Generator().manual_seed(11)
    if balanced:
        fit = ridge_fit(torch.randn(20, 16, generator=g), torch.randn(20, 24, generator=g), 1.0)
        f = Factors(fit.U, fit.V, fit.form)  # the fit without its gram
    else:
        f = Factors(U=torch.randn(24, 10, generator=g), V=torch.randn(16, 10, generator=g),
                    form="raw")
    W = f.dense().double()
    P, s, Qt = torch.linalg.svd(W)
    for r in (1, 3, 7):
        t = truncate(f, r)
        assert t.U.shape == (24, r) and t.V.shape == (16, r)
        best = (P[:, :r] * s[:r]) @ Qt[:r]
        torch.testing.assert_close(t.dense().double(), best, atol=1e-5, rtol=1e-5)
        # the error is the discarded singular values, nothing more
        err = torch.linalg.matrix_norm(W - t.dense().double())
        torch.testing.assert_close(err, s[r:].norm(), atol=1e-5, rtol=1e-5)
    assert truncate(f, f.U.shape[1]) is f and truncate(f, 10_000) is f
    with pytest.raises(ValueError, match="rank must be"):
        truncate(f, 0)


@pytest.mark.parametrize("with_head", [False, True])
def test_truncate_weighted_is_reduced_rank_regression(with_head):
    """With the fit's states H (its gram) and a head M: min ‖M (W − W_r) H‖_F, checked against
    the reduced-rank-regression formula W_r = R⁻¹ P_r P_rᵀ R W (M = Q R, P_r the top left
    singular vectors of R W H), which uses neither Cholesky factor."""
    g = torch.Generator().manual_seed(5)
    # states with a few loud directions (as post-norm states have), targets of another shape
    h = torch.randn(40, 16, generator=g) * torch.linspace(0.1, 10, 16)
    fit = ridge_fit(h, torch.randn(40, 24, generator=g), 1.0)
    M = torch.randn(30, 24, generator=g).double() if with_head else torch.eye(24).double()
    H = h.double().T
    torch.testing.assert_close(fit.gram.double(),
                               (fit.V.double().T @ H) @ (H.T @ fit.V.double()) / 40,
                               atol=1e-3, rtol=1e-4)
    W = fit.dense().double()
    R = torch.linalg.qr(M)[1]
    P = torch.linalg.svd(R @ W @ H)[0]
    plain = truncate(Factors(fit.U, fit.V, fit.form), 4)

    def loss(Wr):
        return float(torch.linalg.matrix_norm(M @ (W - Wr) @ H))

    for r in (1, 4, 9):
        t = truncate(fit, r, head_gram=M.T @ M if with_head else None)
        ref = torch.linalg.solve(R, P[:, :r] @ P[:, :r].T @ R @ W)
        torch.testing.assert_close(t.dense().double(), ref, atol=1e-4, rtol=1e-4)
        assert loss(t.dense().double()) == pytest.approx(loss(ref), rel=1e-5)
        # the gram travels with the factors: it is the states in the new V's coordinates
        A = t.V.double().T @ H
        torch.testing.assert_close(t.gram.double(), A @ A.T / 40, atol=1e-3, rtol=1e-4)
        if r == 4:  # weighing by the states beats cutting W alone, on what W is applied to
            assert loss(t.dense().double()) < 0.9 * loss(plain.dense().double())
    # cutting the cut again is the same as cutting once (the gram was carried along)
    t4 = truncate(fit, 4, head_gram=M.T @ M if with_head else None)
    torch.testing.assert_close(truncate(t4, 2, head_gram=M.T @ M if with_head else None).dense(),
                               truncate(fit, 2, head_gram=M.T @ M if with_head else None).dense(),
                               atol=1e-4, rtol=1e-4)


def test_closed_form_leave_one_out_equals_n_explicit_refits():
    """loo_curve's error at each λ = the mean squared error of N refits, each a direct dense
    solve on the other N − 1 samples, predicting the one left out; also for a kernel Gram."""
    g = torch.Generator().manual_seed(5)
    n, d, d_out = 12, 5, 3
    h = torch.randn(n, d, generator=g, dtype=torch.float64) * 3
    y = h @ torch.randn(d, d_out, generator=g, dtype=torch.float64) + torch.randn(
        n, d_out, generator=g, dtype=torch.float64)
    lams = (0.01, 1.0, 5.0, 100.0)
    curve = loo_curve(h @ h.T, y, lams)
    for lam, err in zip(lams, curve.errors, strict=True):
        sq = 0.0
        for i in range(n):
            keep = [j for j in range(n) if j != i]
            H, Y = h[keep].T, y[keep].T  # columns as samples, as in the paper
            W = Y @ H.T @ torch.linalg.inv(H @ H.T + lam * torch.eye(d, dtype=H.dtype))
            sq += float(((W @ h[i] - y[i]) ** 2).sum())
        assert err == pytest.approx(sq / n, rel=1e-9)
    # a kernel (RBF) Gram: refits in the dual, k(x_i, X_rest) (K_rest + λI)⁻¹ Y_rest
    K = torch.exp(-torch.cdist(h, h) ** 2 / 20)
    curve = loo_curve(K, y, (0.5,))
    sq = 0.0
    for i in range(n):
        keep = [j for j in range(n) if j != i]
        alpha = torch.linalg.solve(K[keep][:, keep] + 0.5 * torch.eye(n - 1, dtype=K.dtype),
                                   y[keep])
        sq += float(((K[i, keep] @ alpha - y[i]) ** 2).sum())
    assert curve.errors[0] == pytest.approx(sq / n, rel=1e-9)
    assert curve.best == 0.5
    # the default grid scales with the states: 29 quarter-decades around their squared norm
    grid = lam_grid(h @ h.T)
    assert len(grid) == 29 and grid[-1] / grid[0] == pytest.approx(1e7)
    assert lam_grid(100 * h @ h.T)[3] == pytest.approx(100 * grid[3])
