"""API keys kept in a shared task store, so every replica follows one source: a key added,
rotated or revoked there (`ltv-vllm keys ... --store SPEC`) reaches every replica within its
keys poll (`contract.keys.KEYS_POLL`), no file to copy to each machine.

    STORE/keys/<generation>.json   {"generation", "keys": [...], "writer", "time"}: the keys
                                   file's document (hashes only), one generation per change

As the task index (`shared_store`): a change reads the newest generation g and creates g+1
only if absent (a compare-and-swap: two writers never lose each other's change), a reader
never sees a torn document, and generations older than KEEP are collected. The keys are as
trusted as the store: whoever can write it can add a key, as whoever can write a keys file.

Pure I/O, no vLLM: the `keys` commands write it, `serve` reads it to plan, the gate
(`api_server.tenancy`, vLLM's API-server process) follows it from a thread.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Callable
from typing import Any

from ltv_vllm.serving.contract.keys import KeysError, check_keys
from ltv_vllm.serving.store.shared_store import KEYS, SharedStore, StoreError, _now, drop_older

KEEP = 16  # generations kept
RETRIES = 32


def _key(g: int) -> str:
    return f"{KEYS}/{g:012d}.json"


class StoreKeys:
    """The keys of the shared store at `spec` (a `contract.keys.KeyRing` source: `stamp`,
    `read`; `update` for the `keys` commands). Every failure is one KeysError line."""

    remote = True  # the gate reads it off the event loop

    def __init__(self, spec: str) -> None:
        try:
            self.store = SharedStore(spec, create=False)
        except StoreError as e:
            raise KeysError(str(e)) from None

    def __str__(self) -> str:
        return f"the keys of task store {self.store}"

    def _io(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, the storage's failures worded by the store (`SharedStore._io`) as one
        KeysError line; `fn`'s own KeysError as it is."""
        own: list[KeysError] = []

        def guarded() -> Any:
            try:
                return fn()
            except KeysError as e:
                own.append(e)
                return None
        try:
            out = self.store._io(what, guarded)
        except StoreError as e:
            raise KeysError(str(e)) from None
        if own:
            raise own[0]
        return out

    def _generations(self) -> list[int]:
        return sorted(int(stem) for key in self.store.backend.keys(KEYS)
                      if (stem := key.rsplit("/", 1)[-1].removesuffix(".json")).isdigit())

    def stamp(self) -> int | None:
        """The newest keys generation (None: the store holds no keys)."""
        gens = self._io("list its keys", self._generations)
        return gens[-1] if gens else None

    def exists(self) -> bool:
        return self.stamp() is not None

    def _newest(self) -> tuple[int, list[dict[str, Any]]]:
        for _ in range(RETRIES):
            gens = self._generations()
            if not gens:
                return -1, []
            raw = self.store.backend.get(_key(gens[-1]))
            if raw is None:  # collected between the listing and the read
                continue
            try:
                doc = json.loads(raw)
            except (ValueError, RecursionError):
                raise KeysError(f"{self}: generation {gens[-1]} is not JSON") from None
            return gens[-1], check_keys(doc, f"{self}, generation {gens[-1]}")
        raise KeysError(f"{self}: the keys kept changing under the read")

    def read(self) -> list[dict[str, Any]]:
        """The newest generation's keys, checked (KeysError: none, unreadable, unreachable)."""
        g, keys = self._io("read its keys", self._newest)
        if g < 0:
            raise KeysError(f"{self}: no keys (add one: ltv-vllm keys add --store ...)")
        return keys

    def update(self, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
               ) -> list[dict[str, Any]]:
        """Publish `change(newest keys)` as the next generation, redone on a newer one when
        another writer published first; the keys published."""
        writer = f"{socket.gethostname()}:keys"
        try:
            self.store._io("create the store", self.store._create)  # as `serve` would
        except StoreError as e:
            raise KeysError(str(e)) from None

        def attempt() -> list[dict[str, Any]]:
            for i in range(RETRIES):
                g, keys = self._newest()
                new = change(keys)
                doc = {"generation": g + 1, "keys": new, "writer": writer, "time": _now()}
                if self.store.backend.create(_key(g + 1), json.dumps(doc, indent=1).encode()):
                    self._collect(g + 1)
                    return new
                time.sleep(random.uniform(0, 0.01 * (i + 1)))  # lost the race: read again
            raise KeysError(f"{self}: the keys changed {RETRIES} times under one update; "
                            "retry")
        return self._io("update its keys", attempt)

    def _collect(self, newest: int) -> None:
        drop_older(self.store.backend, self._generations, _key, newest, KEEP)
