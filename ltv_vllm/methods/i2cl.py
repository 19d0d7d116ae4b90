"""I2CL (Li et al. 2024, LzVv123456/I2CL), re-implemented: uncalibrated as the LTV paper ran
it (`i2cl`), and with the original's calibration of its coefficients (`i2cl-cal`).

Extraction: each demonstration is run alone (`{in}: {text}\n{label}: {word}\n`, the default
special tokens); at its last token, the output of every layer's attention module (after
o_proj, before the residual add) and of its MLP are read; averaged over demos, they are the
context vectors c_attn[ℓ], c_mlp[ℓ].
Inference: at every layer and every token, each module's output becomes β·out + λ·c
(λ = 0.1, β = 1: the original's initial coefficients; λ = 0, β = 1 is zero-shot exactly).

Calibration (`i2cl-cal`, the original's `calibrate_strength`): one (λ, β) per layer and module,
from (0.1, 1), trained with the model frozen on the demonstrations themselves, each asked as a
zero-shot query: cross-entropy of its label token over the whole vocabulary at the last
position, AdamW (lr 0.01, weight decay 1e-3), batches of 2 drawn at random, len(demos) // 2
steps per epoch for 100 epochs, warmup over the first 5 % then cosine, and while training
Gaussian noise of 0.001·‖out‖ added to every injected output.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ltv_vllm.core.vector import model_identity
from ltv_vllm.extraction.capture import base_model, left_pad, lm_head, positions
from ltv_vllm.methods.artifact import Artifact
from ltv_vllm.methods.base import (
    Context,
    Method,
    MethodError,
    Option,
    attention,
    decoder_layers,
    edits,
    mlp,
    records,
)

ATTN, MLP = 0, 1       # coef[ℓ, module, ·]
LAM, BETA = 0, 1       # coef[ℓ, ·, (λ, β)], the original's (strength[0], strength[1]) order


def initial_coef(n_layers: int, lam: float, beta: float) -> torch.Tensor:
    """(L, 2, 2): λ and β for every layer's attention and MLP output."""
    coef = torch.empty(n_layers, 2, 2)
    coef[..., LAM], coef[..., BETA] = lam, beta
    return coef


