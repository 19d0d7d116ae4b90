"""Per-request shifts on vLLM's V2 model runner.

V2 runs custom logits processors after the LM head, and its raw logprobs are taken before
them, so a shift applied there would miss the raw logprobs; and a logits row is not a
request (rows are reordered every step; under speculative decoding a request owns one row
per draft token). So on V2 the shift stays where it is on V1 — on the hidden states, in the
wrapper's `compute_logits` (`engine.models`) — and its row plan comes from the model's
own state (`get_model_state_cls`, a hook V2 calls and V1 never does): each request's task and
step policy when it enters a slot (`add_request`), and before every real step's forward
(`preprocess_state`) each logits row's request and generated-token index, from the step's
layout on the host (no device sync): row r of request i is position
p = computed_i + scheduled_i − k_i + j (its k_i = drafts + 1 rows, j = 0..k_i − 1), and it
samples generated token g = p + 1 − prompt_len, shifted when 0 ≤ g < n (every g ≥ 0 for
"all"). A non-final prefill chunk's row has g < 0 (its sample is discarded) and is left
alone. On the CPU the host layout is checked against the runner's own row → slot map.

Under speculative decoding the host's counts are an upper bound, not the truth: with async
scheduling the scheduler counts a step's drafts as computed before it learns how many were
accepted, and V2 corrects the positions on the device. So with a speculative config the host
plans only which task each row's request has (every row of a request whose policy shifts
anything), and which of those rows are at a shifted step is decided on the device from the
step's own positions (`step_mask`: g from `positions[logits_indices]`, no sync); the delta of
a row outside its policy is multiplied by 0. On the CPU (no async scheduling there) the
device's answer is checked against the host's.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from ltv_vllm.serving.engine.layer_shift import Span, token_plan
from ltv_vllm.serving.engine.steps import (
    ALL,
    LAYER,
    PLAN,
    STORE,
    RequestShift,
    RowPlanError,
    readout_of,
    row_index,
)

# Test-only switch: "1" skips the CPU's check of the device's step mask against the host's
# plan, so a CPU test runs the speculative path as a GPU runs it (where the check cannot
# run) and must catch a wrong mask by its own answers (tests/test_v2_runner.py). Never set
# in serving.
NO_MASK_CHECK_ENV = "LTV_TEST_NO_MASK_CHECK"


class LTVModelState(DefaultModelState):
    """vLLM's default model state, plus each slot's shift and this step's row plan."""

    layer_slots: dict[int, Any] = {}  # (each engine's own, made in __init__)

    def __init__(self, vllm_config: Any, model: Any, encoder_cache: Any, device: Any) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.shift = RequestShift(vllm_config, STORE)
        # slot → (task key, shifted tokens n or None for all, prompt length)
        self.slots: dict[int, tuple[str, int | None, int]] = {}
        self.readouts: dict[int, tuple[int, ...]] = {}  # slot → its readout (`READOUT_KEY`)
        self.layer_slots: dict[int, Any] = {}  # slot → a layer task's positions
        # drafts make the host's counts an upper bound: decide the steps on the device
        self.on_device = getattr(vllm_config, "speculative_config", None) is not None
        self.mask_check = os.environ.get(NO_MASK_CHECK_ENV) != "1"

    def add_request(self, req_index: int, new_req_data: Any) -> None:
        super().add_request(req_index, new_req_data)
        params = new_req_data.sampling_params
        self.readouts.pop(req_index, None)
        if params is None:  # pooling: nothing is sampled
            self.slots.pop(req_index, None)
            return
        readout = readout_of(params)
        if readout:
            self.readouts[req_index] = readout
        task, n = self.shift.of(params)
        # the prompt's own length (token ids or embeddings), as V2's request states take it:
        # a request resumed after preemption is prefilled with its outputs too
        self.slots[req_index] = (task, n, int(new_req_data.prompt_len))
        # (positions, parts) or None
        ask = self.shift.layer_of(params, LAYER.tasks, LAYER.shift is not None)
        if ask is None:
            self.layer_slots.pop(req_index, None)
        else:
            self.layer_slots[req_index] = ask

    def preprocess_state(self, input_batch: Any, *args: Any, **kwargs: Any) -> None:
        super().preprocess_state(input_batch, *args, **kwargs)
        if self.layer_slots:
            LAYER.ready = self.layer_plan(input_batch)
        PLAN.ready_readout = readout_rows(input_batch, self.readouts) if self.readouts else {}
        if not self.on_device:
            PLAN.ready, PLAN.rows = row_plan(input_batch, self.slots)
            PLAN.ready_mask = None
            return
        PLAN.ready, PLAN.rows, prompt_len, n = row_plan(input_batch, self.slots,
                                                        every_step=True)
        mask = step_mask(input_batch.positions, input_batch.logits_indices[:PLAN.rows],
                         row_index(prompt_len, input_batch.positions.device),
                         row_index(n, input_batch.positions.device))
        if self.mask_check and mask.device.type == "cpu":
            # free on the CPU, where the host's counts are exact (no async scheduling)
            host = row_plan(input_batch, self.slots)[0]
            if _rows_of(host, PLAN.rows) != mask.tolist():
                raise RowPlanError("ltv-vllm: the V2 step's shifted rows on the device differ "
                                   "from the host's plan")
        PLAN.ready_mask = mask


    def layer_plan(self, batch: Any) -> tuple[Any, int]:
        """This step's layer-task rows (`engine.layer_shift`) from its host layout: request
        i's tokens start at `query_start_loc[i]`, at position `num_computed_tokens[i]`."""
        spans = []
        qsl = batch.query_start_loc_np
        for i in range(batch.num_reqs):
            slot = int(batch.idx_mapping_np[i])
            ask = self.layer_slots.get(slot)
            if ask is None:
                continue
            if self.on_device:
                # the host's counts are an upper bound with drafts (module docstring)
                raise RowPlanError("ltv-vllm: layer tasks do not run with speculative "
                                   "decoding")
            _task, _n, prompt_len = self.slots[slot]
            policy, parts = ask
            spans.append(Span(parts, policy, prompt_len, int(qsl[i]),
                              int(batch.num_scheduled_tokens[i]),
                              int(batch.num_computed_tokens_np[i])))
        return token_plan(spans), int(qsl[batch.num_reqs])


