"""State Vector (Li et al. 2024, HITsz-TMG/ICL-State-Vector; "inner optimisation"), re-implemented.

Extraction: one ICL prompt, the episode's demos + a dummy query (a train query). The state
at a separator is the attention activation there (o_proj's input, every head) in each
layer; a demo's separator is the last token of its query part (`…{label_prefix}:`, where
the label is predicted), and the dummy query's is the prompt's last token. Inner
optimisation averages the states of the last m separators (the original: m = 7, the last
six demos and the dummy query) per layer.
Inference: in the first L′ layers the attention activation at the query's separator (its
last token) is replaced by the state — the original's `add#0#1` intervention, 0·own + 1·state;
the paper's text says "added", `mode="add"` does that. L′ is chosen on the labelled
validation examples.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ltv_vllm.core.vector import model_identity
from ltv_vllm.methods.artifact import Artifact
from ltv_vllm.methods.base import (
    Context,
    Method,
    MethodError,
    Option,
    attention,
    choose_on_val,
    decoder_layers,
    edits,
    records,
    set_last,
)

DEFAULT_LAST = 7  # the original's "fixed" inner optimiser averages the last 7 separators


def separator_positions(cap, task, demos, dummy_text: str) -> tuple[list[int], list[int]]:
    """Token ids of demos + dummy query, and the index of each separator token in them (one
    per demo, then the last token)."""
    prompt, ends = "", []
    for e in demos:
        ends.append(len(prompt) + len(task.query(e.text)))  # the char after "{label_prefix}:"
        prompt += task.demo(e.text, e.label)
    prompt += task.query(dummy_text)
    enc = cap.tokenizer(prompt, return_offsets_mapping=True)
    ids = cap.encode(prompt)
    offsets = enc["offset_mapping"]
    pos = []
    for end in ends:  # the token holding the separator's last character
        hit = [i for i, (a, b) in enumerate(offsets) if a < end <= b]
        if not hit:
            raise MethodError(f"sv: no token ends the separator {task.label_prefix + ':'!r}")
        pos.append(hit[0])
    return ids, [*pos, len(ids) - 1]


@contextmanager
def states_at_last(model, sv: torch.Tensor, depth: int | torch.Tensor, *,
                   add: bool = False) -> Iterator[None]:
    """In layers ℓ < depth, o_proj's input at the last position := sv[ℓ] (or += with `add`);
    `depth` an int (every row) or one depth per batch row."""
    layers = decoder_layers(model)
    if isinstance(depth, int):
        plan: dict[int, torch.Tensor | None] = dict.fromkeys(range(depth))
    else:
        plan = {ell: depth > ell for ell in range(int(depth.max()))}
    with edits(inputs=[(attention(layers[ell]).o_proj,
                        lambda x, ell=ell, rows=rows: set_last(x, rows, sv[ell], add=add))
                       for ell, rows in plan.items()]):
        yield


class SV(Method):
    name, label = "sv", "State Vector"
    needs_val = True
    color = "tab:pink"
    options = (Option("sv_last", None, "SV: average only the last m demos' states [default: "
                      f"{DEFAULT_LAST}].", int, minimum=1),)
    mode = "replace"

    def extract(self, ctx: Context) -> Artifact:
        ep, o = ctx.episode, ctx.opts
        if not ep.queries:
            raise MethodError("sv: the episode has no train query to use as the dummy query")
        layers = decoder_layers(ctx.model)
        ids, pos = separator_positions(ctx.cap, ep.task, ep.demos, ep.queries[0].text)
        last = min(o.sv_last or DEFAULT_LAST, len(pos))
        at = torch.tensor(pos[-last:])
        with records(inputs=[attention(layer).o_proj for layer in layers],
                     positions=lambda x: x[0, at.to(x.device)]) as (_, ins):
            t = torch.tensor([ids])
            ctx.cap.forward_last(t, torch.ones_like(t))
        sv = torch.stack([i[0].mean(0) for i in ins])  # (L, heads · head_dim)
        if o.layer is not None:
            if not 1 <= o.layer <= len(layers):
                raise MethodError(f"--layer (SV's depth L′) must be in 1..{len(layers)}, "
                                  f"got {o.layer}")
            depth, scores = o.layer, []
        else:
            depth, scores = choose_on_val(
                ctx, list(range(1, len(layers) + 1)),
                lambda d: states_at_last(ctx.model, sv, d, add=self.mode == "add"),
                "sv: depth on val")
        return Artifact(self.name, {"sv": sv},
                        {"depth": int(depth), "averaged": last, "mode": self.mode,
                         "val_accuracy": scores},
                        ctx.identity, tuple(ctx.label_ids), ctx.provenance(self.name))

    @contextmanager
    def applied(self, model, art: Artifact):
        art.check_model(model_identity(model))
        with states_at_last(model, art.tensors["sv"], int(art.params["depth"]),
                            add=art.params.get("mode") == "add"):
            yield model