@contextmanager
def injected(model: nn.Module, c_attn: torch.Tensor, c_mlp: torch.Tensor, coef: torch.Tensor, *,
             noise: float = 0.0, generator: torch.Generator | None = None) -> Iterator[None]:
    """Every layer ℓ's attention and MLP output ← β·out + λ·c at every token, (λ, β) =
    coef[ℓ, module]; `coef` may require grad (calibration). With `noise` > 0, plus
    noise·‖out‖·N(0, I) per token (the original's training-time noise)."""
    layers = decoder_layers(model)
    n = len(layers)
    if c_attn.shape[0] != n or c_mlp.shape[0] != n or tuple(coef.shape) != (n, 2, 2):
        raise MethodError(f"i2cl: the artifact has {c_attn.shape[0]} layers' context vectors "
                          f"and coefficients of shape {tuple(coef.shape)}; the model has {n} "
                          "layers")
    p = next(model.parameters())

    def inject(c: torch.Tensor, lam: torch.Tensor, beta: torch.Tensor):
        c = c.to(device=p.device, dtype=p.dtype)

        def fn(x: torch.Tensor) -> torch.Tensor:
            # 0-dim λ, β keep x's dtype and pass their gradient back in float32
            y = beta * x + lam * c
            if noise:
                eps = torch.randn(y.shape, generator=generator, dtype=torch.float32)
                y = y + (eps.to(y.device, y.dtype) * y.detach().norm(dim=-1, keepdim=True)
                         * noise)
            return y
        return fn

    coef = coef.to(p.device)
    pairs = [(attention(layer), inject(c_attn[i], coef[i, ATTN, LAM], coef[i, ATTN, BETA]))
             for i, layer in enumerate(layers)]
    pairs += [(mlp(layer), inject(c_mlp[i], coef[i, MLP, LAM], coef[i, MLP, BETA]))
              for i, layer in enumerate(layers)]
    with edits(outputs=pairs):
        yield


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The original's learning-rate factor: linear warmup, then a cosine over *all* steps (it
    does not restart at the warmup's end, unlike transformers' cosine schedule)."""
    if step <= warmup:
        return step / warmup if warmup else 1.0
    return (1 + math.cos(math.pi * step / total)) / 2


def demos_loss(model: nn.Module, prompts: Sequence[Sequence[int]],
               targets: Sequence[int]) -> torch.Tensor:
    """Mean cross-entropy of each prompt's target token over the whole vocabulary at its last
    token; one left-padded batch (explicit positions, so a row equals its unpadded run)."""
    dev = next(model.parameters()).device
    ids, mask = left_pad(prompts, 0)  # the pad id is masked out: any token will do
    h = base_model(model)(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                          position_ids=positions(mask).to(dev)).last_hidden_state
    z = lm_head(model)(h[:, -1]).float()
    return nn.functional.cross_entropy(z, torch.tensor(list(targets), device=dev))


def calibrate(
    model: nn.Module, c_attn: torch.Tensor, c_mlp: torch.Tensor,
    prompts: Sequence[Sequence[int]], targets: Sequence[int], *,
    lam: float = 0.1, beta: float = 1.0, epochs: int = 100, lr: float = 0.01, wd: float = 1e-3,
    batch: int = 2, noise: float = 1e-3, seed: int = 0, progress: bool = False,
) -> tuple[torch.Tensor, list[float]]:
    """The calibrated coefficients (L, 2, 2) and the mean training loss of every epoch.

    The model's own weights get no gradient (`autograd.grad` on the coefficients only), so
    nothing about the model changes."""
    from tqdm.auto import tqdm

    if len(prompts) < 1:
        raise MethodError("i2cl-cal: calibration needs demonstrations")
    g = torch.Generator().manual_seed(seed)
    # the coefficients live on the model's device: `injected` moves them there, and a moved
    # copy of a host parameter would never see the optimizer's updates (a flat loss on a GPU)
    coef = nn.Parameter(initial_coef(c_attn.shape[0], lam, beta).to(
        next(model.parameters()).device))
    opt = torch.optim.AdamW([coef], lr=lr, weight_decay=wd)
    per_epoch = max(1, len(prompts) // batch)
    total, warmup = epochs * per_epoch, int(0.05 * epochs * per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, warmup, total))
    losses: list[float] = []
    bar = tqdm(range(epochs), desc="i2cl calibration", unit="epoch", disable=not progress,
               leave=False)
    with torch.enable_grad(), injected(model, c_attn, c_mlp, coef, noise=noise, generator=g):
        for _ in bar:
            epoch = []
            for _ in range(per_epoch):
                # the original reshuffles every step and takes the first `batch`
                idx = torch.randperm(len(prompts), generator=g)[:batch].tolist()
                loss = demos_loss(model, [prompts[i] for i in idx], [targets[i] for i in idx])
                (coef.grad,) = torch.autograd.grad(loss, [coef])
                opt.step()
                sched.step()
                epoch.append(float(loss.detach()))
            losses.append(sum(epoch) / len(epoch))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return coef.detach().cpu().clone(), losses


class I2CL(Method):
    name, label = "i2cl", "I2CL"
    color = "tab:olive"
    supports = frozenset({"regression", "generation"})
    options = (
        Option("i2cl_lam", 0.1, "I2CL: out ← β·out + λ·c, λ (the paper's uncalibrated value).",
               float),
        Option("i2cl_beta", 1.0, "I2CL: β (the paper's uncalibrated value).", float),
    )

    def context_vectors(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        ep = ctx.episode
        if not ep.demos:
            raise MethodError(f"{self.name}: the episode has no demonstrations")
        layers = decoder_layers(ctx.model)
        mods = [attention(layer) for layer in layers] + [mlp(layer) for layer in layers]
        with records(outputs=mods) as (outs, _):
            for e in ep.demos:
                t = torch.tensor([ctx.cap.encode(ep.task.demo(e.text, e.label))])
                ctx.cap.forward_last(t, torch.ones_like(t))
        c = torch.stack([torch.cat(o).mean(0) for o in outs])  # (2L, d)
        n = len(layers)
        return c[:n], c[n:]

    def extract(self, ctx: Context) -> Artifact:
        c_attn, c_mlp = self.context_vectors(ctx)
        return Artifact(self.name, {"c_attn": c_attn, "c_mlp": c_mlp},
                        {"lam": ctx.opts.i2cl_lam, "beta": ctx.opts.i2cl_beta},
                        ctx.identity, tuple(ctx.label_ids), ctx.provenance(self.name))

    @staticmethod
    def coefficients(art: Artifact) -> torch.Tensor:
        if "coef" in art.tensors:
            return art.tensors["coef"]
        return initial_coef(art.tensors["c_attn"].shape[0], float(art.params["lam"]),
                            float(art.params["beta"]))

    @contextmanager
    def applied(self, model, art: Artifact):
        art.check_model(model_identity(model))
        with injected(model, art.tensors["c_attn"], art.tensors["c_mlp"], self.coefficients(art)):
            yield model


class I2CLCalibrated(I2CL):
    """I2CL with the original's calibrated coefficients (one λ, β per layer and module)."""

    name, label = "i2cl-cal", "I2CL (calibrated)"
    color = "gold"
    supports = frozenset({"generation"})
    options = (*I2CL.options,
               Option("i2cl_epochs", 100, "i2cl-cal: epochs its coefficients are calibrated "
                      "for on the demos (the original's 100).", minimum=1),
               Option("i2cl_lr", 0.01, "i2cl-cal: AdamW learning rate (the original's 0.01).",
                      float, positive=True))

    def extract(self, ctx: Context) -> Artifact:
        o, ep = ctx.opts, ctx.episode
        c_attn, c_mlp = self.context_vectors(ctx)
        prompts = [ctx.cap.encode(ep.task.query(e.text)) for e in ep.demos]
        targets = [ctx.label_ids[e.label] for e in ep.demos]
        coef, losses = calibrate(ctx.model, c_attn, c_mlp, prompts, targets, lam=o.i2cl_lam,
                                 beta=o.i2cl_beta, epochs=o.i2cl_epochs, lr=o.i2cl_lr,
                                 seed=o.seed, progress=o.progress)
        return Artifact(self.name, {"c_attn": c_attn, "c_mlp": c_mlp, "coef": coef},
                        {"lam": o.i2cl_lam, "beta": o.i2cl_beta, "epochs": o.i2cl_epochs,
                         "lr": o.i2cl_lr, "loss_first_epoch": losses[0],
                         "loss_last_epoch": losses[-1]},
                        ctx.identity, tuple(ctx.label_ids), ctx.provenance(self.name))

    def params(self, art: Artifact) -> dict | None:
        p = dict(art.params)
        coef = art.tensors["coef"]
        p |= {"mean_lam": float(coef[..., LAM].mean()), "mean_beta": float(coef[..., BETA].mean())}
        return p
