"""What transformers answers for every mode a serving benchmark serves, on its own queries.

A vLLM mode's accuracy is read against this row: the same prompts through transformers in
float32, the method applied to the final state as `apply.task_vector_applied` does — zero-
shot, ICL (the demo prefix's KV cache shared, `Capturer.icl`), the linear vector (what
`ltv-fused`, `ltv-folded` and full-rank `ltv-lora` serve), its rank-R cut (`ltv-lora-rR`,
`TaskVector.truncated` with the LM head, as `serve.plan_lora` cuts it) and the kernel vector
(`kernel-fused`). A mode served in bf16 that drifts from its float32 reference shows here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ltv_vllm.bench.modes import lora_mode_rank
from ltv_vllm.bench.workload import Workload
from ltv_vllm.core.vector import TaskVector, load_task_vector


def _method(mode: str) -> tuple[str, int | None]:
    """The method a mode serves: ('zero-shot' | 'icl' | 'ltv' | 'kernel', rank cut)."""
    if mode.startswith("zero-shot"):
        return "zero-shot", None
    if mode.startswith("icl"):
        return "icl", None
    if mode == "kernel-fused":
        return "kernel", None
    is_lora, cap = lora_mode_rank(mode)
    return "ltv", cap if is_lora else None


def transformers_reference(wl: Workload, modes: Sequence[str], *,
                           log: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Per mode: accuracy, accuracy per task and the predicted label of every query (in
    workload order), from transformers in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ltv_vllm.extraction.capture import Capturer, label_head

    log("transformers reference (float32): the same queries for every mode")
    model = AutoModelForCausalLM.from_pretrained(wl.model_dir, dtype=torch.float32).eval()
    cap = Capturer(model, AutoTokenizer.from_pretrained(wl.model_dir), progress=False)
    lm_w = model.get_output_embeddings().weight.detach().float()
    by_task: dict[str, list[Any]] = {}
    for q in wl.queries:
        by_task.setdefault(q.task, []).append(q)
    h_zs = {t: cap.hidden([q.zs for q in qs], desc=f"{t} zero-shot")
            for t, qs in by_task.items()}
    h_icl: dict[str, torch.Tensor] = {}
    preds: dict[tuple[str, int | None], dict[int, int]] = {}
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        method, cap_rank = _method(mode)
        key = (method, cap_rank)
        if key not in preds:
            preds[key] = {}
            for t, qs in by_task.items():
                w, b = label_head(model, wl.label_ids[t])
                if method == "icl":
                    if t not in h_icl:
                        prefix = qs[0].icl[: len(qs[0].icl) - len(qs[0].zs)]
                        h_icl[t] = cap.icl(prefix, [q.zs for q in qs], desc=f"{t} icl")
                    z = h_icl[t] @ w.T + b
                elif method == "zero-shot":
                    z = h_zs[t] @ w.T + b
                else:
                    tv = load_task_vector((wl.kernel_vectors if method == "kernel"
                                           else wl.vectors)[t])
                    if cap_rank is not None and tv.rank > cap_rank:
                        tv = tv.truncated(cap_rank, lm_head=lm_w)
                    z = _shifted_label_logits(tv, h_zs[t], w, b, wl.label_ids[t])
                for q, row in zip(qs, z, strict=True):
                    preds[key][q.qid] = int(row.argmax())
        p = preds[key]
        right = {t: sum(p[q.qid] == q.gold for q in qs) / len(qs) for t, qs in by_task.items()}
        out[mode] = {"accuracy": sum(p[q.qid] == q.gold for q in wl.queries) / len(wl.queries),
                     "accuracy_per_task": right,
                     "predictions": [p[q.qid] for q in wl.queries]}
    return out


def _shifted_label_logits(tv: TaskVector, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                          label_ids: list[int]) -> torch.Tensor:
    """Label logits with the vector applied: W_C (h + Δ(h)) + b_C for a hidden-space map,
    W_C h + b_C + Δ(h)_C for a logit-space one. (n, K)"""
    v = tv.to("cpu", torch.float32)
    if tv.kind == "hidden":
        return v.shift_hidden(h) @ w.T + b
    return h @ w.T + b + v.delta(h, rows=torch.tensor(label_ids))
