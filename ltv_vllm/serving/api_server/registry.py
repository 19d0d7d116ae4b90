"""The task registry: the API-server process's one source of truth for the tasks it serves.

Runs in vLLM's API-server process. One `TaskRegistry` per API-server process, kept on the
FastAPI app's state (`TaskRegistry.of`): the gate (`api_server.gate`) finds it through the
ASGI scope's app, the task endpoints (`api_server.endpoints`) through the state vLLM hands
their `init_state`, the per-task metrics through `instrument`. Nothing else holds a task's
name, key or count:

- `keys`: each task-store task served by key (per-request tasks) → its engine key
  "NAME@DIGEST" (the digest names the vector file's content, so a name deleted and added
  again with another vector is another key: an engine never answers it with the old one);
- `layers`: each task-store layer task (`core.layer_task`) → (its default positions,
  additive): the gate hands them to the engine beside its key (`wire.LAYER_KEY`);
- `chat`: each chat-fitted task-store task → the sha256 of the template it was fitted through;
- `in_flight`: requests in flight per counted name (a LoRA adapter's, a task key, a
  command-line task's), counted by the gate until the handler returns; a DELETE waits on it;
- `store`: the task endpoints' hooks the gate calls (`StoreHooks`), None without a store.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ltv_vllm.serving.contract.wire import chat_fitted, named_tasks

STATE = "ltv_registry"  # the attribute of the app's state that holds it


@dataclass
class StoreHooks:
    """What the gate asks of a task-store server (set by the task endpoints)."""

    # the store's tasks as `/v1/models` cards
    listing: Callable[[], list[dict[str, Any]]]
    # a model this replica does not serve yet (a shared store's): None, or why it gets a 503
    resolve: Callable[[str], Awaitable[str | None]] | None = None
    # a request the gate refused: (scope, key id, status[, op, name, error]), audited
    audit_refusal: Callable[..., Awaitable[None]] | None = None


@dataclass
class TaskRegistry:
    keys: dict[str, str] = field(default_factory=dict)
    layers: dict[str, tuple[str, bool]] = field(default_factory=dict)
    chat: dict[str, str] = field(default_factory=dict)
    in_flight: Counter[str] = field(default_factory=Counter)
    store: StoreHooks | None = None

    @classmethod
    def of(cls, state: Any) -> TaskRegistry:
        """The registry of the app whose `state` this is (made on first use)."""
        registry = getattr(state, STATE, None)
        if registry is None:
            registry = cls()
            setattr(state, STATE, registry)
        return registry

    # -- names and keys ---------------------------------------------------------------------
    def serve(self, name: str, key: str, layer: tuple[str, bool] | None = None) -> None:
        """Serve store task `name` by engine key `key`; `layer`: a layer task's (default
        positions, additive) (`taskstore.Entry.layer`)."""
        self.keys[name] = key
        if layer is None:
            self.layers.pop(name, None)
        else:
            self.layers[name] = layer

    def unserve(self, name: str) -> str | None:
        """Forget a store task (its key, layer kind and chat digest); its key, if it was
        served by one."""
        self.chat.pop(name, None)
        self.layers.pop(name, None)
        return self.keys.pop(name, None)

    def fitted_chat(self, name: str, digest: str | None) -> None:
        """Record a store task's chat template digest (None: fitted on completions)."""
        if digest is None:
            self.chat.pop(name, None)
        else:
            self.chat[name] = digest

    def key_of(self, name: str) -> str:
        """The engine key a request for `name` is admitted with (a command-line task's is its
        name)."""
        return self.keys.get(name, name)

    def served_keys(self) -> frozenset[str]:
        """Every task key the engine may see from this process: the command line's and the
        store's."""
        return named_tasks() | frozenset(self.keys.values())

    def chat_fitted(self) -> dict[str, str]:
        """name → template sha256 of every chat-fitted task served (command line and store)."""
        return {**chat_fitted(), **self.chat}

    # -- requests in flight -----------------------------------------------------------------
    def enter(self, name: str) -> None:
        self.in_flight[name] += 1

    def leave(self, name: str) -> None:
        self.in_flight[name] -= 1
        if self.in_flight[name] <= 0:
            del self.in_flight[name]

    def held(self, name: str) -> int:
        return self.in_flight.get(name, 0)

    async def drained(self, name: str, poll: float = 0.05) -> None:
        """Wait until no request counted under `name` is in flight."""
        while self.held(name) > 0:
            await asyncio.sleep(poll)
