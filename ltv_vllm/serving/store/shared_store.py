"""A task store many replicas share: the source of truth behind each replica's own working
copy (`taskstore.TaskStore`). Runs in vLLM's API-server process (a replica's uploads,
deletes and index polling), the launcher's (a replica's copy made at start) and the user's
shell (`ltv-vllm keys --store`, through `shared_keys`). It lives on a shared volume (a
directory every replica mounts) or in object storage (the S3 API, through boto3):

    STORE/ltv-store.json                      {"format": 1}: marks a shared store
    STORE/objects/<sha256>.safetensors        a served vector, named by its content; written
                                              once (create-if-absent), never changed
    STORE/index/<generation>.json             the name → entry index: {"generation", "tasks":
                                              {name: {"digest", "record"}}, "writer", "time"};
                                              generation g+1 is created only if absent

An index update reads the newest generation g, applies its change and creates g+1; when
another replica created g+1 first, the create fails and the update is redone on the new
index — a compare-and-swap, so two replicas uploading one name end with one winner, and no
reader ever sees a torn index (a generation is one object, written whole). On a directory the
create is a hard link of a complete file (atomic on local filesystems and NFS); on S3 a
conditional write (`If-None-Match: *`). Objects are immutable and content-addressed, so a
replica that downloaded one never sees it change, and nothing a replica does removes a file
another replica reads: replicas serve their own local copies (`TaskStore`), objects are never
deleted here, and only index generations older than `KEEP` are collected.

The index is untrusted input (any replica, any release, anyone who can write the storage
writes it): a replica serves only the entries in the shape `add` writes, at most its
--max-tasks of them, oldest first (`Index.servable`), and skips the others, reported.

Pure I/O, no vLLM: `serve` reads it to plan, the task endpoints (`api_server.endpoints`) to
upload, delete and follow the index.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ltv_vllm.serving.store.taskstore import FORMAT as ENTRY_FORMAT
from ltv_vllm.serving.store.taskstore import (
    NAME,
    EntryExists,
    NoSuchEntry,
    StoreError,
    alive,
    check_name,
)

FORMAT = 1
MARKER, OBJECTS, INDEX = "ltv-store.json", "objects", "index"
KEYS = "keys"  # the store's API keys, if it holds any (`shared_keys`)
KEEP = 64  # index generations kept (older ones are collected by the writer of a newer one)
RETRIES = 64  # compare-and-swap attempts before an update gives up (StoreUnavailable)
SCHEMES = ("s3://", "file://")
DIGEST = re.compile(r"[0-9a-f]{64}")
# why a replica skips an index entry (the label of `ltv_vllm:task_store_skipped_records`: a
# fixed set, whatever the index holds)
SKIPS = ("name", "entry", "digest", "record", "format", "max_tasks")


class StoreUnavailable(StoreError):
    """The shared store cannot be reached or did not answer (HTTP 503): nothing changed."""


def is_shared(spec: str | os.PathLike | None) -> bool:
    """Whether `--task-store SPEC` names a shared store: an `s3://` or `file://` URL, or a
    directory that is one already (its marker file)."""
    if spec is None:
        return False
    s = str(spec)
    return s.startswith(SCHEMES) or (Path(s) / MARKER).is_file()


def several_api_servers(shared: bool, lora: bool) -> str | None:
    """Why a task store cannot be served by several API-server processes, as one line, or
    None: each follows a shared store (a store DIR is one process's), and serves tasks by key
    (adapters loaded at run time live in one process: vLLM refuses runtime LoRA loading with
    several)."""
    if not shared:
        return ("several API-server processes (--api-server-count) each follow a shared task "
                "store: give --task-store file://DIR (or s3://BUCKET/PREFIX) instead of a DIR "
                "of one server's")
    if lora:
        return ("--multi-task lora loads a task store's adapters at run time, which vLLM "
                "allows in one API-server process only: drop --api-server-count, or serve "
                "tasks by key (the default)")
    return None


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- where the bytes live ------------------------------------------------------------------------
class DirBackend:
    """Keys as files under a directory (a shared volume)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __str__(self) -> str:
        return str(self.root)

    def get(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if absent, whole or not at all; whether this call wrote it."""
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{path.name}-{os.getpid()}-{random.getrandbits(32):08x}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # fails if the key exists: the create-if-absent
            except FileExistsError:
                return False
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def keys(self, prefix: str) -> list[str]:
        d = self.root / prefix
        if not d.is_dir():
            return []
        return [f"{prefix}/{p.name}" for p in d.iterdir() if not p.name.startswith(".")]

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)


class S3Backend:
    """Keys as objects under `s3://BUCKET/PREFIX` (boto3; the endpoint and credentials as the
    AWS tools read them: `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, profiles, roles)."""

    # a store that does not answer fails a request in seconds, not minutes (one attempt:
    # a replica reads the index again at its next poll anyway)
    TIMEOUTS = {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 1}}

    def __init__(self, url: str) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise StoreError(f"task store {url}: an s3:// store needs boto3 "
                             "(the s3 extra: pip install -e '.[s3]' in a checkout, or "
                             "pip install 'boto3>=1.35')") from None
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise StoreError(f"task store {url}: name a bucket (s3://BUCKET/PREFIX)")
        self.url, self.bucket, self.prefix = url, bucket, prefix.strip("/")
        self.client = boto3.client("s3", config=Config(**self.TIMEOUTS))

    def __str__(self) -> str:
        return self.url

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def create(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                   IfNoneMatch="*")
        except ClientError as e:
            # 412: it exists; 409: a concurrent conditional write of the same key is under way
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed",
                                                           "ConditionalRequestConflict"):
                return False
            raise
        return True

    def keys(self, prefix: str) -> list[str]:
        full = self._key(prefix) + "/"
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full):
            out += [f"{prefix}/{o['Key'][len(full):]}" for o in page.get("Contents", [])]
        return out

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))


# -- the store -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Index:
    generation: int
    # name → {digest, record}, as stored: untrusted (any replica, any release, anyone with
    # write access to the storage writes it), so a reader serves `servable()` only, and a
    # writer keeps what it cannot read (a newer release's records) as it is
    tasks: dict[str, Any] = field(default_factory=dict)

    def digest(self, name: str) -> str | None:
        item = self.tasks.get(name)
        digest = item.get("digest") if isinstance(item, dict) else None
        return digest if isinstance(digest, str) else None

    def servable(self, limit: int | None = None
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[str, str]]]:
        """The entries a replica may serve: each in the shape `add` writes (`entry_problem`),
        the first `limit` of them in the index's order (oldest first: `add` appends, and a
        change keeps the order), so every replica picks the same ones; and every other
        entry, name → (reason, one line why), the reason one of SKIPS."""
        good: dict[str, dict[str, Any]] = {}
        skipped: dict[str, tuple[str, str]] = {}
        for name, item in self.tasks.items():
            if (problem := entry_problem(name, item)) is not None:
                skipped[name] = problem
            elif limit is not None and len(good) >= limit:
                skipped[name] = ("max_tasks", f"over this replica's --max-tasks {limit} (the "
                                 "index holds more tasks; the oldest are served)")
            else:
                good[name] = item
        return good, skipped


def entry_problem(name: Any, item: Any) -> tuple[str, str] | None:
    """Why an index entry is not one this release can serve, as (reason, one line), or None:
    a valid name → {"digest": 64 hex digits, "record": an entry record of format
    `taskstore.FORMAT` whose numbers are finite (strict JSON, as the entry's `entry.json`
    and the server's answers are), its rank an integer}."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return "name", "not a valid task name"
    if not isinstance(item, dict) or set(item) != {"digest", "record"}:
        return "entry", "not an index entry (an object of a digest and a record)"
    if not isinstance(item["digest"], str) or not DIGEST.fullmatch(item["digest"]):
        return "digest", "its digest is not a sha256 (64 lowercase hex digits)"
    record = item["record"]
    if not isinstance(record, dict):
        return "record", "its record is not an object"
    fmt = record.get("format")
    if type(fmt) is not int or fmt != ENTRY_FORMAT:  # not True, not 1.0: what `add` writes
        return "format", (f"its record is format {repr(fmt)[:16]}; this release reads format "
                          f"{ENTRY_FORMAT} (a newer ltv-vllm wrote it?)")
    for key in ("rank", "full_rank", "lora_rank"):
        v = record.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return "record", f"its record's {key} is not a whole number"
    stack: list[Any] = [record]
    while stack:  # a loop, not a recursion: nesting as deep as the JSON parser allows
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return "record", "its record holds a number that is not finite (NaN or infinity)"
        if isinstance(v, dict):
            stack += v.values()
        elif isinstance(v, list):
            stack += v
    return None


def _generation_key(g: int) -> str:
    return f"{INDEX}/{g:012d}.json"


class SharedStore:
    """A shared task store at `spec` (`s3://BUCKET/PREFIX`, `file:///path`, or a directory
    holding one); created when missing and `create`. Every call goes to the storage: the
    store itself keeps no state, so any number of processes may hold one."""

    def __init__(self, spec: str | os.PathLike, *, create: bool = True) -> None:
        s = str(spec)
        self.url = s
        if s.startswith("s3://"):
            self.backend: DirBackend | S3Backend = S3Backend(s)
        else:
            root = Path(s[len("file://"):] if s.startswith("file://") else s).absolute()
            if root.exists() and not root.is_dir():
                raise StoreError(f"task store {root}: not a directory")
            self.backend = DirBackend(root)
        if create:
            self._io("create the store", self._create)

    def __str__(self) -> str:
        return str(self.backend)

    def _io(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, with the storage's failures as one StoreUnavailable line."""
        try:
            return fn()
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - OSError, botocore's errors: the store's
            # the store's own path out before the cut: no part of it is left to scrub
            detail = str(e).replace(str(self), "<task store>")[:200]
            raise StoreUnavailable(f"task store {self}: could not {what} "
                                   f"({type(e).__name__}: {detail})") from None

    def size(self) -> int:
        """How many tasks the store holds, read only: 0 for a store not made yet (a new
        bucket prefix, an empty or new directory); StoreError for a directory that holds
        something else, StoreUnavailable when the storage does not answer."""
        def read() -> int:
            if self.backend.get(MARKER) is None:
                self._refuse_foreign()
                return 0
            if not self._generations():  # being made by another replica right now
                return 0
            return len(self._index().tasks)
        return self._io("read its index", read)

    def _refuse_foreign(self) -> None:
        if isinstance(self.backend, DirBackend) and self.backend.root.is_dir() and any(
                p for p in self.backend.root.iterdir()
                if not p.name.startswith(".")
                and p.name not in (MARKER, INDEX, OBJECTS, KEYS)):
            raise StoreError(f"task store {self}: a directory that is not a shared store (it "
                             "holds other files); give an empty or new directory")

    def _create(self) -> None:
        raw = self.backend.get(MARKER)
        if raw is None:
            self._refuse_foreign()
            self.backend.create(MARKER, json.dumps({"format": FORMAT}).encode())
            raw = self.backend.get(MARKER)
        try:
            fmt = json.loads(raw or b"{}").get("format")
        except ValueError:
            fmt = None
        if fmt != FORMAT:
            raise StoreError(f"task store {self}: not a format-{FORMAT} shared store")
        if not self._generations():
            self.backend.create(_generation_key(0), json.dumps(
                {"generation": 0, "tasks": {}, "writer": "create", "time": _now()}).encode())

    # -- the index --------------------------------------------------------------------------------
    def _generations(self) -> list[int]:
        out = []
        for key in self.backend.keys(INDEX):
            stem = key.rsplit("/", 1)[-1].removesuffix(".json")
            if stem.isdigit():
                out.append(int(stem))
        return sorted(out)

    def index(self) -> Index:
        """The newest index (StoreUnavailable: the store did not answer)."""
        return self._io("read its index", self._index)

    def _index(self) -> Index:
        for _ in range(RETRIES):
            gens = self._generations()
            if not gens:
                raise StoreError(f"task store {self}: no index (not a shared store?)")
            raw = self.backend.get(_generation_key(gens[-1]))
            if raw is None:  # collected between the listing and the read: list again
                continue
            try:
                doc = json.loads(raw)
                tasks = doc["tasks"]
                if doc["generation"] != gens[-1] or not isinstance(tasks, dict):
                    raise ValueError("generation")
            except (ValueError, KeyError, TypeError, RecursionError):
                raise StoreError(f"task store {self}: index generation {gens[-1]} is "
                                 "unreadable") from None
            return Index(gens[-1], tasks)
        raise StoreUnavailable(f"task store {self}: its index kept changing under the read")

    def update(self, change: Callable[[dict[str, dict[str, Any]]], None],
               writer: str) -> Index:
        """Apply `change` (in place, to a copy of the newest index's tasks; it may raise
        EntryExists / NoSuchEntry) and publish it as the next generation; redone on the newer
        index when another writer published first. The index published."""
        def attempt() -> Index:
            for i in range(RETRIES):
                cur = self._index()
                tasks = json.loads(json.dumps(cur.tasks))
                change(tasks)
                nxt = Index(cur.generation + 1, tasks)
                doc = {"generation": nxt.generation, "tasks": tasks, "writer": writer,
                       "time": _now()}
                if self.backend.create(_generation_key(nxt.generation),
                                       json.dumps(doc, indent=1).encode()):
                    self._collect(nxt.generation)
                    return nxt
                time.sleep(random.uniform(0, 0.01 * (i + 1)))  # lost the race: read again
            raise StoreUnavailable(f"task store {self}: the index changed {RETRIES} times "
                                   "under one update; retry")
        return self._io("update its index", attempt)

    def _collect(self, newest: int) -> None:
        """Drop index generations older than KEEP before `newest` (a reader that listed one
        of them reads the list again)."""
        drop_older(self.backend, self._generations, _generation_key, newest, KEEP)

    # -- entries ----------------------------------------------------------------------------------
    def put_vector(self, data: bytes) -> str:
        """Store a vector file's bytes as its object (kept as it is when present: the same
        name is the same content); its sha256."""
        digest = digest_of(data)
        self._io("store a vector", lambda: self.backend.create(f"{OBJECTS}/{digest}.safetensors",
                                                                data))
        return digest

    def vector(self, digest: str) -> bytes:
        """The object's bytes, checked against its name (StoreError: missing or changed)."""
        data = self._io("read a vector",
                        lambda: self.backend.get(f"{OBJECTS}/{digest}.safetensors"))
        if data is None:
            raise StoreError(f"task store {self}: vector {digest[:16]} is missing")
        if digest_of(data) != digest:
            raise StoreError(f"task store {self}: vector {digest[:16]} does not match its "
                             "digest (changed or truncated in storage)")
        return data

    def add(self, name: str, digest: str, record: dict[str, Any], writer: str) -> Index:
        """Publish NAME → digest (EntryExists when the name is taken)."""
        check_name(name)

        def change(tasks: dict[str, Any]) -> None:
            if name in tasks:
                raise EntryExists(f"task {name!r} already exists in the task store")
            tasks[name] = {"digest": digest, "record": record}
        return self.update(change, writer)

    def remove(self, name: str, writer: str, digest: str | None = None) -> Index:
        """Unpublish NAME (NoSuchEntry when absent, or when `digest` is given and the name
        holds another vector: a rollback never removes another writer's entry)."""
        check_name(name)

        def change(tasks: dict[str, Any]) -> None:
            item = tasks.get(name)
            if name not in tasks or (digest is not None and (
                    not isinstance(item, dict) or item.get("digest") != digest)):
                raise NoSuchEntry(f"no task {name!r} in the task store")
            del tasks[name]
        return self.update(change, writer)


def drop_older(backend: Any, generations: Callable[[], list[int]],
               key_of: Callable[[int], str], newest: int, keep: int) -> None:
    """Delete the generations (`key_of(g)`) older than `keep` before `newest`; best effort:
    the next writer collects what this one could not."""
    try:
        for g in generations():
            if g <= newest - keep:
                backend.delete(key_of(g))
    except Exception:  # noqa: BLE001 - the storage's errors, whatever the backend
        pass


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


# -- each replica's own copy ------------------------------------------------------------------
def replica_root(shared: str) -> Path:
    """Where this server keeps its copy of a shared store: its own directory (locked while
    it runs) beside other replicas' on this machine, under the cache."""
    import secrets

    from ltv_vllm.models.cache import cache_dir

    key = digest_of(shared.encode())[:12]
    return cache_dir() / "task-replicas" / key / f"replica-{secrets.token_hex(6)}"


def sweep_replicas(parent: Path) -> list[str]:
    """Remove the copies of replicas that no longer run (their lock is free, and they have
    not changed for a minute: one starting beside this one has not taken its lock yet); the
    names."""
    import shutil

    from ltv_vllm.serving.store.taskstore import TaskStore

    gone = []
    if parent.is_dir():
        for p in parent.iterdir():
            if p.is_dir() and p.name.startswith("replica-") and not TaskStore(
                    p, create=False).held() and time.time() - p.stat().st_mtime > 60:
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
    return gone


def own_copy(shared: str) -> tuple[Path, int]:
    """This process's copy of a shared store, made now: replicas' copies that no longer run
    swept, a new directory locked (for this process's life; `TaskStore.hold`). Its path
    and the lock's descriptor."""
    from ltv_vllm.serving.store.taskstore import TaskStore

    root = replica_root(shared)
    sweep_replicas(root.parent)
    return root, TaskStore(root).hold()



# -- the API-server processes of one replica ----------------------------------------------------
class Siblings:
    """The API-server processes of one replica (vLLM's `--api-server-count`): each follows the
    shared store on its own, into an entry directory of its own, and pins into the copy's
    pins, which their one engine loads. In the copy's FOLLOW directory each records the index
    generation it has followed (a file named by its pid), and one that changed the store says
    so (NUDGE), so the others follow at once, not at their next poll: a change is answered
    when every live sibling serves what it published (`behind`)."""

    FOLLOW, NUDGE = ".follow", "nudge"

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / self.FOLLOW
        self.dir.mkdir(exist_ok=True)
        self.me = str(os.getpid())
        self.stamp = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = (self.dir / self.NUDGE).stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _write(self, name: str, text: str) -> None:
        tmp = self.dir / f".{name}.{self.me}"
        tmp.write_text(text)
        os.replace(tmp, self.dir / name)

    def followed(self, generation: int) -> None:
        """This process serves the index as of `generation`."""
        self._write(self.me, str(generation))

    def nudge(self) -> None:
        """Tell the others the index changed (a new file each time: its inode is the news)."""
        self._write(self.NUDGE, f"{self.me} {time.time_ns()}")

    def nudged(self) -> bool:
        """Whether another process changed the index since this one last looked."""
        stamp = self._stamp()
        if stamp == self.stamp:
            return False
        self.stamp = stamp
        return True

    def behind(self, generation: int) -> list[str]:
        """The live siblings that have not followed `generation` yet (their pids)."""
        out = []
        for p in self.dir.iterdir():
            if p.name in (self.me, self.NUDGE) or p.name.startswith(".") or not alive(p.name):
                continue
            try:
                if int(p.read_text()) < generation:
                    out.append(p.name)
            except (OSError, ValueError):
                continue  # replaced meanwhile: read again at the next look
        return out
