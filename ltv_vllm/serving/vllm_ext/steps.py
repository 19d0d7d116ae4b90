"""Which generated tokens a request's task vector shifts: a per-request step policy.

A request sets it with `vllm_xargs` (`SamplingParams.extra_args`):

    {"ltv_steps": "all"}     every generated token (the default unless `serve --shift-steps`)
    {"ltv_steps": "first"}   the first generated token only (same as 1)
    {"ltv_steps": n}         the first n generated tokens (0: none, the bare model)

A vector shifted at every token ruins free text; shifted at the first token only it answers
like ICL and then writes on as the model would (`benchmarks/step_policy.py`).

How the wrapper learns each row's policy: `compute_logits(h)` sees rows, not requests, so a
logits processor (`LTVStepPolicy`, registered with the engine's `logits_processors`) keeps,
per slot of the persistent batch, the request's policy and a live reference to its output
tokens (vLLM's V1 `BatchUpdate`); its `update_state`, which vLLM calls before every forward
pass, arms a row plan, and the wrapper's next `compute_logits` takes it (once: later calls
in the same step, e.g. prompt logprobs, shift every row as before). In V1 the main call's
rows are the batch's slots in order (`logits_indices`, one per request), which is what the
plan is checked against (row count). The processor never changes the logits.

Relies on vLLM 0.32's V1 model runner (what its CPU backend runs). The GPU build's V2 runner
has another processor interface and is not wired yet: there the class is not loaded and a
request with `ltv_steps` is refused by `validate_params` only where this processor is
registered (`serve.step_processor`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from ltv_vllm.serving.step_policy import ALL, DEFAULT_KEY, STEPS_KEY, parse_steps


class _Plan:
    """This process's row plan: armed by the processor, taken once by the wrapper."""

    def __init__(self) -> None:
        self.source: LTVStepPolicy | None = None
        self.armed = False


PLAN = _Plan()


def take_step_mask(rows: int, device: torch.device) -> torch.Tensor | None:
    """(rows, 1) float mask of the rows to shift in this step's main `compute_logits` call,
    or None: shift every row (no processor, no request with a policy, or not the main call)."""
    src = PLAN.source
    if src is None or not PLAN.armed:
        return None
    PLAN.armed = False
    if not src.rows or rows != src.batch_size:
        return None
    keep = [1.0] * rows
    for i, (n, out) in src.rows.items():
        if i < rows and n is not ALL and len(out) >= n:
            keep[i] = 0.0
    return torch.tensor(keep, device=device)[:, None]


class LTVStepPolicy(LogitsProcessor):
    """Tracks each request's `ltv_steps` for the wrapper (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        args = sampling_params.extra_args or {}
        if STEPS_KEY in args:
            parse_steps(args[STEPS_KEY])  # a bad value: ValueError, an HTTP 400 online

    def __init__(self, vllm_config: Any, device: torch.device,  # noqa: ARG002 - vLLM's
                 is_pin_memory: bool) -> None:  # noqa: ARG002 - signature
        self.rows: dict[int, tuple[int | None, list[int]]] = {}  # slot → (n, output ids)
        self.batch_size = 0
        # the server's default for requests that name none (`serve --shift-steps`)
        hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        self.default = parse_steps(getattr(hf, DEFAULT_KEY, "all"))
        PLAN.source = self  # one input batch per worker process

    def is_argmax_invariant(self) -> bool:
        return True  # it never changes the logits

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def policy(params: SamplingParams, _prompt: Any, out: list[int]) -> Any:
            args = params.extra_args or {}
            n = parse_steps(args[STEPS_KEY]) if STEPS_KEY in args else self.default
            return None if n is ALL else (n, out)  # no entry: every step

        process_dict_updates(self.rows, batch_update, policy)
        if batch_update is not None:
            self.batch_size = batch_update.batch_size
        PLAN.armed = True


class LTVStepsRefused(LTVStepPolicy):
    """Where no per-request policy can work (a vector folded into the LM head shifts every
    token; multi-task LoRA adapters apply at every step): a request that sets `ltv_steps` is
    refused (HTTP 400) rather than silently shifted at every step."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        if STEPS_KEY in (sampling_params.extra_args or {}):
            raise ValueError(f"{STEPS_KEY} needs one fused task vector served without --fold; "
                             "this server shifts every generated token")

    def __init__(self, vllm_config: Any, device: torch.device,  # noqa: ARG002 - vLLM's
                 is_pin_memory: bool) -> None:  # noqa: ARG002 - signature
        self.rows = {}
        self.batch_size = 0

    def update_state(self, batch_update: BatchUpdate | None) -> None:  # noqa: ARG002
        return None  # no request here can carry a policy (validate_params refused it)

