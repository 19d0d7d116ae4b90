"""LTV-capable subclasses of vLLM's own model classes. Runs in vLLM's engine worker
processes (loaded by ModelRegistry through `vllm_ext.models`).

Each wrapper is the stock class plus one change where the hidden states meet the LM head:
rows that reach `compute_logits` are shifted, h ← h + U (Vᵀ h) for a hidden-space vector; a
logit-space vector adds U (Vᵀ h) to the logits instead. Which rows, and with which vector,
is each request's choice (`steps`: its task and step policy); without one, the engine's own
vector shifts every row (prompt-logprob rows included). The engine's vector is named by the HF
config attribute `ltv_task_vector`, a multi-task engine's vectors by `ltv_tasks` (set through
`hf_overrides`, see `ltv_vllm.serving.launcher.recipe.engine_kwargs` / `task_engine`).

Tensor parallelism: hidden states are replicated on every rank, so every rank applies the same
shift before its vocab shard of the LM head — no communication is added. A logit-space delta
is added once, to the gathered logits; on vLLM's vocab-local path (`compute_logits_local`)
each rank adds the rows of U for its own vocab shard.

Pipeline parallelism: only the last stage holds the LM head (earlier ones hold vLLM's
`PPMissingLayer` and never compute logits), so only it shifts or folds.
"""

from __future__ import annotations

import copy
import json
import os
from collections import OrderedDict
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import PPMissingLayer

from ltv_vllm.core.layer_task import LayerTask, load_any
from ltv_vllm.core.vector import TaskVector, VectorError
from ltv_vllm.serving.contract.names import CONFIG_KEY, FOLD_KEY
from ltv_vllm.serving.contract.wire import TASKS_CONFIG_KEY
from ltv_vllm.serving.engine.layer_rows import LayerRows
from ltv_vllm.serving.engine.layer_shift import check_graphs, install_hooks
from ltv_vllm.serving.engine.steps import (
    FUSED,
    LAYER,
    PLAN,
    STORE,
    restrict,
    row_index,
    store_root,
    take_plan,
)


