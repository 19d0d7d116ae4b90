"""Layer tasks' rows at each decoder block: the body of the layer op (`engine.layer_shift`)
as a mixin of the model wrapper (`engine.models.LTVMixin`). Runs in vLLM's engine worker
processes.

A step's layer plan (`layer_shift.step_plan`: per request group, its (task, scale) parts and
its token rows) is split once per step (`_layer_tables`): requests whose tasks are all
additive share one gather and one scatter per block (their combined biases stacked in a
table), the others (a map U Vᵀ h) are shifted per group — or, on an engine that uses the
grouped kernel (a GPU's: `models.uses_grouped_shift`), every map of a block in one pass over
the tasks' factors (`_grouped_maps`, `engine.grouped_shift`).
"""

from __future__ import annotations

from typing import Any

import torch

from ltv_vllm.core.layer_task import LayerTask
from ltv_vllm.serving.engine.layer_shift import step_plan
from ltv_vllm.serving.engine.steps import LAYER, STORE, RowPlanError, row_index

ADD_TABLES = 256  # combined additive biases kept (`_additive`): depth × d floats each


class LayerRows:
    """The wrapper's layer-task state (set by `LTVMixin._ltv_init`; class defaults for
    wrappers built without it) and the op's body."""

    _layer_tasks: dict[str, LayerTask] = {}  # task key → layer task
    _layer_casts: dict[str, LayerTask] = {}
    _add_tables: dict[tuple, torch.Tensor] = {}
    _layer_step: tuple[int, Any] = (-1, None)
    _layer_slots: dict[int, Any] = {}
    _depth = 0
    _store_layers = False  # the store may hold layer tasks (`serve --layer-uploads`)
    _sizes: tuple[int, int] = (0, 0)

    def _layer_shift(self, hidden: torch.Tensor, residual: torch.Tensor,
                     positions: torch.Tensor, layer: int) -> None:
        """The layer op's body (`engine.layer_shift`): at block `layer`, each planned token's
        delta, from its residual stream h = hidden + residual in float32, added to `hidden`
        in place (one gather, one product, one scatter per task of the step)."""
        plan = step_plan(hidden, positions, layer)
        if not plan:
            return
        if self._layer_step[0] != LAYER.step:  # the step's first block: its tables, once
            self._layer_step = (LAYER.step, self._layer_tables(plan, hidden))
        add, maps = self._layer_step[1]
        if add is not None:
            # every additive request of the step in one gather and one scatter, however many
            # distinct tasks: its combined bias at this block, by row
            rows, group, table = add
            hidden.index_add_(0, rows, table[:, layer].index_select(0, group))
        if maps:
            self._layer_maps(hidden, residual, maps, layer)

    def _layer_maps(self, hidden: torch.Tensor, residual: torch.Tensor, maps: list,
                    layer: int) -> None:
        """The requests of a step whose task maps h (`_layer_tables`' second part), shifted
        at block `layer`: on an engine that uses the grouped kernel (a GPU's,
        `uses_grouped_shift`) every map of the block in one pass over the tasks' factors
        (`_grouped_maps`), else one request group at a time."""
        grouped = self._grouped_shift(hidden.device)
        segs = []
        for parts, idx in maps:
            own = self._layer_cast(parts[0][0], hidden.device)
            if grouped and own.U is not None and layer in own.layers:
                segs.append((parts, idx))
                continue
            delta, h = None, None
            for task, scale in parts:  # the request's own task, then its `ltv_mix`
                cast = self._layer_cast(task, hidden.device)
                if layer not in cast.layers:
                    continue
                if h is None:
                    h = hidden.index_select(0, idx).float() + residual.index_select(0, idx).float()
                d = cast.delta(layer, h, scale)
                delta = d if delta is None else delta + d
            if delta is not None:
                hidden.index_add_(0, idx, delta.to(hidden.dtype))
        if segs:
            self._grouped_maps(hidden, residual, segs, layer)

    def _grouped_maps(self, hidden: torch.Tensor, residual: torch.Tensor, segs: list,
                      layer: int) -> None:
        """U_ℓ (V_ℓᵀ h) of every request group's own map through the grouped kernel (one
        slot per (task, block), in tables by rank), then each group's scale and the biases
        of its task and its mix, added to `hidden` in one scatter."""
        from ltv_vllm.serving.engine.grouped_shift import TaskSlots, grouped_delta

        device = hidden.device
        idx = torch.cat([i for _, i in segs])
        h = hidden.index_select(0, idx).float() + residual.index_select(0, idx).float()
        delta = torch.zeros_like(h)
        spans, start = [], 0
        for parts, i in segs:
            spans.append((parts, start, start + len(i)))
            start += len(i)
        by_rank: dict[int, list] = {}
        for parts, s, e in spans:
            cast = self._layer_cast(parts[0][0], device)
            by_rank.setdefault(cast.U.shape[2], []).append((parts[0][0], cast, s, e))
        step = {f"{parts[0][0]}#{layer}" for parts, _, _ in spans}
        for rank, jobs in by_rank.items():
            table = self._layer_slots.get(rank)
            if table is None or table.device != device:
                # every (map task, block) of the command line fits, and as many slots for a
                # store's layer tasks as it keeps vectors (the least recently used go first)
                room = sum(len(t.layers) for t in self._layer_tasks.values() if t.U is not None)
                room += STORE.keep if self._store_layers else 0
                table = self._layer_slots[rank] = TaskSlots(h.shape[1], h.shape[1], rank,
                                                            device, capacity=max(room, 1))
            rows, starts, slots = [], [0], []
            for task, cast, s, e in jobs:
                i = cast.layers.index(layer)
                slots.append(table.of(f"{task}#{layer}", cast.U[i], cast.V[i], step))
                rows.extend(range(s, e))
                starts.append(len(rows))
            grouped_delta(h, rows, starts, slots, table.v, table.u, delta)
        for parts, s, e in spans:
            if parts[0][1] != 1.0:
                delta[s:e] *= parts[0][1]
            for task, scale in parts:  # each bias at this block, scaled
                cast = self._layer_cast(task, device)
                if cast.bias is not None and layer in cast.layers:
                    delta[s:e] += cast.bias[cast.layers.index(layer)] * scale
        hidden.index_add_(0, idx, delta.to(hidden.dtype))

    def _layer_tables(self, plan: dict, hidden: torch.Tensor) -> tuple[Any, list]:
        """A step's layer plan split for `_layer_shift`: the requests whose tasks are all
        additive as (their rows, each row's group, each group's combined bias at every block:
        (groups, depth, d) in the engine's dtype), and the others (a map) as (parts, rows) to
        shift one by one. The bias is summed in float32 and rounded once to the engine's
        dtype: a constant has no cancellation to guard against (a map's product does,
        `_ltv_delta`), and gathering it in float32 at every block of every prefill cost
        3.4× the bf16 gather (6.7 ms against 2.0 ms a block at 7,700 rows of SmolLM2)."""
        device = hidden.device
        adds = [(parts, idx) for parts, idx in plan.items()
                if all(self._layer_task(t).additive for t, _ in parts)]
        maps = [(parts, idx) for parts, idx in plan.items()
                if not all(self._layer_task(t).additive for t, _ in parts)]
        if not adds:
            return None, maps
        table = torch.stack([self._additive(parts, device) for parts, _ in adds]).to(
            hidden.dtype)
        rows = torch.cat([idx for _, idx in adds])
        group = row_index([g for g, (_, idx) in enumerate(adds) for _ in range(len(idx))],
                          device)
        return (rows, group, table), maps

    def _additive(self, parts: tuple, device: torch.device) -> torch.Tensor:
        """Σ scale · bias of additive layer tasks at every block of the model (zeros where
        none shifts): (depth, d) float32 on `device`, kept for the requests that ask again."""
        table = self._add_tables.get(parts)
        if table is None or table.device != device:
            depth, d = self._depth, self._sizes[0]
            table = torch.zeros(depth, d, device=device)
            for task, scale in parts:
                cast = self._layer_cast(task, device)
                idx = torch.tensor(cast.layers, device=device)
                table.index_add_(0, idx, cast.bias * scale)
            self._add_tables[parts] = table
            while len(self._add_tables) > ADD_TABLES:
                self._add_tables.pop(next(iter(self._add_tables)))
        return table

    def _layer_task(self, task: str) -> LayerTask:
        """A layer task by key: the engine's own, or a task-store key's (`StoreVectors`:
        loaded on first use from its pin, checked against the model before its first cast)."""
        held = self._layer_tasks.get(task)
        if held is not None:
            return held
        held = STORE.get(task)
        if not isinstance(held, LayerTask):
            raise RowPlanError(f"ltv-vllm: task {task!r} is not a layer task")
        if task not in self._layer_casts:
            held.check_fits(self._sizes[0], self._depth, f"task store layer task {task}")
        return held

    def _layer_cast(self, task: str, device: torch.device) -> LayerTask:
        """A layer task on the engine's device in float32, cast on first use (a store's:
        as many kept as the store keeps vectors, the oldest cast dropped first)."""
        cast = self._layer_casts.get(task)
        if cast is None or (cast.bias if cast.bias is not None else cast.U).device != device:
            cast = self._layer_task(task).to(device, torch.float32)
            self._layer_casts.pop(task, None)
            self._layer_casts[task] = cast
            if task not in self._layer_tasks:
                kept = [k for k in self._layer_casts if k not in self._layer_tasks]
                for old in kept[:-STORE.keep]:
                    del self._layer_casts[old]
        return cast
