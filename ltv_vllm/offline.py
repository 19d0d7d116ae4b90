"""Offline batch jobs over `vllm.LLM`, no server: an engine with a task vector, classification.

    from ltv_vllm.offline import make_llm, classify_offline
    llm = make_llm("smollm2-135m", "agnews.pt")                # fused vector, checked first
    preds = classify_offline(llm, get_task("agnews"), texts)   # label + restricted probs
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .client import Classification
from .tasks import Task, label_token_ids


def make_llm(
    model_spec: str | None,
    vector: str | Path | None = None,
    *,
    dtype: str = "auto",
    fold: bool = False,
    max_model_len: int | None = None,
    enforce_eager: bool = True,
    tensor_parallel_size: int = 1,
) -> Any:
    """A `vllm.LLM` for the model, with the vector fused (or folded) when one is given."""
    from vllm import LLM

    from .hardware import resolve_for_model
    from .models import resolve_model
    from .serve import engine_kwargs

    model_dir = resolve_model(model_spec)
    dtype = resolve_for_model(dtype, model_dir)
    kwargs: dict[str, Any] = (
        engine_kwargs(model_dir, vector, fold=fold) if vector else {"model": model_dir}
    )
    return LLM(**kwargs, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
               tensor_parallel_size=tensor_parallel_size,
               # logprobs after allowed_token_ids: the label-restricted distribution
               logprobs_mode="processed_logprobs")


def classification_params(label_ids: Sequence[int]) -> Any:
    """One greedy token restricted to the label tokens, with their (renormalised) logprobs."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=len(label_ids),
                          allowed_token_ids=list(label_ids))


def parse_classification(
    output: Any, label_ids: Sequence[int], labels: Sequence[str]
) -> Classification:
    """Label and restricted probabilities from a `RequestOutput` of `classification_params`."""
    top = output.outputs[0].logprobs[0]  # token id → Logprob, restricted to the labels
    lp = {lab: top[i].logprob for i, lab in zip(label_ids, labels, strict=False) if i in top}
    z = sum(math.exp(v) for v in lp.values())
    probs = {lab: math.exp(lp[lab]) / z if lab in lp else 0.0 for lab in labels}
    return Classification(label=max(probs, key=probs.__getitem__), probs=probs)


def classify_offline(llm: Any, task: Task, texts: Sequence[str]) -> list[Classification]:
    """One batched `generate` over all texts; each gets its label and restricted probabilities."""
    ids = label_token_ids(task, llm.get_tokenizer())
    outs = llm.generate([task.query(t) for t in texts], classification_params(ids), use_tqdm=True)
    return [parse_classification(o, ids, task.labels) for o in outs]
