"""The gates of multi-task servers (`LoraGate`, `TaskGate`) and of a folded vector
(`FoldedGate`): `api_server.gate`'s step 3 for a server whose requests name their task.
Runs in vLLM's API-server process (vLLM loads them by name: `vllm_ext.middleware`).
"""

from __future__ import annotations

from typing import Any

from ltv_vllm.serving.api_server.asgi import base_name, base_names
from ltv_vllm.serving.api_server.ask import (
    NO_SHIFT_PATHS,
    SHIFT_PATHS,
    Ask,
    beam_refusal,
    route_refusal,
)
from ltv_vllm.serving.api_server.gate import Gate
from ltv_vllm.serving.contract.wire import (
    LAYER_KEY,
    LORA_PROMPT_LOGPROBS,
    MIX_KEY,
    STEPS_KEY,
    TASK_KEY,
    named_tasks,
    parse_mix,
    task_prompt_logprobs,
    unknown_task,
)


class FoldedGate(Gate):
    """A fused server whose vector is folded into the LM head: every token of every request
    is shifted by the weights themselves. Its engine admits only stamped requests (so no
    route the gate does not serve can reach the shifted head), and vLLM's beam search sends
    each step as a new request without the stamp: refused here, as on an unfolded server."""


class LoraGate(Gate):
    """Steps 1, 2 and 3, for multi-task serving with LoRA adapters: a task is an adapter
    chosen by `model`, which applies at every step (beam search's too: vLLM hands each beam
    step the request's adapter)."""

    def refuse(self, scope: dict[str, Any], ask: Ask) -> tuple[str, ...] | None:
        if (bad := ask.malformed()) is not None:
            return bad
        if ask.named is not None:
            # the engine refuses it, but on a background response only after a 200
            # "queued" (then "queued" forever): refused here, on every route
            return (f"vllm_xargs.{TASK_KEY}: a LoRA server (--multi-task lora) serves a task "
                    "as the adapter its `model` names", "BadRequestError",
                    f"vllm_xargs.{TASK_KEY}")
        if ask.prompt_logprobs:
            return LORA_PROMPT_LOGPROBS, "BadRequestError", "prompt_logprobs"
        adapter = isinstance(ask.model, str) and ask.model not in base_names(scope)
        if adapter and ask.path not in (*SHIFT_PATHS, *NO_SHIFT_PATHS):
            # vLLM chooses an adapter by `model` on every route; only these are proven
            # (a background response, scoring, scale-out generate outlive or bypass them)
            return route_refusal(f"task {ask.model!r}")
        if (adapter
                and (ask.chat or ask.path in SHIFT_PATHS)):
            return ask.rendering(ask.model, ask.model, self._registry.chat_fitted())
        return None

    def counted(self, ask: Ask) -> Any:
        return ask.model


