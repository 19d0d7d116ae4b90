"""I2CL (Li et al. 2024, LzVv123456/I2CL), re-implemented without calibration, as the LTV
paper ran it.

Extraction: each demonstration is run alone (`{in}: {text}\n{label}: {word}\n`, the default
special tokens); at its last token, the output of every layer's attention module (after
o_proj, before the residual add) and of its MLP are read; averaged over demos, they are the
context vectors c_attn[ℓ], c_mlp[ℓ].
Inference: at every layer and every token, each module's output becomes β·out + λ·c
(λ = 0.1, β = 1: the original's initial coefficients; λ = 0, β = 1 is zero-shot exactly).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .artifact import Artifact
from .base import Context, Method, MethodError, attention, decoder_layers, edits, mlp, records


class I2CL(Method):
    name, label = "i2cl", "I2CL"

    def extract(self, ctx: Context) -> Artifact:
        ep = ctx.episode
        if not ep.demos:
            raise MethodError("i2cl: the episode has no demonstrations")
        layers = decoder_layers(ctx.model)
        mods = [attention(layer) for layer in layers] + [mlp(layer) for layer in layers]
        with records(outputs=mods) as (outs, _):
            for e in ep.demos:
                t = torch.tensor([ctx.cap.encode(ep.task.demo(e.text, e.label))])
                ctx.cap.forward_last(t, torch.ones_like(t))
        c = torch.stack([torch.cat(o).mean(0) for o in outs])  # (2L, d)
        n = len(layers)
        return Artifact(self.name, {"c_attn": c[:n], "c_mlp": c[n:]},
                        {"lam": ctx.opts.i2cl_lam, "beta": ctx.opts.i2cl_beta},
                        ctx.identity, tuple(ctx.label_ids), ctx.provenance(self.name))

    @contextmanager
    def applied(self, model, art: Artifact):
        from ..vector import model_identity

        art.check_model(model_identity(model))
        lam, beta = float(art.params["lam"]), float(art.params["beta"])
        layers = decoder_layers(model)
        dtype = next(model.parameters()).dtype

        def inject(c: torch.Tensor):
            def fn(x: torch.Tensor) -> torch.Tensor:
                return beta * x + lam * c.to(device=x.device, dtype=dtype)
            return fn

        pairs = [(attention(layer), inject(art.tensors["c_attn"][i])) for i, layer in
                 enumerate(layers)]
        pairs += [(mlp(layer), inject(art.tensors["c_mlp"][i])) for i, layer in
                  enumerate(layers)]
        with edits(outputs=pairs):
            yield model
