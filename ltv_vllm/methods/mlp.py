"""The paper's MLP mapping (appendix, "2-layer MLP-based Mapping"): h_zs → h_icl − h_zs by a
ReLU network trained with MSE on the same N pairs LTV's ridge solves in closed form.

  depth 2:  f(h) = W₂ ReLU(W₁ h)          (W₁, W₂ ∈ ℝ^{d×d}, no biases, as the paper writes it)
  depth 2m: f ← f + W₂ᵇ ReLU(W₁ᵇ f) for m − 1 more blocks (a skip every two layers, the
            appendix's 4/8/16-layer variants); the added blocks start at zero so training
            starts from the 2-layer map.
Trained as the appendix: AdamW, lr 1e-3, cosine schedule with 10 % warmup, batch 8, 20
epochs. Applied like LTV: h + f(h) before the LM head, every decoding step.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ltv_vllm.core.vector import model_identity
from ltv_vllm.extraction.capture import lm_head
from ltv_vllm.methods.artifact import Artifact
from ltv_vllm.methods.base import Context, Method, Option


def mlp_delta(weights: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """f(h) for rows h (n, d); weights = [W₁, W₂, W₁ᵇ, W₂ᵇ, ...] (pairs, (d_hidden, d) / (d, ·))."""
    f = None
    for i in range(0, len(weights), 2):
        x = h if f is None else f
        out = torch.relu(x @ weights[i].T) @ weights[i + 1].T
        f = out if f is None else f + out
    assert f is not None
    return f


def fit_mlp(h: torch.Tensor, y: torch.Tensor, *, depth: int = 2, epochs: int = 20,
            lr: float = 1e-3, batch: int = 8, seed: int = 0) -> list[torch.Tensor]:
    """Train f with MSE(f(h), y) on float32 CPU copies; returns the weights (float32, CPU)."""
    from transformers import get_cosine_schedule_with_warmup

    g = torch.Generator().manual_seed(seed)
    h, y = h.float().cpu(), y.float().cpu()
    d_in, d_out = h.shape[1], y.shape[1]
    params: list[nn.Parameter] = []
    for b in range(depth // 2):
        w1, w2 = torch.empty(d_in if b == 0 else d_out, d_in), torch.empty(d_out, d_in)
        # nn.Linear's default init, drawn from our generator so a seed fixes the fit
        bound1, bound2 = 1 / w1.shape[1] ** 0.5, 1 / w2.shape[1] ** 0.5
        w1.uniform_(-bound1, bound1, generator=g)
        if b == 0:
            w2.uniform_(-bound2, bound2, generator=g)
        else:
            w2.zero_()
        params += [nn.Parameter(w1), nn.Parameter(w2)]
    opt = torch.optim.AdamW(params, lr=lr)
    steps = epochs * -(-h.shape[0] // batch)
    sched = get_cosine_schedule_with_warmup(opt, int(0.1 * steps), steps)
    with torch.enable_grad():
        for _ in range(epochs):
            for idx in torch.randperm(h.shape[0], generator=g).split(batch):
                loss = nn.functional.mse_loss(mlp_delta(list(params), h[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    return [p.detach().clone() for p in params]


class MLP(Method):
    name, label = "mlp", "MLP mapping"
    hidden_space = uses_states = True
    color = "tab:cyan"
    supports = frozenset({"regression", "generation"})
    options = (
        Option("mlp_depth", 2, "MLP mapping: 2 (the paper's W₂ ReLU(W₁ h)), or 4/8/16 with "
               "residual blocks.", minimum=2, even=True),
        Option("mlp_epochs", 20, "MLP: training epochs.", minimum=1),
        Option("mlp_lr", 1e-3, "MLP: learning rate.", float, positive=True),
        Option("mlp_batch", 8, "MLP: training batch size.", minimum=1),
    )

    def extract(self, ctx: Context) -> Artifact:
        h_zs, h_icl = ctx.states()
        o = ctx.opts
        ws = fit_mlp(h_zs, h_icl - h_zs, depth=o.mlp_depth, epochs=o.mlp_epochs, lr=o.mlp_lr,
                     batch=o.mlp_batch, seed=o.seed)
        return Artifact(self.name, {f"w{i}": w for i, w in enumerate(ws)},
                        {"depth": o.mlp_depth, "epochs": o.mlp_epochs, "lr": o.mlp_lr,
                         "batch": o.mlp_batch}, ctx.identity, tuple(ctx.label_ids),
                        ctx.provenance(self.name))

    @staticmethod
    def weights(art: Artifact) -> list[torch.Tensor]:
        return [art.tensors[f"w{i}"] for i in range(len(art.tensors))]

    def shift(self, art: Artifact, h: torch.Tensor) -> torch.Tensor:
        return h + mlp_delta(self.weights(art), h.float())

    @contextmanager
    def applied(self, model, art: Artifact):
        art.check_model(model_identity(model))
        head = lm_head(model)
        ws = [w.to(head.weight.device, head.weight.dtype) for w in self.weights(art)]
        handle = head.register_forward_pre_hook(
            lambda _m, args: (args[0] + mlp_delta(ws, args[0]), *args[1:]))
        try:
            yield model
        finally:
            handle.remove()
