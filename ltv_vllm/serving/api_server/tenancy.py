"""Who is calling and what they may reach: the gate's keys, scopes and limits. Runs in vLLM's
API-server process (`api_server.gate` calls it first for every request).

- `KeyCheck`: the keys this process accepts (`contract.keys.KeyRing`: a keys file, or a
  shared store's keys, read again when they change), and the caller a request's key names.
  A shared store's keys are read in a thread, never on the event loop.
- `Limiter`: per key id, requests in flight and a token bucket of requests a second
  (`contract.tenancy.Limits`); a request past either is a 429 with `Retry-After`, counted on
  `/metrics` by key id (`metrics.key_request`).
- Scopes: a scoped key's models are the base model's names and the served tasks its scope
  covers. Any other `model` gets the gate's own 404, worded as vLLM's for a model it does
  not serve, whether the name exists or not (vLLM's own 404 would list every served name);
  `/v1/models` lists only its own; the task endpoints hide the rest (`endpoints`).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import secrets
import time
from collections import Counter
from typing import Any

from ltv_vllm.serving.api_server.asgi import base_names, error_response, json_error
from ltv_vllm.serving.api_server.registry import TaskRegistry
from ltv_vllm.serving.contract.keys import Caller, KeyRing
from ltv_vllm.serving.contract.settings import ServerSettings
from ltv_vllm.serving.contract.tenancy import Limits, Scope
from ltv_vllm.serving.contract.wire import named_tasks

KEY_STATE = "ltv_key"  # the request's key id in the ASGI scope's state (audit log)
SCOPE_STATE = "ltv_scope"  # ...and its scope (`contract.tenancy.Scope`; None: every task)
NOT_STARTED = [(b"", Caller("", ""))]  # before the app is up: no key matches


class KeyCheck:
    """The keys accepted by this API-server process, and who sent a request."""

    def __init__(self) -> None:
        self.ring: KeyRing | None = None
        self.reading: asyncio.Future | None = None  # a shared store's keys being read

    def _ring(self, scope: dict[str, Any]) -> KeyRing | None:
        args = getattr(getattr(scope.get("app"), "state", None), "args", None)
        if args is None:
            return None
        single = [k for k in (getattr(args, "api_key", None)
                              or [os.environ.get("VLLM_API_KEY")]) if k]
        settings = ServerSettings.from_env()
        source: Any = settings.api_keys_file
        if settings.keys_store:
            from ltv_vllm.serving.store.shared_keys import StoreKeys

            source = StoreKeys(settings.keys_store)
        limits = (Limits.of(settings.key_limits, "the server's key limits")
                  if settings.key_limits else None)
        return KeyRing(settings.api_keys, source, single, limits=limits)

    async def callers(self, scope: dict[str, Any]) -> list[tuple[bytes, Caller]] | None:
        """(sha256, caller) of each key accepted now; None: the server runs without keys."""
        if self.ring is None:
            ring = self._ring(scope)
            if ring is None:  # the app is not started yet: nothing is served either
                return NOT_STARTED
            self.ring = ring
        ring = self.ring
        if not (ring.keys or ring.source or ring.single):
            return None
        now = time.time()
        if ring.due(now):
            if getattr(ring.source, "remote", False):
                # a store's keys: read in a thread; requests meanwhile use the keys held
                # (the first read is awaited: `serve` read the keys it started with)
                if self.reading is None or self.reading.done():
                    self.reading = asyncio.ensure_future(asyncio.to_thread(_refresh, ring,
                                                                           now))
                if ring.stamp is None:
                    await asyncio.shield(self.reading)
            else:
                _refresh(ring, now)
        return ring.accepted(now)

    async def identify(self, scope: dict[str, Any]) -> Caller | None:
        """The caller a request's key names (a server without keys: an unscoped admin with
        the server's default limits); None: no key, or not one of the server's."""
        callers = await self.callers(scope)
        if callers is None:
            return Caller("", "admin", None, self.ring.limits if self.ring else None)
        auth = ""
        for k, v in scope.get("headers") or []:
            if k == b"authorization":
                auth = v.decode("latin-1")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer":
            return None
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found = None
        for t, caller in callers:  # constant time, every key compared
            if secrets.compare_digest(digest, t) and found is None:
                found = caller
        return found


def _refresh(ring: KeyRing, now: float) -> None:
    import logging

    if (problem := ring.refresh(now)) is not None:
        logging.getLogger(__name__).warning("ltv-vllm gate: %s", problem)


class Limiter:
    """Each key's requests in flight and its token bucket, in this process."""

    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()
        self.buckets: dict[str, tuple[float, float]] = {}  # key id → (tokens, when)

    def take(self, caller: Caller, now: float) -> tuple[str, int] | None:
        """Take a slot for a request of `caller`'s: None (taken: `release` it when the
        request is done), or (the limit it is past, seconds to retry after)."""
        lim = caller.limits
        if lim is None:
            return None
        kid = caller.key_id
        if lim.in_flight is not None and self.in_flight[kid] >= lim.in_flight:
            return "in_flight", 1
        if lim.rate is not None:
            tokens, then = self.buckets.get(kid, (float(lim.bucket), now))
            tokens = min(float(lim.bucket), tokens + max(0.0, now - then) * lim.rate)
            if tokens < 1.0:
                self.buckets[kid] = (tokens, now)
                return "rate", max(1, math.ceil((1.0 - tokens) / lim.rate))
            self.buckets[kid] = (tokens - 1.0, now)
        self.in_flight[kid] += 1
        return None

    def release(self, caller: Caller) -> None:
        if caller.limits is None:
            return
        self.in_flight[caller.key_id] -= 1
        if self.in_flight[caller.key_id] <= 0:
            del self.in_flight[caller.key_id]


