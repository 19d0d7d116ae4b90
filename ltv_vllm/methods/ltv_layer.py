"""LTV at layer ℓ: the paper's ridge map fitted to the residual stream leaving decoder block ℓ
instead of the final state, served as a layer task (`core.layer_task`).

    h_zs^ℓ, h_icl^ℓ   block ℓ's output at the query's last token, zero-shot and after the demos
    W_ℓ = ridge(h_zs^ℓ → h_icl^ℓ − h_zs^ℓ), closed form, λ absolute or by leave-one-out
    applied at the last prompt token (policy "last": the row producing the first generated
    token, as the final-layer vector's default "first"): h_ℓ ← h_ℓ + W_ℓ h_ℓ

One pass over the N train queries gives every block's states (`Capturer.tapping`); ℓ is
`--layer`, else the block whose fit scores best on the episode's labelled validation
examples (as TV chooses its layer). The target is the ICL states themselves: the gold-label
blend (`core.teacher`) moves final states along the LM head's label rows, which a block in
the middle of the model does not read, so it is not offered here.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from ltv_vllm.core.layer_task import LayerPolicy, LayerTask
from ltv_vllm.core.ridge import Factors, ridge_fit
from ltv_vllm.extraction.capture import icl_states, zero_shot_states
from ltv_vllm.extraction.layer_apply import layer_task_applied
from ltv_vllm.methods.base import (
    Context,
    Method,
    MethodError,
    choose_on_val,
    decoder_layers,
    edits,
)

POLICY = LayerPolicy.parse("last")


def layer_states(ctx: Context, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(h_zs, h_icl) of the N train queries at every block in `layers`: (L, N, d) each, and
    the seconds their one capture took."""
    cap, ep = ctx.cap, ctx.episode
    if cap is None:
        raise MethodError("ltv-layer runs the model, and only its final states are at hand")
    task = ep.task
    d = int(ctx.model.config.hidden_size)
    t0 = time.perf_counter()
    with cap.tapping(layers):
        zs = zero_shot_states(cap, task, [e.text for e in ep.queries],
                              desc=f"{task.name} zero-shot train, {len(layers)} blocks")
        icl = icl_states(cap, ep, [task.query(e.text) for e in ep.queries],
                         desc=f"{task.name} icl train, {len(layers)} blocks")

    def split(h: torch.Tensor) -> torch.Tensor:  # (N, (L + 1) d) → (L, N, d), final dropped
        return h[:, : len(layers) * d].reshape(h.shape[0], len(layers), d).transpose(0, 1)

    return split(zs), split(icl), time.perf_counter() - t0


def task_for(ctx: Context, layer: int, f: Factors, prov_extra: dict) -> LayerTask:
    prov = replace(ctx.provenance("ltv-layer", **prov_extra), lam=f.lam, ridge_form=f.form)
    return LayerTask(layers=(layer,), bias=None, U=f.U[None].float(), V=f.V[None].float(),
                     model=ctx.identity, policy=POLICY, label_token_ids=tuple(ctx.label_ids),
                     provenance=prov)


class LayerLTV(Method):
    name, label = "ltv-layer", "LTV at layer ℓ"
    needs_val = True  # unless --layer fixes ℓ
    color = "teal"
    supports = frozenset({"layer"})  # a layer-task file

    def extract(self, ctx: Context) -> LayerTask:
        n = len(decoder_layers(ctx.model))
        fixed = ctx.opts.layer
        if fixed is not None and not 0 <= fixed < n:
            raise MethodError(f"--layer {fixed} is out of range: the model has {n} layers "
                              f"(0..{n - 1})")
        candidates = [fixed] if fixed is not None else list(range(n))
        h_zs, h_icl, seconds = layer_states(ctx, candidates)
        fits = {ell: ridge_fit(h_zs[i], h_icl[i] - h_zs[i], ctx.opts.lam)
                for i, ell in enumerate(candidates)}
        if fixed is not None:
            layer, scores = fixed, []
        else:
            layer, scores = choose_on_val(ctx, candidates, lambda rows: _at_rows(ctx, fits, rows),
                                          "ltv-layer: layer on val")
        extra = {"layer": layer, "capture_seconds": seconds}
        if scores:
            extra["val_accuracy"] = scores
        return task_for(ctx, layer, fits[layer], extra)

    def applied(self, model, art: LayerTask):
        return layer_task_applied(model, art)

    def layer_task(self, art: LayerTask) -> LayerTask:
        return art

    def params(self, art: LayerTask) -> dict:
        out = {"layer": int(art.layers[0])}
        if art.provenance.lam is not None:
            out["lam"] = float(art.provenance.lam)
        if "val_accuracy" in art.provenance.extra:
            out["val_accuracy"] = art.provenance.extra["val_accuracy"]
        return out


@contextmanager
def _at_rows(ctx: Context, fits: dict[int, Factors], rows: torch.Tensor):
    """Candidate r's map applied at its own block, row r's last position (`choose_on_val`)."""
    layers = decoder_layers(ctx.model)

    def edit(x: torch.Tensor, ell: int, mask: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        h = x[mask, -1].float()
        f = fits[ell]  # on the host; the map meets h on the model's device, in float32
        delta = (h @ f.V.to(h.device)) @ f.U.to(h.device).T
        y[mask, -1] = (h + delta).to(x.dtype)
        return y

    plan = {int(ell): (rows == ell) for ell in rows.unique()}
    with edits(outputs=[(layers[ell], lambda x, ell=ell, m=m: edit(x, ell, m.to(x.device)))
                        for ell, m in plan.items()]):
        yield
