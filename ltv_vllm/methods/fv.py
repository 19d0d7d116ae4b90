"""Function Vector (Todd et al. 2023, ericwtodd/function_vectors), re-implemented.

1. Mean head activations ā_ℓj: the input of o_proj, split per head, at the last token of
   clean ICL prompts (the episode's demos + train queries; the paper: 20 trials).
2. Causal indirect effect of each head (ℓ, j): on prompts whose demo labels are shuffled,
   patch that head's slice of o_proj's input at the last token with ā_ℓj and measure the
   rise in the probability (full vocabulary) of the query's correct label token; averaged
   over trials (the original: 25 shuffled-label prompts).
3. FV = Σ over the top-10 heads of o_proj_ℓ(ā_ℓj with every other head zero) (no bias).
4. Inference: FV is added to the output of decoder layer ℓ* at the last position, ℓ* the
   layer with the best accuracy on the labelled validation examples (the paper's text; its
   released runner fixes ℓ* and the heads instead).

The sweep patches only the last position, so every earlier position's keys and values are
those of the unpatched run: each trial runs its prompt minus the last token once and then
only the last token, once per head (`fast=True`); `fast=False` is the naive sweep (one full
patched forward per head), kept as the reference the fast one is tested against.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from ltv_vllm.core.vector import model_identity
from ltv_vllm.methods.artifact import Artifact
from ltv_vllm.methods.base import (
    Context,
    Method,
    MethodError,
    Option,
    at_last,
    attention,
    choose_on_val,
    decoder_layers,
    edits,
    full_log_probs,
    head_dim,
    last_token_states,
    prefix_of,
    records,
    run_after,
)
from ltv_vllm.methods.tv import _check_layer


@contextmanager
def patched_heads(model, mean_act: torch.Tensor, layer: torch.Tensor,
                  head: torch.Tensor) -> Iterator[None]:
    """Row r: head head[r] of layer layer[r] gets its mean activation at the last position
    (the slice of o_proj's input). mean_act: (L, H, hd)."""
    layers = decoder_layers(model)
    n_heads, hd = mean_act.shape[1:]

    def edit(x: torch.Tensor, ell: int, rows: torch.Tensor) -> torch.Tensor:
        # every index on the activations' device: an index_put_ with CPU indices into a
        # CUDA tensor is refused ("Expected all tensors to be on the same device")
        rows = rows.to(x.device)
        heads = head.to(x.device)[rows]
        y = x.clone()
        sub = y[rows, -1].view(len(rows), n_heads, hd)
        sub[torch.arange(len(rows), device=x.device), heads] = (
            mean_act.to(x.device)[ell, heads].to(x.dtype))
        y[rows, -1] = sub.view(len(rows), n_heads * hd)
        return y

    plan = {int(ell): (layer == ell).nonzero().flatten() for ell in layer.unique()}
    with edits(inputs=[(attention(layers[ell]).o_proj,
                        lambda x, ell=ell, rows=rows: edit(x, ell, rows))
                       for ell, rows in plan.items()]):
        yield


def shuffled_prompts(ctx: Context) -> list[tuple[str, int]]:
    """The corrupted trials: the demos with their labels permuted, then a train query (not
    one of the clean prompts' where the episode has enough); (prompt, correct label index)."""
    ep, o = ctx.episode, ctx.opts
    task = ep.task
    g = torch.Generator().manual_seed(o.seed)
    out = []
    for t in range(o.fv_trials):
        labels = [e.label for e in ep.demos]
        perm = torch.randperm(len(labels), generator=g).tolist()
        prefix = "".join(task.demo(e.text, labels[p]) for e, p in zip(ep.demos, perm, strict=True))
        q = ep.queries[(o.fv_prompts + t) % len(ep.queries)]
        out.append((prefix + task.query(q.text), q.label))
    return out


def indirect_effects(ctx: Context, mean_act: torch.Tensor, trials: list[tuple[str, int]], *,
                     fast: bool = True, layers: list[int] | None = None) -> torch.Tensor:
    """Average indirect effect of patching each head's mean activation: (L, H); only the
    heads of `layers` when given (the rest stay 0: a partial sweep, for benchmarks)."""
    cap = ctx.cap
    n_layers, n_heads = mean_act.shape[:2]
    layer = torch.arange(n_layers).repeat_interleave(n_heads)  # every (ℓ, j), ℓ-major
    head = torch.arange(n_heads).repeat(n_layers)
    keep = torch.ones(len(layer), dtype=torch.bool)
    if layers is not None:
        keep = torch.isin(layer, torch.tensor(layers))
    cie = torch.zeros(n_layers * n_heads, dtype=torch.float64)
    for prompt, label in tqdm(trials, desc="fv: indirect effects", unit="trial",
                              disable=not ctx.opts.progress, leave=False):
        ids = cap.encode(prompt)
        target = ctx.label_ids[label]
        pre = prefix_of(cap, ids[:-1]) if fast else None
        if fast:
            p0 = full_log_probs(cap, last_token_states(cap, ids, 1, pre))[0, target].exp()
        else:
            full = torch.tensor([ids])
            h0 = cap.forward_last(full, torch.ones_like(full))
            p0 = full_log_probs(cap, h0)[0, target].exp()
        chunks = keep.nonzero().flatten().split(ctx.opts.batch_size if fast else 1)
        for rows in chunks:
            with patched_heads(cap.model, mean_act, layer[rows], head[rows]):
                if fast:
                    h = last_token_states(cap, ids, len(rows), pre)
                else:
                    h = cap.forward_last(full, torch.ones_like(full))
            cie[rows] += full_log_probs(cap, h)[:, target].exp() - p0
    return (cie / max(1, len(trials))).view(n_layers, n_heads).float()


def mean_head_activations(ctx: Context) -> torch.Tensor:
    """ā (L, H, hd): o_proj inputs at the last token of the clean ICL prompts, averaged."""
    ep = ctx.episode
    layers = decoder_layers(ctx.model)
    n_heads, hd = head_dim(ctx.model)
    clean = ep.queries[: ctx.opts.fv_prompts]
    prefix = ep.demo_prefix()
    pre = ctx.cap.encode_prefix(prefix)
    with records(inputs=[attention(layer).o_proj for layer in layers]) as (_, ins):
        for e in clean:
            run_after(ctx.cap, pre, prefix, ep.task.query(e.text))
    return torch.stack([torch.cat(i).mean(0) for i in ins]).view(len(layers), n_heads, hd)


def function_vector(model, mean_act: torch.Tensor, heads: list[tuple[int, int]]) -> torch.Tensor:
    """Σ over heads of o_proj_ℓ applied to ā_ℓj alone (other heads zero; no bias). (d,)"""
    layers = decoder_layers(model)
    hd = mean_act.shape[2]
    fv = torch.zeros(model.config.hidden_size, dtype=torch.float64)
    for ell, j in heads:
        w = attention(layers[ell]).o_proj.weight.detach().double().cpu()
        fv += w[:, j * hd:(j + 1) * hd] @ mean_act[ell, j].double()
    return fv.float()


class FV(Method):
    name, label = "fv", "Function Vector"
    needs_val = True
    color = "tab:brown"
    options = (
        Option("fv_prompts", 20, "FV: clean ICL prompts its mean head activations come from "
               "(the paper: 20).", minimum=1),
        Option("fv_trials", 25, "FV: shuffled-label prompts its heads' indirect effect is "
               "averaged over (the original: 25).", minimum=1),
        Option("fv_heads", 10, "FV: top heads by average indirect effect.", minimum=1),
    )

    def extract(self, ctx: Context) -> Artifact:
        o = ctx.opts
        if not ctx.episode.queries:
            raise MethodError("fv: the episode has no train queries for its ICL prompts")
        mean_act = mean_head_activations(ctx)
        cie = indirect_effects(ctx, mean_act, shuffled_prompts(ctx))
        n_layers, n_heads = cie.shape
        top = cie.flatten().topk(min(o.fv_heads, cie.numel())).indices.tolist()
        heads = [(i // n_heads, i % n_heads) for i in top]
        fv = function_vector(ctx.model, mean_act, heads)
        every = fv.expand(n_layers, -1)
        if o.layer is not None:
            layer, scores = _check_layer(o.layer, n_layers), []
        else:
            layer, scores = choose_on_val(ctx, list(range(n_layers)),
                                          lambda idx: at_last(ctx.model, every, idx, add=True),
                                          "fv: layer on val")
        return Artifact(self.name, {"fv": fv, "indirect_effect": cie},
                        {"layer": int(layer), "heads": [list(h) for h in heads],
                         "prompts": min(o.fv_prompts, len(ctx.episode.queries)),
                         "trials": o.fv_trials, "val_accuracy": scores},
                        ctx.identity, tuple(ctx.label_ids), ctx.provenance(self.name))

    def layer_task(self, art: Artifact):
        """FV as a layer task: added to block ℓ's output at the last prompt token."""
        from ltv_vllm.core.layer_task import LayerPolicy, LayerTask

        return LayerTask((int(art.params["layer"]),), art.tensors["fv"].float().reshape(1, -1),
                         None, None, art.model, LayerPolicy.parse("last"),
                         tuple(art.label_token_ids), art.provenance)

    @contextmanager
    def applied(self, model, art: Artifact):
        art.check_model(model_identity(model))
        n_layers = len(decoder_layers(model))
        fv = art.tensors["fv"].expand(n_layers, -1)
        with at_last(model, fv, int(art.params["layer"]), add=True):
            yield model