def too_many(caller: Caller, limit: str, retry: int) -> bytes:
    what = (f"{caller.limits.in_flight} requests in flight" if limit == "in_flight"
            else f"{caller.limits.rate:g} requests a second")
    return json_error(429, f"Too many requests: key {caller.key_id or '(none)'!r} may have "
                           f"{what}; retry after {retry} s", "RateLimitError")


# -- scopes ----------------------------------------------------------------------------------
def model_names(scope: dict[str, Any]) -> set[str]:
    """The base model's own served names (vLLM's served names but the command line's tasks,
    which are served names too)."""
    return base_names(scope) - named_tasks()


def served(scope: dict[str, Any], registry: TaskRegistry) -> set[str]:
    """Every task name this process serves now: the command line's, the store's by key, and
    LoRA adapters (vLLM's, loaded at runtime or given with --lora-modules)."""
    models = getattr(getattr(scope.get("app"), "state", None), "openai_serving_models", None)
    adapters = set(getattr(models, "lora_requests", None) or ())
    return {t for t in named_tasks() if "@" not in t} | set(registry.keys) | adapters


def hidden(s: Scope | None, name: Any, scope: dict[str, Any]) -> bool:
    """Whether a scoped caller names a model outside its scope (the base model is
    everyone's)."""
    return (s is not None and isinstance(name, str) and name not in model_names(scope)
            and not s.covers(name))


def missing(s: Scope | None, name: Any, scope: dict[str, Any],
            registry: TaskRegistry) -> bool:
    """Whether a scoped caller names a model of its scope this process does not serve
    (answered here, as vLLM would, without vLLM's list of every served name)."""
    return (s is not None and isinstance(name, str) and name not in model_names(scope)
            and name not in served(scope, registry))


def not_found(name: Any) -> bytes:
    """vLLM's 404 for a model it does not serve, without its list of served names."""
    return json_error(404, f"The model `{str(name)[:80]}` does not exist.", "NotFoundError",
                      "model")


def listing_filter(s: Scope | None, scope: dict[str, Any]) -> Any:
    """Which `/v1/models` cards a caller sees (None: all)."""
    if s is None:
        return None
    base = model_names(scope)
    return lambda card: card.get("id") in base or s.covers(card.get("id"))


def tenant_of(request: Any) -> Scope | None:
    """The scope of a request's key, in a route's handler (None: every task)."""
    return getattr(request.state, SCOPE_STATE, None)


def outside(request: Any, name: Any) -> Any:
    """A scoped key's 403 for adding a task outside its scope (None: in scope); the same
    answer whether the name is taken or not (the task endpoints check it first)."""
    tenant = tenant_of(request)
    if tenant is None or tenant.covers(name):
        return None
    return error_response(403, f"Forbidden: this key adds tasks only among {tenant.text()}",
                          "PermissionDeniedError", "name")