def row_plan(batch: Any, slots: dict[int, tuple[str, int | None, int]], *,
             every_step: bool = False) -> Any:
    """This step's shift (task key → its logits rows; None: every row) and its row count,
    from the step's layout (module docstring). `every_step`: every row of a request whose
    policy shifts any token, and each row's prompt length and n (-1: all) for `step_mask`."""
    cu = batch.cu_num_logits_np
    groups: dict[str, list[int]] = {}
    row_slots: list[int] = []
    row_prompt: list[int] = []
    row_n: list[int] = []
    for i in range(batch.num_reqs):
        slot = int(batch.idx_mapping_np[i])
        if slot not in slots:
            raise RowPlanError(f"ltv-vllm: V2 slot {slot} was never added: its shift is "
                               "unknown")
        task, n, prompt_len = slots[slot]
        k = int(cu[i + 1] - cu[i])
        last = int(batch.num_computed_tokens_np[i] + batch.num_scheduled_tokens[i]) - 1
        for j in range(k):
            g = last - (k - 1) + j + 1 - prompt_len
            row_slots.append(slot)
            if every_step:
                row_prompt.append(prompt_len)
                row_n.append(-1 if n is ALL else n)
                if n is ALL or n > 0:
                    groups.setdefault(task, []).append(int(cu[i]) + j)
            elif g >= 0 and (n is ALL or g < n):
                groups.setdefault(task, []).append(int(cu[i]) + j)
    rows = int(cu[batch.num_reqs])
    mapping = batch.expanded_idx_mapping
    if mapping.device.type == "cpu" and mapping[:rows].tolist() != row_slots:
        # free on the CPU: the host layout must be the runner's own row → slot map
        raise RowPlanError("ltv-vllm: the V2 step's logits rows are not laid out as "
                           "planned (vLLM's row → slot map differs)")
    plan: dict[str, list[int] | None] = dict(groups)
    if len(groups) == 1:
        (task, members), = groups.items()
        if len(members) == rows:
            plan = {task: None}
    if every_step:
        return plan, rows, row_prompt, row_n
    return plan, rows


def readout_rows(batch: Any, readouts: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Every logits row of a request with a readout (all its sampled steps keep only those
    tokens; drafts' rows included), from the step's layout on the host."""
    cu = batch.cu_num_logits_np
    out: dict[int, tuple[int, ...]] = {}
    for i in range(batch.num_reqs):
        ids = readouts.get(int(batch.idx_mapping_np[i]))
        if ids:
            out.update((r, ids) for r in range(int(cu[i]), int(cu[i + 1])))
    return out


def step_mask(positions: torch.Tensor, logits_indices: torch.Tensor,
              prompt_len: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Which logits rows are at a shifted step, from the step's own positions: a row at
    position p samples generated token g = p + 1 − prompt_len, shifted when 0 ≤ g < n
    (n < 0: every g ≥ 0). Pure tensor maths on the engine's device. (rows,) bool"""
    g = positions.index_select(0, logits_indices).long() + 1 - prompt_len
    return (g >= 0) & ((n < 0) | (g < n))


def _rows_of(plan: dict[str, list[int] | None], rows: int) -> list[bool]:
    """A plan's shifted rows as a mask (the CPU check of `step_mask`)."""
    out = [False] * rows
    for members in plan.values():
        for r in (range(rows) if members is None else members):
            out[r] = True
    return out

