"""Which logits rows of a V2 step are at a shifted step (`vllm_ext.v2`), on a hand-built step.

One step of ten requests as V2 lays it out: full prefills, a non-final prefill chunk, a
final chunk, a request resumed after preemption (prefilled with its outputs), decodes with
and without draft tokens (several rows of one request at consecutive positions, as
speculative decoding gives), rows of the bare model; policies all / first / 2 / 3 / 0. The
expected rows are worked out by hand below, row by row, from the rule a request's row at
position p samples generated token g = p + 1 − prompt_len, shifted when 0 ≤ g < n — not from
the code's own formula. Then the same step through the model state's speculative path
(`LTVModelState.preprocess_state`, the device deciding, with and without the CPU's
cross-check) and the row plan the wrapper takes (`take_plan`).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ltv_vllm.serving.engine import steps, v2
from ltv_vllm.serving.engine.steps import RowPlanError

# per request, in batch order: (slot, task, n: shifted tokens, None = all, prompt_len,
# num_computed, num_scheduled, logits rows k = drafts + 1)
REQS = [
    (3, "a", None, 5, 0, 5, 1),   # R0 full prefill, all: row at p 4, g 0
    (0, "b", None, 8, 0, 4, 1),   # R1 non-final prefill chunk, all: p 3, g −4
    (5, "a", 2, 6, 6, 4, 4),      # R2 decode + 3 drafts, 2: p 6..9, g 1..4
    (1, "b", 3, 4, 4, 3, 3),      # R3 decode + 2 drafts, 3: p 4..6, g 1..3
    (2, "a", 1, 3, 3, 2, 2),      # R4 decode + 1 draft, first: p 3, 4, g 1, 2
    (4, "", 0, 5, 7, 3, 3),       # R5 bare (0) + 2 drafts: p 7..9, g 3..5
    (6, "b", 3, 4, 5, 1, 1),      # R6 decode, no draft, 3: p 5, g 2
    (7, "", None, 2, 9, 4, 4),    # R7 all + 3 drafts: p 9..12, g 8..11
    (8, "a", 2, 10, 6, 4, 1),     # R8 final prefill chunk, 2: p 9, g 0
    (9, "b", 3, 5, 0, 8, 1),      # R9 resumed (prompt 5 + 3 outputs), 3: p 7, g 3
    (10, "a", 3, 3, 5, 4, 4),     # R10 decode + 3 drafts, 3: p 5..8, g 3..6
    (11, "b", 1, 7, 0, 7, 1),     # R11 full prefill, first: p 6, g 0
]
# the shifted rows, by hand (row numbers: the requests' rows in batch order)
SHIFTED = [
    True,                          # R0  row 0: g 0, all
    False,                         # R1  row 1: g −4 (its sample is discarded)
    True, False, False, False,     # R2  rows 2-5: g 1 < 2; 2, 3, 4 ≥ 2
    True, True, False,             # R3  rows 6-8: g 1, 2 < 3; 3 ≥ 3
    False, False,                  # R4  rows 9-10: g 1, 2 ≥ 1 (first: g 0 only)
    False, False, False,           # R5  rows 11-13: bare
    True,                          # R6  row 14: g 2 < 3
    True, True, True, True,        # R7  rows 15-18: all
    True,                          # R8  row 19: g 0 < 2
    False,                         # R9  row 20: g 3 ≥ 3
    False, False, False, False,    # R10 rows 21-24: g 3..6 ≥ 3
    True,                          # R11 row 25: g 0 < 1
]
ROWS = len(SHIFTED)
# task → its rows at a shifted step (the host plan), by hand from SHIFTED
HOST_PLAN = {"a": [0, 2, 19], "b": [6, 7, 14, 25], "": [15, 16, 17, 18]}
# task → every row of its requests whose policy shifts anything (the speculative path's)
EVERY_ROW = {"a": [0, 2, 3, 4, 5, 9, 10, 19, 21, 22, 23, 24],
             "b": [1, 6, 7, 8, 14, 20, 25], "": [15, 16, 17, 18]}
PAD = 3  # padding tokens after the batch's own (a graph's padded batch)


def batch(reqs=REQS, positions_of=None) -> SimpleNamespace:
    """V2's `InputBatch` fields the row plan reads: the host's counts, the row → slot map,
    and the flattened positions of every scheduled token with the logits rows' indices
    (each request's last k tokens). `positions_of(i, host_positions)`: the device's
    positions of request i where they differ from the host's."""
    positions, logits, mapping, cu = [], [], [], [0]
    for i, (slot, _, _, _, computed, scheduled, k) in enumerate(reqs):
        start = len(positions)
        pos = list(range(computed, computed + scheduled))
        positions += positions_of(i, pos) if positions_of else pos
        logits += [start + scheduled - k + j for j in range(k)]
        mapping += [slot] * k
        cu.append(cu[-1] + k)
    return SimpleNamespace(
        num_reqs=len(reqs),
        idx_mapping_np=np.array([r[0] for r in reqs], dtype=np.int32),
        num_computed_tokens_np=np.array([r[4] for r in reqs], dtype=np.int32),
        num_scheduled_tokens=np.array([r[5] for r in reqs], dtype=np.int32),
        cu_num_logits_np=np.array(cu, dtype=np.int32),
        expanded_idx_mapping=torch.tensor(mapping + [0] * PAD, dtype=torch.int32),
        positions=torch.tensor(positions + [0] * PAD, dtype=torch.int64),
        logits_indices=torch.tensor(logits + [0] * PAD, dtype=torch.int32))


SLOTS = {slot: (task, n, prompt) for slot, task, n, prompt, *_ in REQS}


def row_values(reqs=REQS):
    """Each row's prompt length and n (−1: all), by request."""
    prompt = [r[3] for r in reqs for _ in range(r[6])]
    n = [(-1 if r[2] is None else r[2]) for r in reqs for _ in range(r[6])]
    return torch.tensor(prompt), torch.tensor(n)


def test_the_hand_built_step_is_as_described():
    assert len(SHIFTED) == sum(r[6] for r in REQS) == 26
    b = batch()
    li = b.logits_indices[:ROWS]
    # R2's four rows are its last four tokens, at consecutive positions 6..9
    assert b.positions[li[2:6]].tolist() == [6, 7, 8, 9]
    assert b.positions[li[1]].item() == 3 and b.positions[li[20]].item() == 7


def test_step_mask_marks_exactly_the_rows_at_a_shifted_step():
    b = batch()
    prompt, n = row_values()
    got = v2.step_mask(b.positions, b.logits_indices[:ROWS], prompt, n)
    assert got.dtype == torch.bool and got.tolist() == SHIFTED


@pytest.mark.parametrize(("steps_n", "want"), [
    (-1, [False, True, True, True, True]),     # all: every g ≥ 0
    (1, [False, False, False, False, False]),  # first: g 0 was the prefill row's
    (2, [False, True, False, False, False]),
    (3, [False, True, True, False, False]),
    (0, [False] * 5),                           # none
])
def test_one_requests_draft_rows_are_consecutive_steps(steps_n, want):
    """Prompts of 4: a non-final chunk's row (p 2, g −1), then one request's decode row and
    its 3 drafts' at positions 4..7 (g 1..4), among other tokens of the step."""
    positions = torch.tensor([9, 2, 9, 4, 5, 6, 7, 9])
    rows = torch.tensor([1, 3, 4, 5, 6])
    got = v2.step_mask(positions, rows, torch.full((5,), 4), torch.full((5,), steps_n))
    assert got.tolist() == want


class State(v2.LTVModelState):
    """The model state's own methods on a hand-built slot table (no engine)."""

    def __init__(self, slots, check: bool) -> None:  # no vLLM state here
        self.slots, self.on_device, self.mask_check = dict(slots), True, check
        self.readouts = {}  # no request here asks for a label readout


@pytest.fixture
def no_vllm_state(monkeypatch):
    monkeypatch.setattr(v2.DefaultModelState, "preprocess_state", lambda *_a, **_k: None)
    saved = (steps.PLAN.ready, steps.PLAN.rows, steps.PLAN.ready_mask, steps.PLAN.mask)
    yield
    steps.PLAN.ready, steps.PLAN.rows, steps.PLAN.ready_mask, steps.PLAN.mask = saved


def test_the_host_plan_of_the_step():
    """Without drafts' uncertainty (no speculative config): the shifted rows by task."""
    plan, rows = v2.row_plan(batch(), SLOTS)
    assert rows == ROWS and plan == HOST_PLAN


def test_the_speculative_plan_has_every_row_and_each_rows_policy():
    plan, rows, prompt, n = v2.row_plan(batch(), SLOTS, every_step=True)
    want_prompt, want_n = row_values()
    assert rows == ROWS and plan == EVERY_ROW
    assert prompt == want_prompt.tolist() and n == want_n.tolist()


@pytest.mark.parametrize("check", [True, False], ids=["cross-checked", "device only"])
@pytest.mark.usefixtures("no_vllm_state")
def test_the_speculative_path_shifts_exactly_the_hand_rows(check):
    """`preprocess_state` under a speculative config, with the CPU's cross-check and
    without it (as on a GPU): the wrapper takes every row of each shifting request, masked
    to exactly the rows at a shifted step."""
    State(SLOTS, check).preprocess_state(batch())
    assert steps.PLAN.rows == ROWS
    assert steps.PLAN.ready_mask.tolist() == SHIFTED
    plan = steps.take_plan(ROWS)
    assert plan == EVERY_ROW and steps.PLAN.mask.tolist() == SHIFTED
    assert steps.PLAN.ready is None and steps.take_plan(ROWS) is None  # taken once
    # each task's shifted rows: its rows under the mask, as the wrapper applies them
    shifted = {t: [r for r in rows if SHIFTED[r]] for t, rows in plan.items()}
    assert {t: r for t, r in shifted.items() if r} == HOST_PLAN


def fewer_accepted(i, host):
    """The device's truth where the host over-counted (async scheduling counts a step's
    drafts as computed before their verification): R3 had 1 of its 2 drafts accepted
    (positions one back), R10 none of 3 (three back)."""
    back = {3: 1, 10: 3}.get(i, 0)
    return [p - back for p in host]


@pytest.mark.usefixtures("no_vllm_state")
def test_the_device_positions_decide_where_the_host_counts_are_an_upper_bound():
    """With the cross-check off (a GPU), the mask follows the step's positions, not the
    host's counts: R3's rows are then g 0..2 → all shifted under 3; R10's g 0..3 → the
    first three. On the CPU the cross-check refuses such a step: there the host's counts
    must be exact."""
    b = batch(positions_of=fewer_accepted)
    State(SLOTS, False).preprocess_state(b)
    want = list(SHIFTED)
    want[6:9] = [True, True, True]                # R3: g 0, 1, 2 < 3
    want[21:25] = [True, True, True, False]       # R10: g 0, 1, 2 < 3; 3
    assert steps.PLAN.ready_mask.tolist() == want
    with pytest.raises(RowPlanError, match="differ from the host"):
        State(SLOTS, True).preprocess_state(b)


@pytest.mark.usefixtures("no_vllm_state")
def test_a_plan_for_other_rows_is_refused():
    """The wrapper's call with another row count than the step planned fails loudly."""
    State(SLOTS, False).preprocess_state(batch())
    with pytest.raises(RowPlanError, match=f"for a step of {ROWS}"):
        steps.take_plan(ROWS - 1)


def test_one_task_on_every_row():
    """A step whose every row is one task at a shifted step is planned as the whole step
    (None); one row outside it makes it a list again."""
    reqs = [(0, "a", None, 3, 3, 3, 3), (1, "a", 3, 4, 0, 4, 1)]  # g 1..3 all; g 0 < 3
    slots = {s: (t, n, p) for s, t, n, p, *_ in reqs}
    assert v2.row_plan(batch(reqs), slots) == ({"a": None}, 4)
    assert v2.row_plan(batch(reqs), slots, every_step=True)[0] == {"a": None}
    reqs[1] = (1, "a", 1, 4, 4, 2, 2)  # g 1, 2: first is over
    slots = {s: (t, n, p) for s, t, n, p, *_ in reqs}
    assert v2.row_plan(batch(reqs), slots) == ({"a": [0, 1, 2]}, 5)
    assert v2.row_plan(batch(reqs), slots, every_step=True)[0] == {"a": None}


def test_a_row_map_that_is_not_the_hosts_layout_is_refused():
    b = batch()
    b.expanded_idx_mapping[2:6] = 1  # R2's rows given to another slot
    with pytest.raises(RowPlanError, match="row → slot map differs"):
        v2.row_plan(b, SLOTS)
    with pytest.raises(RowPlanError, match="slot 5 was never added"):
        v2.row_plan(batch(), {s: v for s, v in SLOTS.items() if s != 5})