class LTVMixin(LayerRows):
    """Shared by every wrapper; expects the host class's `compute_logits` and `config`."""

    _ltv: TaskVector | None                # the engine's own (fused) vector
    _vectors: dict[str, TaskVector]        # task key → vector ("" = _ltv; names: multi-task)
    _casts: dict[str, TaskVector]          # the same on the engine's device, float32

    def _ltv_init(self, config: object) -> None:
        path = getattr(config, CONFIG_KEY, None)
        given = {FUSED: load_any(path)} if path else {}
        for name, spec in json.loads(getattr(config, TASKS_CONFIG_KEY, None) or "{}").items():
            given[name] = load_any(spec["path"])
        # layer tasks act inside the decoder (`engine.layer_shift`), the others at the head
        self._layer_tasks = {k: t for k, t in given.items() if isinstance(t, LayerTask)}
        self._vectors = {k: t for k, t in given.items() if not isinstance(t, LayerTask)}
        self._ltv = self._vectors.get(FUSED)
        self._layer_casts: dict[str, LayerTask] = {}
        self._add_tables: dict[tuple, torch.Tensor] = {}  # `_additive`, oldest first
        self._layer_step: tuple[int, Any] = (-1, None)   # (LAYER.step, `_layer_tables`)
        self._layer_slots: dict[int, Any] = {}  # rank → `grouped_shift.TaskSlots` of the maps
        self._depth = int(getattr(config, "num_hidden_layers", 0) or 0)
        from ltv_vllm.serving.contract.settings import ENV, ServerSettings

        settings = ServerSettings.from_env() if ENV in os.environ else None
        # a store that may hold layer tasks (`serve --layer-uploads`): hooks from the start,
        # its tasks loaded on first use (`_layer_task`)
        self._store_layers = settings is not None and settings.store_layers
        if self._layer_tasks or self._store_layers:
            from ltv_vllm.serving.contract.wire import LAYER_TASKS_ENV, layer_tasks
            from ltv_vllm.serving.engine.prefix_keys import patched

            depth = int(config.num_hidden_layers)
            for name, task in self._layer_tasks.items():
                task.check_fits(int(config.hidden_size), depth, f"layer task {name or path}")
            if not patched() or set(self._layer_tasks) - set(layer_tasks()):
                # the scheduler would share a layer task's shifted KV with bare requests
                raise VectorError(f"layer tasks need {LAYER_TASKS_ENV} to name them in the "
                                  "process that starts the engine, and ltv-vllm's plugin "
                                  "loaded (start it with ltv_vllm's make_llm / task_llm or "
                                  "ltv-vllm serve)")
            check_graphs()
            LAYER.tasks = self._layer_tasks
            LAYER.shift = self._layer_shift
            install_hooks(self)
        self._casts = {}
        self._cast_keys: OrderedDict[str, None] = OrderedDict()  # store keys, oldest first
        self._store = store_root(config)  # runtime tasks (`StoreVectors`)
        self._grouped_choice: bool | None = None  # `uses_grouped_shift`, on the first step
        self._slot_tables: dict[int, object] = {}  # rank → `grouped_shift.TaskSlots`
        if self._store:
            STORE.root = self._store
        self._ltv_fold = bool(getattr(config, FOLD_KEY, False)) and self._ltv is not None
        if self._ltv_fold and (self._ltv.kind != "hidden" or self._ltv.bias is not None
                               or self._ltv.map != "linear"):
            raise VectorError("only a linear hidden-space vector without a bias can be folded")
        if self._ltv_fold and len(self._vectors) > 1:
            raise VectorError("a folded head serves one task; per-request tasks need it unfolded")
        self._sizes = int(config.hidden_size), int(config.vocab_size)
        # a server's engine measures its shifts for /metrics (`shift_sizes`): not offline
        from ltv_vllm.serving.engine.shift_sizes import ShiftSizes

        served = settings is not None and settings.task_metrics
        self._shift_sizes = ShiftSizes() if served else None
        for name, tv in self._vectors.items():
            self._check_sizes(tv, f"task vector {name or path}")

    def _check_sizes(self, tv: TaskVector, what: str) -> None:
        d, vocab = self._sizes
        if tv.V.shape[0] != d:
            raise VectorError(f"{what} is for hidden size {tv.V.shape[0]}, model has {d}")
        if tv.kind == "logit" and tv.U.shape[0] != vocab:
            # compute_logits adds U's rows to the first columns: a mismatch would shift the
            # wrong tokens rather than fail
            raise VectorError(f"logit {what} is for vocabulary {tv.U.shape[0]}, model has "
                              f"{vocab}")

    def _vector(self, task: str) -> TaskVector | None:
        """A task's vector: the engine's own, a named one, or a task-store key's (loaded on
        first use, checked against the model; None: FUSED in multi-task serving, or a layer
        task, which acts inside the decoder instead)."""
        if task in self._layer_tasks:
            return None
        tv = self._vectors.get(task)
        if tv is None and task != FUSED and self._store:
            tv = STORE.get(task)
            if isinstance(tv, LayerTask):
                return None
            self._check_sizes(tv, f"task store vector {task}")
        return tv

    def _ltv_delta(self, h: torch.Tensor, part: slice | None = None,
                   task: str = FUSED) -> torch.Tensor:
        """U (Vᵀ h) (+ bias) of `task`'s vector in float32, only the outputs in `part` (a
        vocab shard for a logit vector).

        Always float32, whatever the engine's dtype: in bf16 an RBF map's distances
        ‖h‖² + ‖v‖² − 2h·v cancel catastrophically (at ‖h‖² ≈ 128 a bf16 step is 1, the
        size of the distances themselves), and a linear shift loses what rounding each
        product loses. The shift is ~1 % of the LM head's work (r ≪ vocab), so the cost is
        small; only its sum with h is rounded back to the engine's dtype."""
        return self._cast(task, h.device).delta(h.float(), part)  # rank-r, never d×d

    def _cast(self, task: str, device: torch.device) -> TaskVector:
        """`task`'s vector on the engine's device in float32 (`_ltv_delta` says why)."""
        # One cast to the engine's device, on first use (vLLM may build the module on the
        # meta device and move it; the hidden states tell us where we really run).
        cast = self._casts.get(task)
        if cast is None or cast.U.device != device:
            cast = self._casts[task] = self._vector(task).to(device, torch.float32)
            if task not in self._vectors:
                # store keys come and go: keep as many casts as the store keeps vectors,
                # dropping the least recently cast (never all at once: with more tasks in
                # flight than that, clearing would recast every task at every step)
                self._cast_keys[task] = None
                self._cast_keys.move_to_end(task)
                while len(self._cast_keys) > STORE.keep:
                    self._casts.pop(self._cast_keys.popitem(last=False)[0], None)
        elif task in self._cast_keys:
            self._cast_keys.move_to_end(task)
        return cast

    def _ltv_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h shifted by the engine's own vector, every row (the paths without a row plan)."""
        if self._ltv is None or self._ltv.kind != "hidden" or h.shape[0] == 0:
            return h
        return (h.float() + self._ltv_delta(h)).to(h.dtype)

    def _shifted(self, h: torch.Tensor, plan: dict[str, list[int] | None], kind: str,
                 out: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`out` plus, for every task of `kind` in the plan, its delta on its own rows (a
        hidden vector's delta is added to h, a logit vector's to the logits' first columns).
        `mask` (rows,): only the rows it marks get their delta (the others get 0 × delta).

        One task on every row: one rank-r product. Several: their rows are gathered in task
        order once and the deltas go back in one scatter; between, a task with many rows is
        one rank-r product on its contiguous slice, and the tasks with few rows (≤ SMALL, the
        usual case with many distinct tasks: a request or two each) of a linear hidden map
        of one rank are shifted together in two batched products on a GPU
        (`_batched_delta`, `batches_small_tasks`). So there the number of kernel launches
        does not grow with the number of distinct tasks, which is what their cost was
        (`benchmarks/k_tasks_shift.py`: 256 tasks took 30 µs of launches each at
        Llama-8B's width); what still grows is reading each task's U and V once per step."""
        jobs = [(task, rows) for task, rows in plan.items()
                if (tv := self._vector(task)) is not None and tv.kind == kind]
        if not jobs:
            return out  # FUSED in multi-task serving (the bare model), or the other kind
        # a float32 copy: h itself is vLLM's buffer, and the sum is taken in float32
        out = out.float() if out.dtype != torch.float32 else out.clone()
        sizes = self._shift_sizes if kind == "hidden" else None  # ‖W h‖ / ‖h‖: hidden only
        if len(jobs) == 1 and jobs[0][1] is None:
            delta = self._ltv_delta(h, task=jobs[0][0])
            if sizes is not None:
                sizes.record([jobs[0][0]], h, delta, mask, None)
            if mask is not None:
                delta = delta * mask.unsqueeze(1)
            out[..., : delta.shape[-1]] += delta
            return out
        order = [r for _, rows in jobs for r in (range(h.shape[0]) if rows is None else rows)]
        idx = row_index(order, h.device)
        hs = h.index_select(0, idx).float()
        width = self._sizes[0] if kind == "hidden" else self._sizes[1]
        delta = torch.empty(len(order), width, device=h.device, dtype=torch.float32)
        start = 0
        few: dict[int, list[tuple[int, int, TaskVector]]] = {}  # rank → (start, end, vector)
        grouped = kind == "hidden" and self._grouped_shift(h.device)
        segs: dict[int, list[tuple[int, int, str, TaskVector]]] = {}  # rank → its tasks
        for task, rows in jobs:
            end = start + (h.shape[0] if rows is None else len(rows))
            cast = self._cast(task, h.device)
            if cast.map == "linear" and cast.bias is None:
                if grouped:
                    segs.setdefault(cast.V.shape[1], []).append((start, end, task, cast))
                elif kind == "hidden" and end - start <= SMALL and batches_small_tasks(h.device):
                    few.setdefault(cast.V.shape[1], []).append((start, end, cast))
                else:
                    torch.mm(hs[start:end] @ cast.V, cast.U.T, out=delta[start:end])
            else:
                delta[start:end] = cast.delta(hs[start:end])
            start = end
        for group in few.values():
            _batched_delta(hs, delta, group)
        if segs:
            self._grouped(hs, delta, segs, {task for task, _ in jobs})
        if sizes is not None:
            row_task = row_index([j for j, (_, rows) in enumerate(jobs)
                                  for _ in range(h.shape[0] if rows is None else len(rows))],
                                 h.device)
            sizes.record([t for t, _ in jobs], hs, delta,
                         mask.index_select(0, idx) if mask is not None else None, row_task)
        if mask is not None:
            delta *= mask.index_select(0, idx).unsqueeze(1)
        out[:, :width].index_add_(0, idx, delta)
        return out

    def _grouped_shift(self, device: torch.device) -> bool:
        """Whether this engine shifts its linear hidden tasks through the grouped kernel
        (`engine.grouped_shift`), decided on the first step (`uses_grouped_shift`)."""
        if self._grouped_choice is None:
            self._grouped_choice = uses_grouped_shift(device)
        return self._grouped_choice

    def _grouped(self, hs: torch.Tensor, delta: torch.Tensor,
                 segs: dict[int, list[tuple[int, int, str, TaskVector]]],
                 step: set[str]) -> None:
        """delta[s:e] = hs[s:e] V Uᵀ for every task's rows, one grouped pass per rank over
        the tasks' slots (each task's factors written to its slot on first use)."""
        from ltv_vllm.serving.engine.grouped_shift import TaskSlots, grouped_delta

        tables = self._slot_tables
        for rank, tasks in segs.items():
            table = tables.get(rank)
            if table is None or table.device != hs.device:
                table = tables[rank] = TaskSlots(hs.shape[1], delta.shape[1], rank, hs.device,
                                                 capacity=STORE.keep + len(self._vectors))
            rows, starts, slots = [], [0], []
            for s, e, task, cast in tasks:
                slots.append(table.of(task, cast.U, cast.V, step))
                rows.extend(range(s, e))
                starts.append(len(rows))
            grouped_delta(hs, rows, starts, slots, table.v, table.u, delta)

    @classmethod
    def get_model_state_cls(cls) -> type:
        """vLLM's V2 runner asks the model for its state class (V1 never does): ours plans
        each step's rows for the per-request shift (`engine.v2`)."""
        from ltv_vllm.serving.engine.v2 import LTVModelState

        return LTVModelState

    def load_weights(self, weights):
        loaded = super().load_weights(weights)  # type: ignore[misc]
        if self._ltv_fold:
            self._fold_into_lm_head()
        return loaded

    def _fold_into_lm_head(self) -> None:
        """W_lm ← W_lm (I + U Vᵀ): the shift costs nothing per token afterwards.

        A head tied to the input embedding is untied first (folding must not touch the
        embeddings). Under tensor parallelism each rank folds its own vocab rows.
        """
        tv = self._ltv
        assert tv is not None
        head = self.lm_head  # type: ignore[attr-defined]
        if isinstance(head, PPMissingLayer):  # a stage before the last: no head, no logits
            self._ltv, self._vectors = None, {}
            return
        embed = getattr(getattr(self, "model", None), "embed_tokens", None)
        if head is embed or head.weight is getattr(embed, "weight", None):
            head = copy.copy(head)
            head._parameters = dict(head._parameters)  # a shallow copy shares this dict
            head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
            self.lm_head = head  # type: ignore[attr-defined]
        w = head.weight.data
        f32 = tv.to(w.device, torch.float32)
        w32 = w.float()
        w.copy_((w32 + (w32 @ f32.U) @ f32.V.T).to(w.dtype))
        self._ltv, self._vectors = None, {}  # nothing left to do at run time

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if (not self._vectors and not self._store) or hidden_states.shape[0] == 0:
            return super().compute_logits(hidden_states)  # type: ignore[misc]
        # this step's per-request shifts (`steps`), taken on the main call only; without a
        # plan the engine's own vector (if any) shifts every row
        plan = take_plan(hidden_states.shape[0])
        mask = PLAN.mask
        if plan is None:
            plan = {FUSED: None}
        h = self._shifted(hidden_states, plan, "hidden", hidden_states, mask)
        if PLAN.readout and self._shift_sizes is not None:
            self._record_span(hidden_states, plan)
        logits = super().compute_logits(h.to(hidden_states.dtype))  # type: ignore[misc]
        if logits is not None:
            shifted = self._shifted(hidden_states, plan, "logit", logits, mask)
            if shifted is not logits:
                logits = shifted.to(logits.dtype)
            if PLAN.readout:  # after every shift: the restricted distribution of the shifted
                logits = restrict(logits, PLAN.readout)
        return logits

    def _record_span(self, h: torch.Tensor, plan: dict[str, list[int] | None]) -> None:
        """Live fidelity's re-asked rows on a task's side (a label readout, shifted by a
        linear map): each one's share of h outside the span the map reads, summed per task
        (`shift_sizes`). Client rows carry no readout: they cost nothing here."""
        assert self._shift_sizes is not None
        for task, rows in plan.items():
            tv = self._vector(task)
            if tv is None or tv.map != "linear":
                continue  # the bare model's side (FUSED in multi-task serving), or a kernel
            mine = [r for r in PLAN.readout if rows is None or r in rows]
            if mine:
                self._shift_sizes.record_span(
                    task, h.index_select(0, row_index(sorted(mine), h.device)),
                    self._cast(task, h.device).V)

    def _single_task(self, what: str) -> None:
        if set(self._vectors) - {FUSED} or self._store:
            # these entry points have no row plan: they would shift no request's task
            raise VectorError(f"{what} cannot apply per-request tasks (vLLM's batch-sharded "
                              "sampling and a draft model's local argmax reduction are not "
                              "supported in multi-task serving)")


SMALL = 8  # a task with at most this many rows in a step is shifted in a batch of such tasks
GROUPED_ENV = "LTV_VLLM_GROUPED_SHIFT"  # auto (default) | on | off


def uses_grouped_shift(device: torch.device) -> bool:
    """Whether an engine on `device` shifts its tasks through the grouped kernel: on a GPU
    with Triton (`auto`), where each task's factors read once per step is the cost; not on
    a CPU, where a step is long and one product per task is cheaper than Triton's
    interpreter. `LTV_VLLM_GROUPED_SHIFT=on|off` forces the choice (`on` on a CPU needs
    TRITON_INTERPRET=1: the test suite's way to run the kernel here)."""
    mode = os.environ.get(GROUPED_ENV, "auto").strip().lower()
    if mode not in ("auto", "on", "off"):
        raise VectorError(f"{GROUPED_ENV} must be auto, on or off, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def batches_small_tasks(device: torch.device) -> bool:
    """Whether small tasks are shifted together (`_batched_delta`) on this device: where a
    kernel launch costs more than copying the tasks' U and V into one stack — a GPU (at
    Llama-8B's width, 256 tasks: 2.2 ms against 7.9 ms one task at a time on an H200) —
    but not on a CPU, where the copy is the cost (SmolLM2, 256 tasks: 102 ms against
    15 ms; `benchmarks/k_tasks_shift.py`)."""
    return device.type != "cpu"


def _batched_delta(hs: torch.Tensor, delta: torch.Tensor,
                   group: list[tuple[int, int, TaskVector]]) -> None:
    """delta[s:e] = (hs[s:e] V) Uᵀ for every (s, e, vector) of `group` (linear maps of one
    rank, at most SMALL rows each), in two batched products: each task's rows padded to the
    group's most (with its last row again; those outputs are dropped), the tasks' V and U
    stacked. Pure tensor maths; the indices are built on the host and copied once."""
    if len(group) == 1:
        s, e, tv = group[0]
        torch.mm(hs[s:e] @ tv.V, tv.U.T, out=delta[s:e])
        return
    m = max(e - s for s, e, _ in group)
    pad = [s + min(j, e - s - 1) for s, e, _ in group for j in range(m)]
    keep = [i * m + j for i, (s, e, _) in enumerate(group) for j in range(e - s)]
    dest = [r for s, e, _ in group for r in range(s, e)]
    idx = row_index(pad + keep + dest, hs.device)
    pad_idx, keep_idx, dest_idx = idx.split([len(pad), len(keep), len(dest)])
    hp = hs.index_select(0, pad_idx).view(len(group), m, hs.shape[1])
    z = torch.bmm(hp, torch.stack([tv.V for _, _, tv in group]))  # (tasks, m, r)
    out = torch.bmm(z, torch.stack([tv.U for _, _, tv in group]).transpose(1, 2))
    delta.index_copy_(0, dest_idx, out.view(-1, out.shape[-1]).index_select(0, keep_idx))


class LTVLocalMixin(LTVMixin):
    """For hosts with vocab-local logits/argmax (vLLM's LocalArgmaxMixin): shift there too.

    vLLM 0.32 calls these only on opt-in paths: `compute_logits_local` with
    --enable-batch-sharded-sampling (TP > 1, model runner V2), `get_top_tokens` for a draft
    model with speculative `use_local_argmax_reduction`. A hidden vector shifts h as usual.
    A logit vector is handled rather than opted out of: vLLM detects support with `hasattr`,
    which an inherited method cannot decline cleanly, and a missing `get_top_tokens` is an error.
    """

    def compute_logits_local(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self._single_task("compute_logits_local")
        logits = super().compute_logits_local(self._ltv_hidden(hidden_states))  # type: ignore[misc]
        if self._ltv is not None and self._ltv.kind == "logit" and hidden_states.shape[0]:
            # This rank's logits are the columns [org_vocab_start, org_vocab_end) of the real
            # vocabulary, then padding: add the matching rows of U, nothing to the padding.
            shard = self.lm_head.shard_indices  # type: ignore[attr-defined]
            part = slice(shard.org_vocab_start_index, shard.org_vocab_end_index)
            logits[..., : shard.num_org_elements] += self._ltv_delta(hidden_states, part).to(
                logits.dtype)
        return logits

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self._single_task("get_top_tokens")
        if self._ltv is not None and self._ltv.kind == "logit":
            # The stock reduction projects through the LM head itself, past any hook of ours.
            # Argmax of the full (all-gathered on every rank) shifted logits is the same token;
            # it only gives up the communication saving, on a rare draft-model path.
            return self.compute_logits(hidden_states).argmax(dim=-1)
        return super().get_top_tokens(self._ltv_hidden(hidden_states))  # type: ignore[misc]


class LTVLlamaForCausalLM(LTVLocalMixin, LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._ltv_init(vllm_config.model_config.hf_config)


class LTVMistralForCausalLM(LTVLocalMixin, MistralForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._ltv_init(vllm_config.model_config.hf_config)


class LTVQwen2ForCausalLM(LTVMixin, Qwen2ForCausalLM):
    # Stock Qwen2 does not declare its LM head as a LoRA target; multi-task serving carries
    # task vectors as lm_head LoRAs, so declare it (as Llama does).
    embedding_modules: ClassVar[dict[str, str]] = {"lm_head": "output_embeddings"}

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._ltv_init(vllm_config.model_config.hf_config)


class LTVQwen3ForCausalLM(LTVMixin, Qwen3ForCausalLM):
    # LTVMixin, not LTVLocalMixin: vLLM's Qwen3 (0.32 and 0.33) has no vocab-local logits
    # (`compute_logits_local`), and a wrapper that declared one would be picked by
    # batch-sharded sampling and fail at its first step
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._ltv_init(vllm_config.model_config.hf_config)
