"""Task Vector (Hendel et al. 2023, roeehendel/icl_task_vectors), re-implemented.

Extraction: θ_ℓ = output of decoder layer ℓ at the last token of demos + a dummy query,
averaged over dummy queries (the original: 2; ours: the episode's first train queries).
Inference: layer ℓ's output at the query's last position is *replaced* by θ_ℓ. ℓ is the
layer with the best accuracy on the episode's labelled validation examples (the paper: 32).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ltv_vllm.core.vector import model_identity
from ltv_vllm.methods.artifact import Artifact
from ltv_vllm.methods.base import (
    Context,
    Method,
    MethodError,
    Option,
    at_last,
    choose_on_val,
    decoder_layers,
    records,
    run_after,
)


class TV(Method):
    name, label = "tv", "Task Vector"
    needs_val = True
    color = "tab:purple"
    options = (Option("tv_dummies", 2, "TV: dummy queries its state is averaged over (the "
                      "original: 2).", minimum=1),)

    def extract(self, ctx: Context) -> Artifact:
        layers = decoder_layers(ctx.model)
        ep = ctx.episode
        dummies = ep.queries[: ctx.opts.tv_dummies]
        if not dummies:
            raise MethodError("tv: the episode has no train queries to use as dummy queries")
        prefix = ep.demo_prefix()
        pre = ctx.cap.encode_prefix(prefix)
        with records(outputs=list(layers)) as (outs, _):
            for e in dummies:
                run_after(ctx.cap, pre, prefix, ep.task.query(e.text))
        theta = torch.stack([torch.cat(o).mean(0) for o in outs])  # (L, d)
        if ctx.opts.layer is not None:
            layer, scores = _check_layer(ctx.opts.layer, len(layers)), []
        else:
            layer, scores = choose_on_val(
                ctx, list(range(len(layers))),
                lambda idx: at_last(ctx.model, theta, idx), "tv: layer on val")
        return Artifact(self.name, {"theta": theta},
                        {"layer": int(layer), "dummies": len(dummies), "val_accuracy": scores},
                        ctx.identity, tuple(ctx.label_ids), ctx.provenance(self.name))

    @contextmanager
    def applied(self, model, art: Artifact):
        art.check_model(model_identity(model))
        theta = art.tensors["theta"].to(next(model.parameters()).dtype)
        with at_last(model, theta, int(art.params["layer"])):
            yield model


    def layer_task(self, art: Artifact):
        """TV's replacement as a layer task: at block ℓ, the last prompt token only,
        h ← h + (−I) h + θ_ℓ = θ_ℓ (a rank-d map and a bias: exact, and d × d floats)."""
        from ltv_vllm.core.layer_task import LayerPolicy, LayerTask

        layer = int(art.params["layer"])
        theta = art.tensors["theta"][layer].float()
        eye = torch.eye(theta.shape[0])
        return LayerTask((layer,), theta[None], -eye[None], eye[None], art.model,
                         LayerPolicy.parse("last"), tuple(art.label_token_ids),
                         art.provenance)


def _check_layer(layer: int, n: int) -> int:
    if not 0 <= layer < n:
        raise MethodError(f"--layer {layer} is out of range: the model has {n} layers (0..{n - 1})")
    return layer
