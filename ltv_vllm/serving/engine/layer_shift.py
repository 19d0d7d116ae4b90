"""Layer tasks inside vLLM's engine: each request's shift at decoder-block outputs, on its own
tokens, in a mixed batch. Runs in vLLM's engine worker processes.

How the shift gets in. The wrapper (`engine.models`) registers a forward hook on each of
its decoder layers — vLLM's layer code is untouched — and the hook calls one registered
custom op, `torch.ops.ltv_vllm.layer_shift(hidden_states, residual, positions, layer)`. vLLM's
decoder layer returns the residual stream split in two (h_ℓ = hidden_states + residual, summed
by the next layer's fused add-norm), so the op adds each planned token's delta, computed from
their sum, to `hidden_states` in place. A custom op is one opaque call to torch.compile: the
compiled graph is kept, and the op's Python runs at every step, reading that step's plan.
Under CUDA graphs a captured piece replays kernels without running Python, so the op must
run between pieces: the plugin names it among vLLM's default splitting ops
(`patch_splitting_ops`, beside its attention ops), which piecewise graphs honour and full
graphs do not; `check_graphs` refuses the graphs that would skip it (read in vLLM's source,
not run on a GPU).

Which tokens. Once per step, before its forward, each request's span of the step's token
axis is laid out (`Span`): its task, its positions policy (`core.layer_task.LayerPolicy`),
its prompt length, where its tokens start on the axis and at which position of its sequence.
V1: the step-policy processor arms the plan (`engine.steps`), and the op's first call of the
step reads the spans from the step itself — the attention metadata's `query_start_loc`
(requests in batch order, as V1 lays out its persistent batch) and the first token's
position. V2: the model state lays them out from the step's host arrays (`engine.v2`).
A plan that does not fit the step's tokens raises `RowPlanError`: never a shift on the
wrong token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ltv_vllm.core.layer_task import LayerPolicy
from ltv_vllm.core.vector import ALL, VectorError
from ltv_vllm.serving.engine.steps import LAYER, RowPlanError, row_index

LAYER_OP = "ltv_vllm::layer_shift"  # the op's name, as vLLM's splitting ops list it


@dataclass(frozen=True)
class Span:
    """One request's tokens in this step."""

    parts: tuple[tuple[str, float], ...]  # (task key, scale): its own task, then its mix
    policy: LayerPolicy
    prompt_len: int
    start: int      # its first row on the step's token axis
    count: int      # its rows this step
    first_pos: int  # its first row's position in its sequence


def shifted_rows(span: Span) -> range | list[int]:
    """The rows of `span` its policy shifts: every prompt position with `prompt`; the
    position P − 1 + (s − 1) of the row producing generated token s while s is within the
    policy's steps (P the prompt length). Pure arithmetic on ranges."""
    lo, hi = span.first_pos, span.first_pos + span.count  # positions this step holds
    p = span.prompt_len
    parts: list[tuple[int, int]] = []
    if span.policy.prompt:
        parts.append((0, p))
    n = span.policy.steps
    if n is ALL:
        parts.append((p - 1, hi))
    elif n > 0:
        parts.append((p - 1, p - 1 + n))
    rows: set[int] = set()
    for a, b in parts:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            rows.update(range(span.start + a - lo, span.start + b - lo))
    if len(parts) == 1 and rows:
        return range(min(rows), max(rows) + 1)
    return sorted(rows)


Plan = dict[tuple[tuple[str, float], ...], list[int]]  # (task, scale) parts → their rows


def token_plan(spans: list[Span]) -> Plan:
    """What each request's layer shift is made of → the step's rows it shifts."""
    plan: Plan = {}
    for span in spans:
        rows = shifted_rows(span)
        if len(rows):
            plan.setdefault(span.parts, []).extend(rows)
    return plan


def v1_spans(src: Any, positions: torch.Tensor) -> tuple[list[Span], int]:
    """V1: each request's span from the processor's rows and the step's attention metadata
    (`query_start_loc`, requests in persistent-batch order), and the step's token count."""
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    if isinstance(md, list) or not md:
        raise RowPlanError("ltv-vllm: layer tasks need one attention metadata per step (no "
                           "micro-batching)")
    meta = next(iter(md.values()))
    qsl_t = getattr(meta, "query_start_loc", None)
    if qsl_t is None:
        raise RowPlanError(f"ltv-vllm: this attention backend's metadata "
                           f"({type(meta).__name__}) has no query_start_loc: layer tasks "
                           "cannot place their tokens on it")
    n = src.batch_size
    qsl = qsl_t[: n + 1].tolist()
    if len(qsl) != n + 1:
        raise RowPlanError(f"ltv-vllm: {len(qsl) - 1} requests in the step's layout for a "
                           f"batch of {n}")
    first = positions.index_select(0, qsl_t[:n].to(positions.device).long()).tolist() \
        if n else []
    spans = []
    for i in range(n):
        row = src.rows.get(i)
        if row is None:
            continue
        _task, _n, _out, _readout, ask, prompt_len = row
        if ask is not None:
            if prompt_len is None:
                raise RowPlanError("ltv-vllm: a layer task needs the prompt's token ids "
                                   "(a prompt given as embeddings has no length here)")
            policy, parts = ask
            spans.append(Span(parts, policy, prompt_len, qsl[i], qsl[i + 1] - qsl[i],
                              int(first[i])))
    return spans, int(qsl[n])


