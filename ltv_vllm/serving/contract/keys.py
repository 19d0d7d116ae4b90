"""API keys with roles: who may call what on a server.

    {"keys": [{"id": "ops", "role": "admin", "sha256": "<hex of the key>"},
              {"id": "app-1", "role": "inference", "sha256": "..."}]}

`serve --api-keys FILE` reads this file (made by `ltv-vllm keys add`, which prints each new
key once and stores only its sha256): `inference` keys call the model routes and list
(completions, chat, `/v1/models`, `GET /v1/ltv/tasks`), `admin` keys also change the task
store (upload, compile, DELETE) and call vLLM's operator routes (scaling, aborting requests
by id, caches, sleep: `OPERATOR_ROUTES`). The gate (`vllm_ext.middleware`)
compares a request's key against every stored hash in constant time and refuses a role's
missing right with a 403. vLLM's single `--api-key` stays what it was: one key with every
right (an admin key). Pure: no vLLM import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

from ltv_vllm.errors import UserError

ROLES = ("inference", "admin")
KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SINGLE_KEY_ID = "api-key"  # vLLM's --api-key, as the gate names it (audit log, metrics)


class KeysError(UserError):
    """A keys file that cannot be used (one line)."""


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
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not keys:
        raise KeysError(f"--api-keys {p}: expected {{\"keys\": [...]}} with at least one key")
    seen: set[str] = set()
    out = []
    for i, k in enumerate(keys):
        where = f"--api-keys {p}: key {i}"
        if not isinstance(k, dict) or set(k) != {"id", "role", "sha256"}:
            raise KeysError(f"{where}: give exactly id, role and sha256")
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
        seen.add(k["id"])
        out.append({"id": k["id"], "role": k["role"], "sha256": k["sha256"]})
    return out


def add_key(path: str | Path, key_id: str, role: str) -> str:
    """Make a new key, store its hash in the keys file (created if missing; written whole,
    then renamed into place) and return the key itself: the only time it is shown."""
    p = Path(path)
    keys = read_keys(p) if p.exists() else []
    if role not in ROLES:
        raise KeysError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if not KEY_ID.fullmatch(key_id) or key_id == SINGLE_KEY_ID:
        raise KeysError(f"key id {key_id!r}: use 1-64 letters, digits, '_', '.', '-' (not "
                        f"{SINGLE_KEY_ID!r})")
    if any(k["id"] == key_id for k in keys):
        raise KeysError(f"key id {key_id!r} is in {p} already")
    key = "ltv-" + secrets.token_urlsafe(32)
    keys.append({"id": key_id, "role": role, "sha256": key_hash(key)})
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # hashes, but private
    with os.fdopen(fd, "w") as f:
        json.dump({"keys": keys}, f, indent=1)
        f.write("\n")
    os.replace(tmp, p)
    return key


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


def may(role: str, method: str, path: str) -> bool:
    """Whether `role` may call `method path` (the gate's rule): admin everything; inference
    everything but the store's changes and the operator routes (`OPERATOR_ROUTES`, anything
    under /inference/ but generate)."""
    if role == "admin":
        return True
    path = path.rstrip("/")
    if path.startswith("/v1/ltv/tasks") and method not in ("GET", "HEAD"):
        return False
    if path.startswith(INFERENCE_PREFIX):
        return path in INFERENCE_ROUTES
    return path not in OPERATOR_ROUTES


def identities(keys: list[dict[str, Any]] | None, single: list[str]) -> list[
        tuple[bytes, str, str]]:
    """(sha256 digest, key id, role) of each accepted key: the keys file's, and vLLM's
    `--api-key` values as admin keys."""
    out = [(bytes.fromhex(k["sha256"]), k["id"], k["role"]) for k in keys or []]
    out += [(hashlib.sha256(k.encode()).digest(), SINGLE_KEY_ID, "admin") for k in single]
    return out
