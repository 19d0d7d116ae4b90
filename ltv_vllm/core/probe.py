"""A linear probe on the zero-shot state: the rival a user with labelled queries tries first.

Multinomial logistic regression on standardized h_zs (N, d) → K labels, mean cross-entropy
plus l2 · ‖weights‖² (the bias is not penalised), solved by L-BFGS in float64. Written here
rather than taken from scikit-learn, which is not a dependency: the problem is convex, so
L-BFGS run to its tolerance reaches the optimum any solver would. The probe's logits are
label logits like the LM head's label rows, so accuracy and the paired intervals treat it
as every other method. Pure tensor functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# mean-loss L2 weights on standardized features (the grid a dev split chooses from)
PROBE_L2 = (1e-4, 1e-3, 1e-2, 1e-1)


@dataclass(frozen=True)
class Probe:
    mu: torch.Tensor  # (d,) the train states' mean
    sd: torch.Tensor  # (d,) their standard deviation (+1e-6)
    w: torch.Tensor   # (d + 1, K) weights and bias, float64
    l2: float

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Label logits (n, K) of states h (n, d)."""
        x = (h.double() - self.mu) / self.sd
        return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1) @ self.w


def fit_probe(h: torch.Tensor, labels: torch.Tensor, num_classes: int, l2: float) -> Probe:
    """The probe trained on states h (N, d) and their gold label indices (N,)."""
    x = h.double()
    mu, sd = x.mean(0), x.std(0) + 1e-6
    xb = torch.cat([(x - mu) / sd, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    y = labels.long()
    w = torch.zeros(xb.shape[1], num_classes, dtype=x.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=500, tolerance_grad=1e-9,
                            line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        opt.zero_grad()
        out = torch.nn.functional.cross_entropy(xb @ w, y) + l2 * (w[:-1] ** 2).sum()
        out.backward()
        return out

    opt.step(loss)
    return Probe(mu=mu, sd=sd, w=w.detach(), l2=float(l2))
