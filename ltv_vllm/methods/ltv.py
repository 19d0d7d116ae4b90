"""LTV (the paper's method) and the constant-mapping baseline, behind the methods interface.

Both are hidden-space maps of h_zs fitted on the same N train pairs, saved as task-vector
files (`ltv_vllm.core.vector`) and applied by the same LM-head hook vLLM mirrors:
  ltv:  h + W* h,  W* = ridge from h_zs to h_icl − h_zs (closed form, λ absolute);
  ltv-auto: the same with λ chosen by closed-form leave-one-out error (no labels);
  kernel: h + A k(S, h), RBF kernel ridge in the dual, γ and λ by the same LOO (`kernel`);
  mean: h + c*,    c* = mean_j (h_icl − h_zs)(x_j) (paper appendix "Constant Mapping").
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ltv_vllm.core.kernel import kernel_fit
from ltv_vllm.core.ridge import head_gram, mean_shift, ridge_fit, truncate
from ltv_vllm.core.vector import TaskVector
from ltv_vllm.extraction.apply import task_vector_applied
from ltv_vllm.methods.base import Context, Method, Option


class LTV(Method):
    name, label = "ltv", "LTV"
    hidden_space = uses_states = True
    color = "tab:blue"
    supports = frozenset({"fused", "folded", "lora", "regression", "generation"})
    compare_with = ("mean",)  # the constant shift: what a map of h buys over a constant
    options = (Option("rank", None, "Cut the fit to this rank (weighted by the LM head; "
                      "`ridge.truncate`) before it is scored and saved.", int, minimum=1),)

    def lam(self, ctx: Context) -> float | str:
        return ctx.opts.lam  # a number, or "auto"

    def extract(self, ctx: Context) -> TaskVector:
        h_zs, h_icl = ctx.states()
        f = ridge_fit(h_zs, h_icl - h_zs, self.lam(ctx))
        if ctx.opts.rank is not None:  # what is scored and saved is the cut
            f = truncate(f, ctx.opts.rank, head_gram=head_gram(ctx.lm_head_weight()))
        extra = {"lam_loo": f.loo.to_dict()} if f.loo else {}
        prov = replace(ctx.provenance(self.name, **extra), lam=f.lam, ridge_form=f.form)
        return TaskVector("hidden", f.U, f.V, None, ctx.identity, tuple(ctx.label_ids), prov,
                          gram=f.gram)

    def applied(self, model, art: TaskVector):
        return task_vector_applied(model, art)

    def shift(self, art: TaskVector, h: torch.Tensor) -> torch.Tensor:
        return art.shift_hidden(h)

    def params(self, art: TaskVector) -> dict[str, float] | None:
        lam = art.provenance.lam
        return {"lam": float(lam)} if lam is not None else None


class LTVAuto(LTV):
    """LTV with λ chosen per episode by ridge's closed-form leave-one-out error on a grid
    scaled to the states (`ridge.loo_curve`): no labels, no refits."""

    name, label = "ltv-auto", "LTV, λ by LOO"
    color = "navy"
    compare_with = ()
    supports = frozenset({"fused", "folded", "lora", "generation"})

    def lam(self, ctx: Context) -> float | str:  # noqa: ARG002 - one signature
        return "auto"


class KernelLTV(LTV):
    """LTV's objective with an RBF kernel map, in closed form (`kernel.kernel_fit`): γ and λ
    by leave-one-out error. A task-vector file (map "rbf"), served fused only."""

    name, label = "kernel", "Kernel LTV (RBF)"
    color = "darkred"
    compare_with = ()
    supports = frozenset({"fused", "generation"})
    options = ()

    def extract(self, ctx: Context) -> TaskVector:
        h_zs, h_icl = ctx.states()
        kf = kernel_fit(h_zs, h_icl - h_zs)
        prov = replace(ctx.provenance(self.name, kernel_loo=kf.loo), lam=kf.lam)
        return TaskVector("hidden", kf.U, kf.V, None, ctx.identity, tuple(ctx.label_ids), prov,
                          map="rbf", gamma=kf.gamma)

    def params(self, art: TaskVector) -> dict[str, float] | None:
        return {"lam": float(art.provenance.lam or 0), "gamma": float(art.gamma or 0)}


class Mean(LTV):
    name, label = "mean", "Mean shift"
    color = "tab:orange"
    compare_with = ()
    supports = frozenset({"fused", "regression", "generation"})
    options = ()

    def extract(self, ctx: Context) -> TaskVector:
        h_zs, h_icl = ctx.states()
        d = h_zs.shape[1]
        empty = torch.zeros(d, 0)  # rank 0: the map is its bias alone
        return TaskVector("hidden", empty, empty.clone(), mean_shift(h_icl - h_zs), ctx.identity,
                          tuple(ctx.label_ids), ctx.provenance(self.name))
