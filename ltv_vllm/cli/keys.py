"""`ltv-vllm keys`: a server's API keys with roles, scopes and limits, in a keys file
(`serve --api-keys FILE`) or in a shared task store (`--store SPEC`: every replica serving
that store follows them). A thin layer over `serving.contract.keys` and
`serving.store.shared_keys`; runs in the user's shell."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

from ltv_vllm.cli.base import friendly, main

WHEN = ("Refuse the key from then on: a duration (30d, 12h, 90m) or an ISO-8601 date or "
        "time (UTC unless given)")
EXPIRES = click.option("--expires", default=None, metavar="WHEN", help=WHEN + " [default: never].")
# a rotated key keeps its id's expiry unless one is given (`contract.keys.rotated`)
ROTATE_EXPIRES = click.option("--expires", default=None, metavar="WHEN",
                              help=WHEN + " [default: the old key's expiry].")
FILE = click.argument("file", required=False, type=click.Path(dir_okay=False))
STORE = click.option("--store", default=None, metavar="SPEC",
                     help="The keys of this shared task store (file://DIR, s3://BUCKET/PREFIX, "
                          "or a shared store's directory) instead of a FILE.")


@main.group("keys")
def keys_group() -> None:
    """API keys with roles for `serve --api-keys FILE`, or kept in a shared task store."""


def _change(file: str | None, store: str | None,
            change: Callable[[list[dict[str, Any]], str], tuple[list[dict[str, Any]], Any]],
            create: bool = False) -> Any:
    """Apply `change(keys, where)` → (new keys, result) to FILE or the store's keys; the
    result."""
    from ltv_vllm.serving.contract.keys import KeysError, read_keys, write_keys

    if (file is None) == (store is None):
        raise KeysError("give a keys FILE or --store SPEC (one of them)")
    out: list[Any] = []
    if store is not None:
        from ltv_vllm.serving.store.shared_keys import StoreKeys

        source = StoreKeys(store)

        def apply(keys: list[dict[str, Any]]) -> list[dict[str, Any]]:
            new, result = change(keys, str(source))
            out[:] = [result]
            return new
        source.update(apply)
        return out[0]
    from pathlib import Path

    p = Path(file)
    if not p.exists() and not create:
        raise KeysError(f"{p}: no such keys file")
    new, result = change(read_keys(p) if p.exists() else [], str(p))
    write_keys(p, new)
    return result


def _read(file: str | None, store: str | None) -> list[dict[str, Any]]:
    from ltv_vllm.serving.contract.keys import KeysError, read_keys

    if (file is None) == (store is None):
        raise KeysError("give a keys FILE or --store SPEC (one of them)")
    if store is not None:
        from ltv_vllm.serving.store.shared_keys import StoreKeys

        return StoreKeys(store).read()
    return read_keys(file)


def _when(expires: str | None) -> int | None:
    from ltv_vllm.serving.contract.keys import parse_expiry

    return parse_expiry(expires, time.time()) if expires is not None else None


@keys_group.command("add")
@FILE
@STORE
@click.option("--id", "key_id", required=True, help="The key's name (audit log, metrics).")
@click.option("--role", type=click.Choice(["inference", "admin", "metrics"]), required=True,
              help="inference: model routes and listing; admin: also the task store's changes "
                   "and vLLM's operator routes; metrics: GET /metrics only.")
@EXPIRES
@click.option("--prefix", default=None, help="Scope: the key sees, uses (and, an admin key, "
              "adds and deletes) only tasks whose names start with this [default: every task].")
@click.option("--task", "tasks", multiple=True, help="Scope: only this task (repeat for more).")
@click.option("--in-flight", type=int, default=None,
              help="Requests of this key's in flight at once [default: the server's].")
@click.option("--rate", type=float, default=None,
              help="Requests a second this key may send [default: the server's].")
@click.option("--burst", type=int, default=None,
              help="Requests over the rate the key may send at once [default: one second's].")
@friendly
def keys_add(file: str | None, store: str | None, key_id: str, role: str,
             expires: str | None, prefix: str | None, tasks: tuple[str, ...],
             in_flight: int | None, rate: float | None, burst: int | None) -> None:
    """Make a key, store its sha256 (in FILE, created if missing, or in the store), print the
    key once. Running servers accept it within a second, without a restart."""
    from ltv_vllm.serving.contract.keys import KeysError, added

    if prefix is not None and tasks:
        raise KeysError("scope a key by --prefix or by --task, not both")
    scope = {"prefix": prefix} if prefix is not None else (
        {"tasks": list(tasks)} if tasks else None)
    limits = {k: v for k, v in (("in_flight", in_flight), ("rate", rate), ("burst", burst))
              if v is not None} or None
    when = _when(expires)
    click.echo(_change(file, store, lambda keys, where: added(
        keys, key_id, role, when, scope, limits, where=where), create=True))


@keys_group.command("list")
@FILE
@STORE
@friendly
def keys_list(file: str | None, store: str | None) -> None:
    """The keys: id, role, scope, limits and when each expires (never a key or its hash)."""
    from ltv_vllm.serving.contract.keys import expired
    from ltv_vllm.serving.contract.tenancy import limits_of, scope_of

    now = time.time()
    for k in _read(file, store):
        when = ("never" if "expires" not in k else datetime.fromtimestamp(
            k["expires"], UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            + (" (expired)" if expired(k, now) else ""))
        scope, limits = scope_of(k), limits_of(k, None)
        click.echo(f"{k['id']}\t{k['role']}\texpires {when}\t"
                   f"scope {scope.text() if scope else 'every task'}\t"
                   f"limits {limits.text() if limits else 'the server default'}")


@keys_group.command("revoke")
@FILE
@STORE
@click.option("--id", "key_id", required=True, help="The key to take out.")
@friendly
def keys_revoke(file: str | None, store: str | None, key_id: str) -> None:
    """Take a key out: running servers refuse it within a second (LTV_VLLM_KEYS_POLL),
    without a restart."""
    from ltv_vllm.serving.contract.keys import revoked

    _change(file, store, lambda keys, where: (revoked(keys, key_id, where=where), None))
    click.echo(f"revoked {key_id}")


@keys_group.command("rotate")
@FILE
@STORE
@click.option("--id", "key_id", required=True,
              help="The key to replace (its role, scope and limits are kept).")
@ROTATE_EXPIRES
@friendly
def keys_rotate(file: str | None, store: str | None, key_id: str,
                expires: str | None) -> None:
    """A new key for an id, printed once; running servers refuse the old one within a
    second."""
    from ltv_vllm.serving.contract.keys import rotated

    when = _when(expires)
    click.echo(_change(file, store, lambda keys, where: rotated(keys, key_id, when,
                                                                 where=where)))
