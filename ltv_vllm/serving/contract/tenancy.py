"""What one key may reach and how much of the server it may take: its scope (the tasks a
tenant owns) and its limits (requests in flight, a request rate). Pure: no vLLM import; read
in the launcher (`ltv-vllm keys`, `serve`'s checks) and in vLLM's API-server process (the
gate, `api_server.tenancy`).

A key's entry in the keys file (`contract.keys`) may carry

    "scope":  {"prefix": "team-a."}            task names that start with it
              {"tasks": ["sst2", "agnews"]}    or these names only
    "limits": {"in_flight": 8, "rate": 5, "burst": 10}

A scoped key sees and uses only its tasks (and the bare base model); a scoped admin changes
the store only under its scope and calls none of vLLM's operator routes (they act on every
tenant). Limits without a key's own come from `serve --key-in-flight/--key-rate/--key-burst`
(`ServerSettings.key_limits`); none by default. A limit counts per key id and per
API-server process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ltv_vllm.errors import UserError

# a task name's characters (`store.taskstore.NAME`): a prefix is the start of one
PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
TASK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_SCOPE_TASKS = 256


class TenancyError(UserError):
    """A scope or limits entry that cannot be used (one line)."""


@dataclass(frozen=True)
class Scope:
    """The task names a key owns: those under `prefix`, or those in `tasks`."""

    prefix: str | None = None
    tasks: frozenset[str] | None = None

    def covers(self, name: Any) -> bool:
        if not isinstance(name, str):
            return False
        if self.prefix is not None:
            return name.startswith(self.prefix) and TASK.fullmatch(name) is not None
        return name in (self.tasks or ())

    def text(self) -> str:
        if self.prefix is not None:
            return f"names under {self.prefix!r}"
        return "the tasks " + ", ".join(repr(t) for t in sorted(self.tasks or ()))

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix} if self.prefix is not None else {
            "tasks": sorted(self.tasks or ())}

    @classmethod
    def of(cls, raw: Any, where: str) -> Scope:
        """A keys file's `scope` value, checked (TenancyError in one line)."""
        if not isinstance(raw, dict) or len(raw) != 1 or not {"prefix", "tasks"} & set(raw):
            raise TenancyError(f"{where}: scope must be {{\"prefix\": P}} or "
                               "{\"tasks\": [names]}")
        if "prefix" in raw:
            if not isinstance(raw["prefix"], str) or not PREFIX.fullmatch(raw["prefix"]):
                raise TenancyError(f"{where}: a scope's prefix must be 1-63 letters, digits, "
                                   "'_', '.', '-', starting with a letter or digit")
            return cls(prefix=raw["prefix"])
        tasks = raw["tasks"]
        if (not isinstance(tasks, list) or not tasks or len(tasks) > MAX_SCOPE_TASKS
                or not all(isinstance(t, str) and TASK.fullmatch(t) for t in tasks)):
            raise TenancyError(f"{where}: a scope's tasks must be 1-{MAX_SCOPE_TASKS} task "
                               "names")
        return cls(tasks=frozenset(tasks))


@dataclass(frozen=True)
class Limits:
    """How much of the server one key may take: requests in flight at once, and a token
    bucket of `rate` requests a second that holds `burst` (None: no such limit)."""

    in_flight: int | None = None
    rate: float | None = None
    burst: int | None = None

    def __post_init__(self) -> None:
        if self.in_flight is not None and (isinstance(self.in_flight, bool)
                                           or not isinstance(self.in_flight, int)
                                           or self.in_flight < 1):
            raise TenancyError(f"in_flight must be a whole number of at least 1, got "
                               f"{self.in_flight!r}")
        if self.rate is not None and (isinstance(self.rate, bool)
                                      or not isinstance(self.rate, int | float)
                                      or not 0 < self.rate <= 1e6):
            raise TenancyError(f"rate must be requests a second, above 0, got {self.rate!r}")
        if self.burst is not None and (isinstance(self.burst, bool)
                                       or not isinstance(self.burst, int) or self.burst < 1):
            raise TenancyError(f"burst must be a whole number of at least 1, got "
                               f"{self.burst!r}")
        if self.burst is not None and self.rate is None:
            raise TenancyError("burst sizes a rate limit: give rate with it")

    @property
    def bucket(self) -> int:
        """Requests the bucket holds: `burst`, else one second's worth (at least 1)."""
        return self.burst if self.burst is not None else max(1, int(self.rate or 1))

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in (("in_flight", self.in_flight), ("rate", self.rate),
                                  ("burst", self.burst)) if v is not None}

    def text(self) -> str:
        parts = ([f"{self.in_flight} in flight"] if self.in_flight else []) + (
            [f"{self.rate:g}/s (burst {self.bucket})"] if self.rate else [])
        return ", ".join(parts) or "none"

    @classmethod
    def of(cls, raw: Any, where: str) -> Limits:
        """A keys file's (or the settings') `limits` value, checked."""
        if not isinstance(raw, dict) or not raw or not set(raw) <= {"in_flight", "rate",
                                                                     "burst"}:
            raise TenancyError(f"{where}: limits must name in_flight, rate or burst")
        try:
            return cls(**raw)
        except TenancyError as e:
            raise TenancyError(f"{where}: {e}") from None


def scope_of(key: dict[str, Any]) -> Scope | None:
    """A keys-file entry's scope (None: every task)."""
    raw = key.get("scope")
    return None if raw is None else Scope.of(raw, f"key {key.get('id')!r}")


def limits_of(key: dict[str, Any], default: Limits | None) -> Limits | None:
    """A keys-file entry's limits, else the server's default (None: none)."""
    raw = key.get("limits")
    return default if raw is None else Limits.of(raw, f"key {key.get('id')!r}")
