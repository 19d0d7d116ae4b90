"""API keys with roles: who may call what on a server.

    {"keys": [{"id": "ops", "role": "admin", "sha256": "<hex of the key>"},
              {"id": "app-1", "role": "inference", "sha256": "...", "expires": 1767225600},
              {"id": "team-a", "role": "admin", "sha256": "...",
               "scope": {"prefix": "team-a."}, "limits": {"in_flight": 8, "rate": 5}},
              {"id": "prometheus", "role": "metrics", "sha256": "..."}]}

`serve --api-keys FILE` reads this file (made by `ltv-vllm keys add | revoke | rotate`, which
print a new key once and store only its sha256): `inference` keys call the model routes and
list (completions, chat, `/v1/models`, `GET /v1/ltv/tasks`), `admin` keys also change the task
store (upload, compile, DELETE) and call vLLM's operator routes (scaling, aborting requests
by id, caches, sleep: `OPERATOR_ROUTES`), `metrics` keys only scrape `GET /metrics`. A key
with `expires` (Unix seconds, UTC) is refused from then on; `scope` and `limits`
(`contract.tenancy`) bound what a key reaches and takes. A running server reads the file
again when it changes (`KeyRing`, checked at most every `KEYS_POLL` seconds), so a key added,
revoked or rotated takes effect without a restart. The gate (`api_server.gate`) compares a
request's key against every stored hash in constant time and refuses a role's missing right
with a 403. vLLM's single `--api-key` stays what it was: one key with every right (an admin
key). Pure: no vLLM import; runs in the launcher (the `keys` commands, `serve`'s checks) and in
vLLM's API-server process (the gate).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from datetime import UTC
from pathlib import Path
from typing import Any, NamedTuple

from ltv_vllm.errors import UserError
from ltv_vllm.serving.contract.tenancy import Limits, Scope, TenancyError, limits_of, scope_of

ROLES = ("inference", "admin", "metrics")
KEYS_POLL_ENV = "LTV_VLLM_KEYS_POLL"  # seconds between looks at the keys file (a stat)
KEYS_POLL = 1.0
KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SINGLE_KEY_ID = "api-key"  # vLLM's --api-key, as the gate names it (audit log, metrics)


class KeysError(UserError):
    """A keys file that cannot be used (one line)."""


FIELDS = {"id", "role", "sha256", "expires", "scope", "limits"}


class Caller(NamedTuple):
    """Who sent a request, as the gate found it: the key's id and role, its scope (None:
    every task) and its limits (None: none)."""

    key_id: str
    role: str
    scope: Scope | None = None
    limits: Limits | None = None


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def read_keys(path: str | Path) -> list[dict[str, str]]:
    """The keys of a keys file, checked: ids unique and well formed, roles known, hashes
    sha256 hex. KeysError in one line otherwise."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise KeysError(f"--api-keys {p}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise KeysError(f"--api-keys {p}: not JSON ({e})") from None
    return check_keys(doc, f"--api-keys {p}")


def check_keys(doc: Any, where: str) -> list[dict[str, Any]]:
    """The keys of a keys document (`{"keys": [...]}`, read from `where`), checked."""
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not keys:
        raise KeysError(f"{where}: expected {{\"keys\": [...]}} with at least one key")
    seen: set[str] = set()
    return [_checked(k, f"{where}: key {i}", seen) for i, k in enumerate(keys)]


