"""A request's shift as an engine reads it, and task-store vectors by engine key.

Runs in the engine's worker processes (the row plan: `engine.steps`, `engine.v2`) and in the API
server (the per-task metrics read each request as the engine will: `api_server.metrics`).
No vLLM import: `RequestShift` reads a `SamplingParams`' `extra_args` and the model config's
`hf_overrides`, `StoreVectors` reads a key's pin (`store.taskstore`).
"""

from __future__ import annotations

import json
from typing import Any

from ltv_vllm.serving.contract.wire import (
    DEFAULT_KEY,
    LAYER_KEY,
    STEPS_KEY,
    STORE_CONFIG_KEY,
    TASK_KEY,
    TASKS_CONFIG_KEY,
    admission,
    admitted,
    parse_steps,
    request_layers,
)

FUSED = ""  # the task key of the engine's own (fused) vector


class StoreVectors:
    """Task-store vectors in an engine process, by key "NAME@DIGEST", loaded on first use
    from the key's pin (`TaskStore.pin`: the server pins a key before it admits a request
    with it, and unpins it only after every request admitted with it is done, whatever
    happened to the entry's name meanwhile) and checked against the digest, so a key always
    means the vector it was made from. Least recently used ones are dropped."""

    def __init__(self, root: str | None, keep: int = 256) -> None:
        from collections import OrderedDict

        self.root, self.keep = root, keep
        self.cache: OrderedDict[str, Any] = OrderedDict()

    def get(self, key: str) -> Any:
        """The vector (or layer task: `core.layer_task`) key "NAME@DIGEST" names."""
        from ltv_vllm.core.layer_task import load_any
        from ltv_vllm.serving.store.taskstore import TaskStore, vector_digest

        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        name, sep, digest = key.partition("@")
        if self.root is None or not sep:
            raise RuntimeError(f"{TASK_KEY} {key!r} is not a task this engine holds")
        path = TaskStore(self.root, create=False).pinned(key)
        if vector_digest(path) != digest:
            # fail the engine loudly rather than answer with another vector
            raise RuntimeError(f"task store entry {name!r} changed under key {key!r}")
        tv = self.cache[key] = load_any(path)
        while len(self.cache) > self.keep:
            self.cache.popitem(last=False)
        return tv



def store_root(config: Any) -> str | None:
    """Where this engine loads task-store tasks from: the server's copy of its store, as its
    settings name it (a replica started from an export makes its copy at start, after the
    config was written), else the config's."""
    from ltv_vllm.serving.contract.settings import ServerSettings

    return ServerSettings.from_env().task_store or getattr(config, STORE_CONFIG_KEY, None)


class RequestShift:
    """A request's task key and the number of generated tokens it shifts (None: all), as an
    engine reads them from its `SamplingParams` — one reading for both of vLLM's runners
    (`LTVStepPolicy` on V1, `engine.v2.LTVModelState` on V2)."""

    def __init__(self, vllm_config: Any, vectors: StoreVectors) -> None:
        hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        # each task's policy for requests that name none
        self.defaults: dict[str, int | None] = {
            FUSED: parse_steps(getattr(hf, DEFAULT_KEY, "all"))}
        for name, spec in json.loads(getattr(hf, TASKS_CONFIG_KEY, None) or "{}").items():
            self.defaults[name] = parse_steps(spec.get("steps", "all"))
        # task-store tasks: the server's --shift-steps, else each vector's own
        self.store_default = getattr(hf, DEFAULT_KEY, None)
        # each task's default positions as given (a layer task's prompt part is in the text)
        self.texts: dict[str, str] = {FUSED: str(getattr(hf, DEFAULT_KEY, "all"))}
        for name, spec in json.loads(getattr(hf, TASKS_CONFIG_KEY, None) or "{}").items():
            self.texts[name] = str(spec.get("steps", "all"))
        self.admission = admission()  # a served engine's stamp key (None: offline)
        self.vectors = vectors  # the process's task-store vectors (a key's own policy)
        vectors.root = vectors.root or store_root(hf)

    def of(self, params: Any) -> tuple[str, int | None]:
        args = params.extra_args or {}
        if not admitted(args, self.admission):
            # refused at admission already (`validate_params`); a request that reached the
            # engine another way is never shifted
            return FUSED, 0
        task = args.get(TASK_KEY, FUSED)
        if STEPS_KEY in args:
            return task, parse_steps(args[STEPS_KEY])
        if task in self.defaults:
            return task, self.defaults[task]
        # a task-store key (or a task the workers lack: StoreVectors fails loudly)
        tv = self.vectors.get(task)
        return task, parse_steps(self.store_default or tv.provenance.shift_steps or "all")

    def layer_of(self, params: Any, tasks: Any, hooked: bool = True) -> Any:
        """A request's layer shift if its task is one of `tasks` (the engine's layer tasks),
        else None: (its positions, ((task, scale), ...): its own task times `ltv_scale`, then
        its `ltv_mix`). Positions: its `ltv_steps`, else its task's default (`serve
        --shift-steps`, else the task file's own; a store task's comes with it). `hooked`:
        whether this engine's blocks call the layer op (`engine.layer_shift`)."""
        from ltv_vllm.core.layer_task import LayerPolicy
        from ltv_vllm.serving.contract.wire import layer_parts

        args = params.extra_args or {}
        if not admitted(args, self.admission):
            return None
        task = args.get(TASK_KEY, FUSED)
        layers = {k: (str(t.policy), t.additive) for k, t in tasks.items()}
        if task not in tasks:
            if LAYER_KEY not in args:
                return None
            # a task-store layer task, as the gate stamped it (checked at admission)
            if not hooked:  # its uploads are refused there: never answer it unshifted
                raise RuntimeError(f"{TASK_KEY} {task!r}: a task-store layer task on an "
                                   "engine started without layer hooks (--layer-uploads)")
            layers = dict(request_layers(args, self.admission, layers))
            held = self.vectors.get(task)
            if getattr(held, "additive", None) is not layers[task][1]:
                # fail the engine loudly rather than shift with what the gate did not mean
                raise RuntimeError(f"{TASK_KEY} {task!r} is not the layer task its request "
                                   "was admitted for")
        # checked at admission (`check_request`)
        parts = layer_parts(args, layers)
        if STEPS_KEY in args:
            return LayerPolicy.parse(args[STEPS_KEY]), parts
        text = self.texts.get(task)
        return (LayerPolicy.parse(text) if text is not None else tasks[task].policy), parts
