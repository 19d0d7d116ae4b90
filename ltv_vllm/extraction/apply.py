"""Reference application in transformers: the ground truth the vLLM path is tested against.

`task_vector_applied(model, tv)` hooks the LM head for the duration of a `with` block:
  hidden kind: the LM head's input h (post-norm, every position it is given) becomes
               h + U (Vᵀ h) (+ bias), before the projection;
  logit kind:  U (Vᵀ h) (+ bias) is added to the LM head's output.
Because generation calls the LM head at every step, multi-token outputs get the shift on
every generated token (the paper's regression setting), not only on the first. The hook
always removes itself; the caller's model is never modified.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ltv_vllm.core.vector import TaskVector, model_identity
from ltv_vllm.extraction.capture import lm_head


@contextmanager
def task_vector_applied(
    model: nn.Module, tv: TaskVector, *, check: bool = True
) -> Iterator[nn.Module]:
    head = lm_head(model)  # type: ignore[arg-type]
    if check:
        tv.check_model(model_identity(model))
    # The single explicit point where the float32 CPU vector meets the model.
    cast = tv.to(head.weight.device, head.weight.dtype)
    delta = cast.delta

    if tv.kind == "hidden":

        def pre_hook(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            h = args[0]
            return (h + delta(h), *args[1:])

        handle = head.register_forward_pre_hook(pre_hook)
    else:

        def post_hook(_mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            return out + delta(args[0])

        handle = head.register_forward_hook(post_hook)
    try:
        yield model
    finally:
        handle.remove()


@torch.no_grad()
def generate_with_task_vector(
    model: Any,
    tokenizer: Any,
    prompt: str,
    tv: TaskVector | None,
    *,
    max_new_tokens: int = 16,
) -> str:
    """Greedy generation with the shift on every step (reference for serving tests)."""
    enc = tokenizer(prompt, return_tensors="pt").to(next(model.parameters()).device)
    gen = {"max_new_tokens": max_new_tokens, "do_sample": False,
           "pad_token_id": tokenizer.eos_token_id}
    if tv is None:
        out = model.generate(**enc, **gen)
    else:
        with task_vector_applied(model, tv):
            out = model.generate(**enc, **gen)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