def step_plan(hidden: torch.Tensor, positions: torch.Tensor,
              layer: int) -> dict[Any, torch.Tensor]:
    """This step's plan on the device: made at the rank's first block (a forward begins
    there) and reused by its other blocks (module docstring). A forward nobody planned (a
    warm-up, a dummy run) shifts nothing."""
    if layer != LAYER.first_layer:
        return LAYER.current
    LAYER.current = {}
    LAYER.step += 1
    if LAYER.ready is not None:  # V2: laid out by the model state before the forward
        plan, LAYER.tokens = LAYER.ready
        LAYER.ready = None
    elif LAYER.armed and LAYER.source is not None:  # V1: the processor's update came first
        LAYER.armed = False
        spans, LAYER.tokens = v1_spans(LAYER.source, positions)
        plan = token_plan(spans)
    else:
        return LAYER.current
    if LAYER.tokens > hidden.shape[0]:
        raise RowPlanError(f"ltv-vllm: a layer plan for {LAYER.tokens} tokens in a step of "
                           f"{hidden.shape[0]}")
    LAYER.current = {parts: row_index(list(rows), hidden.device)
                     for parts, rows in plan.items()}
    return LAYER.current


@torch.library.custom_op(LAYER_OP, mutates_args=("hidden",))
def layer_shift(hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                layer: int) -> None:
    """Add this step's layer-task deltas at block `layer` to `hidden`, in place."""
    if LAYER.shift is not None:
        LAYER.shift(hidden, residual, positions, layer)


@layer_shift.register_fake
def _(hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,  # noqa: ARG001
      layer: int) -> None:  # noqa: ARG001
    return None


def check_graphs() -> None:
    """Refuse CUDA graphs that would replay a step without the op: full graphs capture the
    whole forward (the op's Python would run once, at capture, with no plan), and piecewise
    ones run it only where it splits the graph (module docstring). Read in vLLM's config
    as the engine builds the model."""
    from vllm.config import get_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode

    cc = get_current_vllm_config().compilation_config
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is None or mode == CUDAGraphMode.NONE:
        return
    if mode == CUDAGraphMode.PIECEWISE and LAYER_OP in (cc.splitting_ops or []):
        return
    raise VectorError(f"layer tasks need their op ({LAYER_OP}) to run at every step, which "
                      f"CUDA graphs ({mode.name}) would replay without: serve with "
                      "--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' (the op is "
                      "among vLLM's default splitting ops; name it in your own) or "
                      "--enforce-eager")


def patch_splitting_ops() -> bool:
    """Name the op among the splitting ops vLLM uses when the user names none (its attention
    ops: `CompilationConfig._attention_ops`), so piecewise graphs run it between their
    pieces; without a layer task no hook calls it, and nothing splits there. Idempotent;
    False where this vLLM has no such list (then only --enforce-eager or the user's own
    splitting_ops keep the op, `check_graphs`)."""
    try:
        from vllm.config.compilation import CompilationConfig
    except ImportError:
        return False
    ops = getattr(CompilationConfig, "_attention_ops", None)
    if not isinstance(ops, list):
        return False
    if LAYER_OP not in ops:
        ops.append(LAYER_OP)
    return True


def install_hooks(model: Any) -> int:
    """A forward hook on each of `model`'s decoder layers held on this rank (a pipeline
    stage holds only its own) calling the op; returns how many."""
    inner = model.model
    start = int(getattr(inner, "start_layer", 0))
    end = int(getattr(inner, "end_layer", len(inner.layers)))
    LAYER.first_layer = start
    for ell in range(start, end):
        def hook(_m: Any, args: tuple, out: Any, ell: int = ell) -> Any:
            hidden, residual = out
            torch.ops.ltv_vllm.layer_shift(hidden, residual, args[0], ell)
            return out

        inner.layers[ell].register_forward_hook(hook)
    return end - start
