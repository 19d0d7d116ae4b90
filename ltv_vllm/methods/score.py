"""Scoring methods on an episode's test subset, and their inference cost (paper Table 5).

Hidden-space methods are scored on the captured zero-shot test states (their `shift`, no
forward pass); layer methods run the test prompts under their hook. Every method's d_NTP is
KL(P_icl ‖ P_method) over the label tokens against the same episode's ICL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ltv_vllm.core.metrics import accuracy, d_ntp
from ltv_vllm.extraction.capture import label_head, left_pad, positions
from ltv_vllm.methods.base import Context
from ltv_vllm.methods.registry import get_method


@dataclass
class MethodScores:
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # method → (n_test, K)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    extraction_seconds: dict[str, float] = field(default_factory=dict)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # what a method chose
    artifacts: dict[str, Any] = field(default_factory=dict)


def score_methods(ctx: Context, names: Sequence[str], h_zs_test: torch.Tensor,
                  h_icl_test: torch.Tensor, labels: torch.Tensor, *,
                  done: Mapping[str, Mapping[str, Any]] | None = None,
                  on_scored: Callable[[MethodScores], None] | None = None,
                  head: tuple[torch.Tensor, torch.Tensor] | None = None) -> MethodScores:
    """Extract every method in `names` from the episode and score it on the test subset
    (zero-shot and ICL are the references, always scored).

    `done`: methods already scored on this episode by an interrupted pass ({"logits",
    "extraction_seconds", "params"}), taken as they are (no artifact); `on_scored(scores)`
    is called after each method newly scored, so a caller can save the episode so far.
    `head`: the label rows (w_c, b_c) of the LM head, when the context has no model.
    An episode without test examples (a compiled task) is extracted, not scored."""
    w_c, b_c = head if head is not None else label_head(ctx.model, ctx.label_ids)
    task = ctx.episode.task
    prompts = [task.zero_shot(e.text) for e in ctx.episode.test]
    out = MethodScores()
    out.logits["zero-shot"] = h_zs_test @ w_c.T + b_c
    out.logits["icl"] = h_icl_test @ w_c.T + b_c
    for name in names:
        if name in out.logits:
            continue
        if done and name in done:
            out.logits[name] = done[name]["logits"]
            out.extraction_seconds[name] = done[name]["extraction_seconds"]
            if done[name].get("params") is not None:
                out.params[name] = dict(done[name]["params"])
            continue
        m = get_method(name)
        t0 = time.perf_counter()
        art = m.extract(ctx)
        # methods fitted on the shared train states also pay for capturing them
        out.extraction_seconds[name] = (time.perf_counter() - t0
                                        + (ctx.capture_seconds if m.uses_states else 0.0))
        if m.hidden_space:
            h = m.shift(art, h_zs_test)
        elif not prompts:
            h = h_zs_test
        else:
            with m.applied(ctx.model, art):
                h = ctx.cap.hidden(prompts, desc=f"{task.name} {name} test")
        out.logits[name] = h @ w_c.T + b_c
        out.artifacts[name] = art
        params = m.params(art)
        if params is not None:
            out.params[name] = dict(params)
        if on_scored is not None:
            on_scored(out)
    icl = out.logits["icl"]
    out.metrics = {m: {"accuracy": accuracy(z, labels), "d_ntp": d_ntp(icl, z)}
                   for m, z in out.logits.items()} if labels.numel() else {}
    return out


@torch.no_grad()
def inference_cost(ctx: Context, scores: MethodScores, names: Sequence[str], n: int,
                   batch_size: int) -> dict[str, dict[str, float]]:
    """Seconds per test sample of a full forward (the LM head on the last position only) with
    each method applied, at batch 1 (the paper's setting) and batched, all in this one run.
    ICL runs its full prompt with the demos (no cache: what each request would pay)."""
    model, cap = ctx.model, ctx.cap
    task = ctx.episode.task
    texts = [e.text for e in ctx.episode.test[:n]]
    prefix = ctx.episode.demo_prefix()
    out: dict[str, dict[str, float]] = {}

    def run(seqs: list[list[int]], size: int) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(seqs), size):
            ids, mask = left_pad(seqs[i:i + size], cap.pad_id)
            model(input_ids=ids.to(cap.device), attention_mask=mask.to(cap.device),
                  position_ids=positions(mask).to(cap.device), logits_to_keep=1)
        return (time.perf_counter() - t0) / len(seqs)

    for name in names:
        seqs = [cap.encode(prefix + task.query(t) if name == "icl" else task.zero_shot(t))
                for t in texts]
        hook = (nullcontext() if name in ("zero-shot", "icl")
                else get_method(name).applied(model, scores.artifacts[name]))
        with hook:
            run(seqs[:1], 1)  # warm-up: first-call allocations are not the method's cost
            out[name] = {"batch1": run(seqs, 1), "batched": run(seqs, batch_size)}
    return out