class TaskGate(Gate):
    """Steps 1, 2 and 3, for multi-task serving with per-request tasks (`engine.steps`):
    the gate alone decides a request's task. A request whose `model` (or
    `vllm_xargs.ltv_task`) is a served task gets `vllm_xargs.ltv_task` set to its engine key
    (the body handed on is rewritten), so the engine shifts its rows with that task's vector.
    Every task is a served name of the one model, so vLLM's own routes would otherwise answer
    it with the bare model: a task named on any other route, or a request shape the shift
    cannot follow (beam search), is a 400 rather than an unshifted answer."""

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        # never an engine key (a store task's NAME@DIGEST, a probe's @NAME): the gate's own
        self.tasks = frozenset(t for t in named_tasks() if "@" not in t)

    def is_task(self, name: Any) -> bool:
        """A command-line task's name, or a task-store task served now (never an engine key:
        those are the server's own)."""
        return isinstance(name, str) and (name in self.tasks or name in self._registry.keys)

    def task(self, ask: Ask) -> Any:
        """The task a request names (by `model` or `vllm_xargs.ltv_task`), or None."""
        if self.is_task(ask.model):
            return ask.model
        named = ask.named
        return named if self.is_task(named) else None

    def counted(self, ask: Ask) -> Any:
        # a store task by its engine key: a DELETE frees the name at once and waits, for the
        # key's pin, only for the requests admitted with that key
        task = self.task(ask)
        return self._registry.key_of(task) if task is not None else None

    def refuse(self, scope: dict[str, Any], ask: Ask) -> tuple[str, ...] | None:
        if (bad := ask.malformed()) is not None:
            return bad
        named, task = ask.named, self.task(ask)
        if named is not None and not self.is_task(named):
            known = self.tasks | set(self._registry.keys)
            if ask.tenant is not None:  # a scoped caller hears of its own tasks only
                known = {t for t in known if ask.tenant.covers(t)}
            return unknown_task(named, known), "BadRequestError", f"vllm_xargs.{TASK_KEY}"
        if self.is_task(ask.model) and named is not None and named != ask.model:
            return (f"model {ask.model!r} and vllm_xargs.{TASK_KEY} {named!r} name two tasks; "
                    "name one", "BadRequestError", "vllm_xargs")
        if named is not None and ask.model is not None and not self.is_task(ask.model) \
                and (not isinstance(ask.model, str) or ask.model not in base_names(scope)):
            return (f"model {str(ask.model)[:80]!r} beside vllm_xargs.{TASK_KEY}: a task's "
                    "vector shifts the base model it was fitted on; name the served base "
                    "model or the task itself, not another model or a LoRA adapter",
                    "BadRequestError", "model")
        if ask.path in NO_SHIFT_PATHS:
            return None  # nothing is generated: a task's name stands for the model's tokenizer
        if ask.path not in SHIFT_PATHS:
            if task is not None or ask.ltv_keys:
                return route_refusal(f"task {task!r}" if task is not None
                                     else f"vllm_xargs.{ask.ltv_keys[0]}")
            return None
        if task is None:
            return None  # the bare model
        if ask.beam:
            return beam_refusal(f"task {task!r}"), "BadRequestError", "use_beam_search"
        if ask.prompt_logprobs:  # the engine refuses them too; here before any stream starts
            return task_prompt_logprobs(), "BadRequestError", "prompt_logprobs"
        if mixed := self._store_mixed(ask):
            return (f"{MIX_KEY} combines the command line's additive layer tasks; task-store "
                    f"task {mixed!r} is not among them (name it as the request's task)",
                    "BadRequestError", f"vllm_xargs.{MIX_KEY}")
        return ask.rendering(task, task, self._registry.chat_fitted())

    def _store_mixed(self, ask: Ask) -> str | None:
        """A task-store layer task a request's `ltv_mix` names (a mix is read by the engine
        against its command-line layer tasks only: `wire.layer_parts`), or None."""
        mix = (ask.xargs or {}).get(MIX_KEY) if isinstance(ask.xargs, dict) else None
        try:
            names = parse_mix(mix) if mix is not None else {}
        except ValueError:
            return None  # the engine's 400 names what is wrong with it
        return next((n for n in names if n in self._registry.layers), None)

    def shifts(self, ask: Ask) -> bool:
        # after `rewrite`: a task's request carries its engine key (refused otherwise)
        return ask.path in SHIFT_PATHS and isinstance(ask.named, str)

    def shown(self, scope: dict[str, Any], ask: Ask) -> str | None:
        # vLLM answers every request with its first served name; a task's request names
        # the task it got (by `model`, or by `vllm_xargs.ltv_task` beside the base name)
        if ask.path not in SHIFT_PATHS:
            return None
        task = self.task(ask)
        return task if task is not None and task != base_name(scope) else None

    def rewrite(self, scope: dict[str, Any], ask: Ask) -> bool:
        task = self.task(ask)
        if task is None:
            return False
        if ask.path in NO_SHIFT_PATHS:
            if task in self._registry.keys and ask.model == task:
                ask.set_model(base_name(scope))  # a store task's tokenizer is the model's
                return True
            return False
        # SHIFT_PATHS only (refuse): the engine's key for the task, and for a store task the
        # base model's name (store tasks are not served model names of vLLM's)
        if task in self._registry.keys:
            ask.set_model(base_name(scope))
        xargs = {**(ask.xargs or {}), TASK_KEY: self._registry.key_of(task)}
        if (layer := self._registry.layers.get(task)) is not None:
            # a store layer task: its kind and positions travel with its key, under the
            # stamp (`wire.request_layers`): the engine holds no table of the store's tasks
            positions, additive = layer
            xargs.setdefault(STEPS_KEY, positions)
            xargs[LAYER_KEY] = "add" if additive else "map"
        ask.payload["vllm_xargs"] = xargs
        return True