def _checked(k: Any, where: str, seen: set[str]) -> dict[str, Any]:
    """One keys-file entry, checked, as it is written back."""
    if not isinstance(k, dict) or not {"id", "role", "sha256"} <= set(k) <= FIELDS:
        raise KeysError(f"{where}: give id, role and sha256 (and expires, scope, limits, "
                        "if any), nothing else")
    if not isinstance(k["id"], str) or not KEY_ID.fullmatch(k["id"]):
        raise KeysError(f"{where}: id must be 1-64 letters, digits, '_', '.', '-'")
    if k["id"] in seen or k["id"] == SINGLE_KEY_ID:
        raise KeysError(f"{where}: id {k['id']!r} is taken")
    if k["role"] not in ROLES:
        raise KeysError(f"{where}: role must be one of {', '.join(ROLES)}, got "
                        f"{str(k['role'])[:40]!r}")
    if not isinstance(k["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", k["sha256"]):
        raise KeysError(f"{where}: sha256 must be 64 lowercase hex digits (the key's "
                        "hash, never the key)")
    if "expires" in k and (isinstance(k["expires"], bool)
                           or not isinstance(k["expires"], int) or k["expires"] < 0):
        raise KeysError(f"{where}: expires must be Unix seconds (an integer)")
    if "scope" in k and k["role"] == "metrics":
        raise KeysError(f"{where}: a metrics key scrapes the whole server; scope an "
                        "inference or admin key")
    try:
        scope, limits = scope_of(k), limits_of(k, None)
    except TenancyError as e:
        raise KeysError(f"{where}: {e}") from None
    seen.add(k["id"])
    return {"id": k["id"], "role": k["role"], "sha256": k["sha256"],
            **({"expires": k["expires"]} if "expires" in k else {}),
            **({"scope": scope.to_json()} if scope is not None else {}),
            **({"limits": limits.to_json()} if limits is not None else {})}


def check_id(key_id: str) -> None:
    if not KEY_ID.fullmatch(key_id) or key_id == SINGLE_KEY_ID:
        raise KeysError(f"key id {key_id!r}: use 1-64 letters, digits, '_', '.', '-' (not "
                        f"{SINGLE_KEY_ID!r})")


def write_keys(path: str | Path, keys: list[dict[str, Any]]) -> None:
    """The keys file written whole, then renamed into place (a server reading it meanwhile
    sees the old file or the new one, never half of one); 0600: hashes, but private."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"keys": keys}, f, indent=1)
        f.write("\n")
    os.replace(tmp, p)


def new_key() -> tuple[str, str]:
    """(a new key, its sha256)."""
    key = "ltv-" + secrets.token_urlsafe(32)
    return key, key_hash(key)


def added(keys: list[dict[str, Any]], key_id: str, role: str, expires: int | None = None,
          scope: dict[str, Any] | None = None, limits: dict[str, Any] | None = None,
          where: str = "the keys") -> tuple[list[dict[str, Any]], str]:
    """`keys` with a new key (its hash), and the key itself: the only time it is shown.
    `expires`: Unix seconds it is refused from; `scope`, `limits`: `contract.tenancy`."""
    if role not in ROLES:
        raise KeysError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    check_id(key_id)
    if any(k["id"] == key_id for k in keys):
        raise KeysError(f"key id {key_id!r} is in {where} already")
    key, digest = new_key()
    entry = {"id": key_id, "role": role, "sha256": digest,
             **({"expires": int(expires)} if expires is not None else {}),
             **({"scope": scope} if scope is not None else {}),
             **({"limits": limits} if limits is not None else {})}
    return [*keys, _checked(entry, f"key {key_id!r}", {k["id"] for k in keys})], key


def revoked(keys: list[dict[str, Any]], key_id: str,
            where: str = "the keys") -> list[dict[str, Any]]:
    """`keys` without `key_id`'s; the last key cannot go (a server with keys and none
    left would answer no one)."""
    rest = [k for k in keys if k["id"] != key_id]
    if len(rest) == len(keys):
        raise KeysError(f"no key {key_id!r} in {where}")
    if not rest:
        raise KeysError(f"{key_id!r} is the last key in {where}: add another first")
    return rest


def rotated(keys: list[dict[str, Any]], key_id: str, expires: int | None = None,
            where: str = "the keys") -> tuple[list[dict[str, Any]], str]:
    """`keys` with a new key for `key_id` (role, scope and limits kept), and the key.
    `expires` replaces the old expiry (None: the old one is kept)."""
    if not any(k["id"] == key_id for k in keys):
        raise KeysError(f"no key {key_id!r} in {where}")
    key, digest = new_key()
    return [{**k, "sha256": digest, **({"expires": int(expires)} if expires else {})}
            if k["id"] == key_id else k for k in keys], key


def add_key(path: str | Path, key_id: str, role: str, expires: int | None = None,
            scope: dict[str, Any] | None = None, limits: dict[str, Any] | None = None) -> str:
    """`added` to the keys file at `path` (created if missing); the new key."""
    p = Path(path)
    keys, key = added(read_keys(p) if p.exists() else [], key_id, role, expires, scope,
                      limits, where=str(p))
    write_keys(p, keys)
    return key


def revoke_key(path: str | Path, key_id: str) -> None:
    """`revoked` from the keys file (a running server refuses it within `KEYS_POLL`
    seconds)."""
    write_keys(path, revoked(read_keys(path), key_id, where=str(path)))


def rotate_key(path: str | Path, key_id: str, expires: int | None = None) -> str:
    """`rotated` in the keys file (the old key refused within `KEYS_POLL` seconds); the new
    key, shown once."""
    keys, key = rotated(read_keys(path), key_id, expires, where=str(path))
    write_keys(path, keys)
    return key


def parse_expiry(text: str, now: float) -> int:
    """`--expires`: a duration from `now` (`30d`, `12h`, `90m`) or an ISO-8601 date or time
    (UTC unless it says otherwise), as Unix seconds; KeysError in one line otherwise."""
    from datetime import datetime

    m = re.fullmatch(r"(\d+)([dhm])", text.strip())
    if m:
        return int(now) + int(m.group(1)) * {"d": 86400, "h": 3600, "m": 60}[m.group(2)]
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise KeysError(f"--expires {text!r}: give a duration (30d, 12h, 90m) or an ISO-8601 "
                        "date or time (2027-01-31, 2027-01-31T12:00:00Z)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if when.timestamp() <= now:
        raise KeysError(f"--expires {text!r} is in the past")
    return int(when.timestamp())


def expired(k: dict[str, Any], now: float) -> bool:
    return "expires" in k and now >= k["expires"]


# vLLM 0.32's operator routes (whatever the method): each changes the server for every client
# or acts on other clients' requests by id; some exist only with a flag or variable of vLLM's
OPERATOR_ROUTES = frozenset({
    "/scale_elastic_ep", "/is_scaling_elastic_ep",
    # abort any request by id (scale-out; --tokens-only's legacy path, and the RL router's)
    "/inference/v1/abort_requests", "/abort_requests",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
    "/start_profile", "/stop_profile",  # --profiler-config
    "/fault_tolerance/apply", "/fault_tolerance/status",  # --enable-fault-tolerance
    # VLLM_SERVER_DEV_MODE: caches, RPC into the workers, sleep, the RL weight routes
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/collective_rpc",
    "/server_info", "/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory",
    "/pause", "/resume", "/is_paused", "/get_world_size", "/weight_info", "/weight_checker",
    "/init_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
    "/update_weights", "/finish_weight_update", "/update_weight_version",
    "/shutdown_weight_transfer_engine",
})
# under /inference (vLLM's scale-out routes) an inference key calls generate only
INFERENCE_PREFIX, INFERENCE_ROUTES = "/inference/", ("/inference/v1/generate",)


def may(role: str, method: str, path: str, scoped: bool = False) -> bool:
    """Whether `role` may call `method path` (the gate's rule): admin everything; inference
    everything but the store's changes and the operator routes (`OPERATOR_ROUTES`, anything
    under /inference/ but generate); metrics only a scrape of /metrics. A `scoped` key
    (`contract.tenancy`) calls no operator route and does not scrape: those span tenants."""
    path = path.rstrip("/")
    if scoped and (path in OPERATOR_ROUTES or path == "/metrics"
                   or (path.startswith(INFERENCE_PREFIX) and path not in INFERENCE_ROUTES)):
        return False
    if role == "admin":
        return True
    if role == "metrics":
        return path == "/metrics" and method in ("GET", "HEAD")
    if role != "inference":
        return False
    if path.startswith("/v1/ltv/tasks") and method not in ("GET", "HEAD"):
        return False
    if path.startswith(INFERENCE_PREFIX):
        return path in INFERENCE_ROUTES
    return path not in OPERATOR_ROUTES


def identities(keys: list[dict[str, Any]] | None, single: list[str],
               now: float | None = None, limits: Limits | None = None
               ) -> list[tuple[bytes, Caller]]:
    """(sha256 digest, caller) of each accepted key: the keys file's not expired at `now`
    (None: every one), and vLLM's `--api-key` values as admin keys; `limits`: the server's
    default for a key without its own."""
    out = [(bytes.fromhex(k["sha256"]),
            Caller(k["id"], k["role"], scope_of(k), limits_of(k, limits)))
           for k in keys or [] if now is None or not expired(k, now)]
    out += [(hashlib.sha256(k.encode()).digest(), Caller(SINGLE_KEY_ID, "admin", None, limits))
            for k in single]
    return out


class KeyFile:
    """Where a server's keys live: a keys file (`serve --api-keys FILE`). `stamp` changes
    whenever the file does (size, mtime, inode); `read` gives its keys or a KeysError. A
    shared store's keys (`store.shared_keys.StoreKeys`) answer the same two calls."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __str__(self) -> str:
        return self.path

    def stamp(self) -> Any:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns, st.st_ino

    def read(self) -> list[dict[str, Any]]:
        return read_keys(self.path)


class KeyRing:
    """The keys a running server accepts (the API-server process's gate): the keys as
    `serve` read them (`keys`, hashes only), read again from `source` at the first look and
    whenever its stamp changes (a keys file's stat, a shared store's newest keys generation:
    at most every `poll` seconds), so an added, revoked or rotated key takes effect within
    `poll` seconds of the write, and an expired one at once. A source that does not read
    meanwhile (removed, malformed, unreachable) keeps the last good keys and is reported once
    (`problem`): an error in the keys never opens the server."""

    def __init__(self, keys: list[dict[str, Any]] | None, source: Any, single: list[str],
                 poll: float | None = None, limits: Limits | None = None) -> None:
        if isinstance(source, str | Path):
            source = KeyFile(str(source))
        self.keys, self.source, self.single = list(keys or []), source, list(single)
        self.limits = limits
        self.poll = float(os.environ.get(KEYS_POLL_ENV) or KEYS_POLL) if poll is None else poll
        # read at the first look too: the keys may have changed since `serve` read them
        self.stamp: Any = None
        self.checked = float("-inf")
        self.problem: str | None = None
        self._ids: list[tuple[Any, ...]] | None = None

    @property
    def path(self) -> str | None:
        """Where the keys are read from (None: only the keys given)."""
        return None if self.source is None else str(self.source)

    def due(self, now: float) -> bool:
        return self.source is not None and now - self.checked >= self.poll

    def refresh(self, now: float) -> str | None:
        """Read the keys again if they changed; a one-line problem the first time they do
        not read (None: fine, or reported already)."""
        if not self.due(now):
            return None
        self.checked = now
        try:
            stamp = self.source.stamp()
        except KeysError as e:
            return self._trouble(e, self.stamp)
        if stamp == self.stamp:
            return None
        try:
            keys = self.source.read()
        except KeysError as e:
            return self._trouble(e, stamp)
        self.keys, self.stamp, self.problem = keys, stamp, None
        self._ids = None
        return None

    def _trouble(self, e: KeysError, stamp: Any) -> str | None:
        self.stamp = stamp  # looked at: not read again until it changes
        if str(e) != self.problem:
            self.problem = str(e)
            return f"{e}; the keys read before stay in force"
        return None

    def accepted(self, now: float) -> list[tuple[bytes, Caller]]:
        """(sha256 digest, caller) of every key accepted at `now` (the digests decoded once
        per read of the keys, not per request)."""
        if self._ids is None:
            self._ids = [(k.get("expires"), *ident) for k, ident in
                         zip(self.keys, identities(self.keys, [], limits=self.limits),
                             strict=True)]
            self._ids += [(None, *ident)
                          for ident in identities([], self.single, limits=self.limits)]
        return [(digest, caller) for expires, digest, caller in self._ids
                if expires is None or now < expires]
