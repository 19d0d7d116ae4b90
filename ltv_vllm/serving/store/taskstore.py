"""The task store: tasks compiled (or uploaded) for a server, one directory per task.

    ROOT/NAME/                    one entry: complete, or absent
        adapter_config.json       the task's lm_head LoRA in PEFT format (`store.lora`),
        adapter_model.safetensors   so vLLM's runtime LoRA loading takes ROOT/NAME as it is
        ltv_vllm.json             the adapter's provenance (written by export_lora)
        vector.safetensors        the served task vector: the adapter's own factors (an entry
                                  cut to the served rank stores the cut vector, so what is
                                  stored is exactly what is served)
        entry.json                the task spec and how the entry was made (`Entry.record`)
                                  (a layer task's entry, `core.layer_task`, holds its file
                                  and entry.json only: it shifts inside the decoder, which
                                  no LoRA adapter does; it is served per request)
    ROOT/.tmp-NAME-XXXX/          an entry being written (`stage`); renamed to ROOT/NAME by
                                  `publish` when complete
    ROOT/.del-NAME-XXXX/          an entry being removed; renamed away first, then deleted
    ROOT/.up-XXXX/                an upload being parsed (the server's /v1/ltv/tasks)
    ROOT/.jobs/                   compiles under way (the server's; dropped at its start)
    ROOT/.quarantine/NAME-TIME/   an entry a server could not serve at start, moved aside
                                  with `reason.txt` (never deleted by ltv-vllm)
    ROOT/.lock                    held (flock) by the one server serving the store, for its
                                  whole life: a second server refuses to start (`hold`)
    ROOT/.pins/NAME@DIGEST.safetensors
                                  the vector an engine loads for a served task's key (a hard
                                  link of the entry's vector, `pin`): a DELETE removes the
                                  entry at once (its name is free again) and the pin only
                                  when the requests admitted with that key are done
    ROOT/.pins/NAME@DIGEST.held/PID
                                  the server processes holding that pin (several API-server
                                  processes of one server pin into one place); the last to
                                  let it go removes it

A directory rename is atomic, so a reader (the server, vLLM's filesystem LoRA resolver) sees
a whole entry or none: a crash mid-write leaves only a `.tmp-` directory, which `sweep()`
removes. Each adapter records the served model's path as its base model, which is what vLLM's
filesystem resolver compares against the engine's `--model`. The store's invariants, as the
server keeps them, are in docs/task-store.md.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import umask
from ltv_vllm.core.layer_task import KIND as LAYER_KIND
from ltv_vllm.core.layer_task import LayerTask, load_any
from ltv_vllm.core.vector import TaskVector, finite_or_none
from ltv_vllm.errors import UserError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
FORMAT = 1
VECTOR, RECORD, LOCK, PINS = "vector.safetensors", "entry.json", ".lock", ".pins"
HOLDERS = ".held"  # PINS/KEY.held/PID: the processes holding a pin


class StoreError(UserError):
    """A task-store request that cannot be done (one line)."""


class EntryExists(StoreError):
    """The name is taken (HTTP 409)."""


class NoSuchEntry(StoreError):
    """No complete entry of that name (HTTP 404)."""


class StoreHeld(StoreError):
    """Another running server serves this store."""


class StoreFull(StoreError):
    """The store's disk (or the process's file-size limit) took no more (HTTP 507)."""


# out of space, out of quota, or past RLIMIT_FSIZE: all "this write cannot fit"
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def full_disk(e: BaseException, what: str, root: Path) -> StoreFull | None:
    """`e` as a one-line StoreFull when it says the disk is full; otherwise None."""
    if isinstance(e, OSError):
        code, why = e.errno, e.strerror
    else:  # safetensors' writer (Rust) raises SafetensorError, with the errno only in text
        m = re.search(r"I/O error: (.*) \(os error (\d+)\)", str(e))
        code, why = (int(m[2]), m[1]) if m else (None, None)
    if code not in _FULL:
        return None
    return StoreFull(f"{what}: the task store's disk is full ({root}: {why}); free "
                     "space or DELETE tasks, then retry")


def vector_digest(path: str | Path) -> str:
    """A vector file's content, named: the first 16 hex digits of its sha256 (a served store
    task's engine key, `wire.task_key`, which the engine checks when it loads it)."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise StoreError(f"task name {name!r}: use 1-64 letters, digits, '_', '.', '-', "
                         "starting with a letter or digit")
    return name


@dataclass(frozen=True)
class Entry:
    name: str
    path: Path
    record: dict[str, Any]

    @property
    def vector_path(self) -> Path:
        return self.path / VECTOR

    def vector(self) -> TaskVector | LayerTask:
        return load_any(self.vector_path)

    @property
    def layer(self) -> tuple[str, bool] | None:
        """A layer task's (default positions, additive), from its record; None: a vector."""
        if self.record.get("kind") != LAYER_KIND:
            return None
        return str(self.record.get("positions")), bool(self.record.get("additive"))

    def chat_template(self) -> str | None:
        """sha256 of the chat template a chat-fitted entry's vector was fitted through (read
        from the vector, validated on load; None: fitted on the completion prompt)."""
        return chat_template_of(self.vector())


def chat_template_of(tv: TaskVector | LayerTask) -> str | None:
    fmt = tv.provenance.prompt_format
    return fmt["template_sha256"] if fmt and fmt.get("name") == "chat" else None


def record_of(name: str, tv: TaskVector | LayerTask, *, source: str, lora_rank: int,
              full_rank: int | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What `entry.json` says about a task: enough to list it without loading tensors.
    `rank` is the served (stored) rank; `full_rank` the rank before a cut. A layer task's
    record says so (`kind` "layer") with its blocks, default positions and additivity."""
    p = tv.provenance
    kind = {"kind": tv.kind} if isinstance(tv, TaskVector) else {
        "kind": LAYER_KIND, "layers": list(tv.layers), "positions": str(tv.policy),
        "additive": tv.additive}
    # strict JSON: entry.json and the server's answers refuse NaN
    return finite_or_none({
        "format": FORMAT, "name": name, "source": source,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "task": p.task, **kind, "rank": tv.rank, "full_rank": full_rank or tv.rank,
        "lora_rank": lora_rank, "k": p.k_used, "n": p.n, "lam": p.lam, "episode": p.episode,
        "metrics": p.metrics, "model": tv.model.to_dict(),
        **({"prompt_format": p.prompt_format} if p.prompt_format else {}),
        # what the vector was fitted to (`core.teacher`): a gold blend is no imitation
        **({"teacher": dict(p.teacher)} if p.teacher else {}), **(extra or {})})


class TaskStore:
    """A task-store directory (created if missing)."""

    def __init__(self, root: str | Path, *, create: bool = True, pins: Path | None = None):
        self.root = Path(root).absolute()
        # where the engines load served keys (the pins of every API-server process of one
        # server: its store's, `endpoints` gives each process an entry directory of its own)
        self.pins = pins or self.root / PINS
        self.unreadable: dict[str, str] = {}  # entry directories that did not read (`readable`)
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"task store {self.root}: not a directory")
        if not create:  # read only, as a dry run plans: a missing store is an empty one
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"task store {self.root}: cannot create it ({e.strerror})") from None
        if not os.access(self.root, os.W_OK):
            raise StoreError(f"task store {self.root}: not writable")

    def hold(self) -> int:
        """Lock the store for this process and every process it becomes (`execve` keeps the
        descriptor, so vLLM's server holds it until it exits; the kernel drops it then, even
        after a kill -9). StoreHeld, in one line, if another server holds it: two servers on
        one store would remove each other's files (a DELETE on one, the start-up sweep of the
        other) while their engines load them."""
        import fcntl

        path = self.root / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise self._held() from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        os.set_inheritable(fd, True)
        return fd

    def _held(self) -> StoreHeld:
        """The one line that refuses a second server on this store (the holder's pid, which
        it wrote into the lock file, where it can be read)."""
        try:
            who = (self.root / LOCK).read_bytes()[:64].decode("ascii", "replace").strip()
        except OSError:
            who = ""
        return StoreHeld(f"task store {self.root} is served by another running server"
                         f"{f' (pid {who})' if who.isdigit() else ''}; stop it, or give "
                         "this server another --task-store")

    def check_free(self) -> None:
        """StoreHeld (`hold`'s line) if a running server holds the store: `serve` asks
        before it imports vLLM or reads the model, so the refusal comes at once; `hold` asks
        again, race-free, when the server starts."""
        if self.held():
            raise self._held()

    def held(self) -> bool:
        """Whether a running server holds the store (what `serve --dry-run` reports)."""
        import fcntl

        path = self.root / LOCK
        if not path.is_file():
            return False
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def pin(self, entry: Entry, key: str) -> Path:
        """The entry's vector as the engines load it for `key` (NAME@DIGEST): a hard link
        (a copy where the filesystem has none), made whole before it appears; kept as it is
        when there already (the same key is the same bytes). This process is recorded as
        one of its holders: the API-server processes of one server share the pins their
        engines load (`pins`), and a pin goes only when its last holder lets it go."""
        path = self.pinned(key)
        with self._pins_locked():
            if not path.is_file():
                tmp = self.pins / f".{key}.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                try:
                    os.link(entry.vector_path, tmp)
                except OSError:
                    shutil.copyfile(entry.vector_path, tmp)
                os.replace(tmp, path)
            holders = self.pins / f"{key}{HOLDERS}"
            holders.mkdir(exist_ok=True)
            (holders / str(os.getpid())).touch()
        return path

    def pinned(self, key: str) -> Path:
        """Where the engines load `key`'s vector (a key is NAME@DIGEST: checked, so no key
        names a path outside the store)."""
        name, sep, digest = key.partition("@")
        check_name(name)
        if not sep or not re.fullmatch(r"[0-9a-f]{16}", digest):
            raise StoreError(f"not a task store key: {key[:80]!r}")
        return self.pins / f"{key}.safetensors"

    def unpin(self, key: str) -> None:
        """This process lets `key`'s pin go; the pin is removed when no live process holds
        it (a holder that died is no holder: its requests died with it)."""
        path = self.pinned(key)
        holders = self.pins / f"{key}{HOLDERS}"
        with self._pins_locked():
            (holders / str(os.getpid())).unlink(missing_ok=True)
            if any(alive(p.name) for p in _listing(holders)):
                return
            path.unlink(missing_ok=True)
            shutil.rmtree(holders, ignore_errors=True)

    @contextlib.contextmanager
    def _pins_locked(self) -> Iterator[None]:
        """The pins, locked against the other processes pinning into them (flock)."""
        import fcntl

        self.pins.mkdir(exist_ok=True)
        fd = os.open(self.pins / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def sweep(self) -> list[str]:
        """Remove what interrupted writes and removals left, and every pin (no engine runs
        while a server starts on its store; it pins what it serves); the names removed."""
        shutil.rmtree(self.root / PINS, ignore_errors=True)
        gone = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith((".tmp-", ".del-", ".up-")):
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
        return gone

    def entries(self) -> list[Entry]:
        """Every entry; StoreError (one line) for one whose record does not read."""
        entries = self.readable()
        if self.unreadable:
            raise StoreError(next(iter(self.unreadable.values())))
        return entries

    def readable(self) -> list[Entry]:
        """The entries that read, those that do not skipped and kept in `unreadable` (name →
        why, one line, as of this call): what a running server lists, counts and reports, so
        one bad directory never stops its listings, metrics or changes."""
        out: list[Entry] = []
        unreadable: dict[str, str] = {}
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                if p.is_dir() and NAME.fullmatch(p.name) and (p / RECORD).is_file():
                    try:
                        out.append(self._read(p))
                    except StoreError as e:
                        # removed between the listing and the read (a concurrent DELETE
                        # renames it away): not an entry any more; else unreadable
                        if p.exists():
                            unreadable[p.name] = str(e)
        self.unreadable = unreadable
        return out

    def names(self) -> list[str]:
        return [e.name for e in self.entries()]

    def get(self, name: str) -> Entry:
        p = self.root / check_name(name)
        if not (p / RECORD).is_file():
            raise NoSuchEntry(f"no task {name!r} in {self.root}")
        return self._read(p)

    def _read(self, p: Path) -> Entry:
        try:
            record = json.loads((p / RECORD).read_text())
        except (OSError, ValueError) as e:
            raise StoreError(f"task store entry {p.name}: unreadable {RECORD} ({e})") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise StoreError(f"task store entry {p.name}: not a format-{FORMAT} entry")
        return Entry(p.name, p, record)

    def add(self, name: str, tv: TaskVector | LayerTask, model_dir: str | Path, *,
            source: str = "added", base_model: str | None = None, rank: int | None = None,
            extra: dict[str, Any] | None = None) -> Entry:
        """Write an entry for `tv` (checked against `model_dir`) and publish it by a rename:
        `stage` then `publish`."""
        return self.publish(self.stage(name, tv, model_dir, source=source,
                                       base_model=base_model, rank=rank, extra=extra), name)

    def stage(self, name: str, tv: TaskVector | LayerTask, model_dir: str | Path, *,
              source: str = "added", base_model: str | None = None, rank: int | None = None,
              extra: dict[str, Any] | None = None, into: str | Path | None = None) -> Path:
        """Write a complete, unpublished entry for `tv`; its directory (a `.tmp-` one in the
        store, or `into`, which must be on the store's filesystem and not exist yet).

        `rank`: cut the vector to this rank first (vLLM's largest served LoRA rank is fixed
        at start); the cut vector is what the entry stores and serves. `base_model`: the model
        path the serving engine was started with (vLLM's filesystem resolver compares it with
        the adapter's base model); default `model_dir`."""
        from ltv_vllm.models.checkpoint import identity_from_dir, read_lm_head
        from ltv_vllm.serving.store.lora import export_lora, refuse_non_lora

        check_name(name)
        tv.check_model(identity_from_dir(model_dir))
        if isinstance(tv, LayerTask):  # no adapter: served per request only
            with self._staging(name, into, "stored") as tmp:
                tv.save(tmp / VECTOR)
                record = record_of(name, tv, source=source, lora_rank=0, extra=extra)
                (tmp / RECORD).write_text(json.dumps(record, indent=1, allow_nan=False))
            return tmp
        refuse_non_lora(tv)
        with self._staging(name, into, "stored") as tmp:
            full_rank = tv.rank
            if rank is not None and tv.rank > rank:
                tv = tv.truncated(rank, lm_head=read_lm_head(model_dir))
            export_lora(tv, model_dir, tmp, base_model=base_model or str(Path(model_dir)))
            tv.save(tmp / VECTOR)
            lora_r = json.loads((tmp / "adapter_config.json").read_text())["r"]
            record = record_of(name, tv, source=source, lora_rank=lora_r, full_rank=full_rank,
                               extra=extra)
            (tmp / RECORD).write_text(json.dumps(record, indent=1, allow_nan=False))
        return tmp

    @contextlib.contextmanager
    def _staging(self, name: str, into: str | Path | None, what: str) -> Iterator[Path]:
        """A new entry's directory (a `.tmp-` one in the store, or `into`), removed again
        when its writing fails (a full disk as one StoreFull line)."""
        if into is None:
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self.root))
        else:
            tmp = Path(into)
            tmp.mkdir()
        try:
            yield tmp
            os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; as a plain mkdir would
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if (full := full_disk(e, f"task {name!r} was not {what}", self.root)) is not None:
                raise full from e
            raise

    def adopt(self, name: str, data: bytes, record: dict[str, Any], model_dir: str | Path, *,
              base_model: str | None = None, max_rank: int | None = None,
              adapter: bool = True, layers: bool = False) -> Path:
        """Stage an entry from a shared store's vector bytes, kept byte for byte (so its
        digest, and its engine key, are the shared store's), with its adapter made here for
        `model_dir` (`adapter`: a server that serves its tasks as LoRA adapters; one that
        shifts per request reads the vector only; `layers`: one whose engine has the layer
        hooks, `serve --layer-uploads`); StoreError (one line) when this server cannot serve
        it: another model, a nonlinear vector, a rank over `max_rank`, a layer task here."""
        from ltv_vllm.models.checkpoint import identity_from_dir
        from ltv_vllm.serving.store.lora import export_lora, refuse_non_lora

        check_name(name)
        fmt = record.get("format") if isinstance(record, dict) else None
        if type(fmt) is not int or fmt != FORMAT:  # an entry this release could not read
            raise StoreError(f"task {name!r}: its record is not a format-{FORMAT} entry")
        with self._staging(name, None, "copied") as tmp:
            (tmp / VECTOR).write_bytes(data)
            try:
                tv = load_any(tmp / VECTOR)
                tv.check_model(identity_from_dir(model_dir))
                if isinstance(tv, LayerTask):
                    if adapter or not layers:
                        raise StoreError(f"task {name!r} is a layer task: this replica "
                                         "serves none (start it with --layer-uploads and "
                                         "--multi-task shift)")
                else:
                    refuse_non_lora(tv)
            except StoreError:
                raise
            except UserError as e:
                raise StoreError(f"task {name!r}: {e}") from None
            if isinstance(tv, LayerTask):
                adapter = False
            elif max_rank is not None and tv.rank > max_rank:
                raise StoreError(f"task {name!r}: rank {tv.rank} is over this server's rank "
                                 f"{max_rank}; serve every replica at the same rank")
            if adapter:
                export_lora(tv, model_dir, tmp, base_model=base_model or str(Path(model_dir)))
            # what kind of task it is, read from its file (the gate serves it by the record)
            facts = {k: v for k, v in record_of(name, tv, source="", lora_rank=0).items()
                     if k in ("kind", "layers", "positions", "additive")}
            try:  # strict JSON, as `stage` writes it; the name is the one it is served as
                text = json.dumps({**record, "name": name, **facts}, indent=1,
                                  allow_nan=False)
            except (TypeError, ValueError) as e:
                raise StoreError(f"task {name!r}: its record is not strict JSON ({e})") \
                    from None
            (tmp / RECORD).write_text(text)
        return tmp

    def publish(self, staged: str | Path, name: str) -> Entry:
        """Make a staged entry visible as NAME by one rename; EntryExists (and the staged
        directory removed) when the name is taken."""
        check_name(name)
        try:
            # no replace: renaming onto an existing non-empty directory fails, so two
            # writers of one name cannot both win
            if (self.root / name).exists():
                raise FileExistsError(name)
            os.rename(staged, self.root / name)
        except OSError:
            shutil.rmtree(staged, ignore_errors=True)
            raise EntryExists(f"task {name!r} already exists in {self.root}") from None
        try:
            return self.get(name)
        except StoreError:
            self.discard(name)  # an entry that does not read is never left to be listed
            raise

    def discard(self, name: str) -> None:
        """Remove whatever directory holds NAME, entry or not (renamed away first)."""
        p = self.root / check_name(name)
        if not p.exists():
            return
        gone = Path(tempfile.mkdtemp(prefix=f".del-{name}-", dir=self.root))
        try:
            os.rename(p, gone / name)
        except FileNotFoundError:
            pass  # removed meanwhile
        shutil.rmtree(gone, ignore_errors=True)

    def remove(self, name: str) -> None:
        """Take the entry out of sight by a rename, then delete it."""
        p = self.root / check_name(name)
        if not (p / RECORD).is_file():
            raise NoSuchEntry(f"no task {name!r} in {self.root}")
        gone = Path(tempfile.mkdtemp(prefix=f".del-{name}-", dir=self.root))
        os.rename(p, gone / name)
        shutil.rmtree(gone, ignore_errors=True)

    def checked(self, model_dir: str | Path) -> tuple[dict[str, Entry], dict[str, str]]:
        """Every entry a server on `model_dir` can serve, and the others with why not (one
        line each): a record or vector that does not read, a vector for another model, a
        nonlinear one, a rank over vLLM's largest LoRA rank, adapter files missing or not
        matching the vector. Read only."""
        from ltv_vllm.models.checkpoint import identity_from_dir

        ident = identity_from_dir(model_dir)
        good: dict[str, Entry] = {}
        bad: dict[str, str] = {}
        if not self.root.is_dir():
            return good, bad
        for p in sorted(self.root.iterdir()):
            if not (p.is_dir() and NAME.fullmatch(p.name)):
                continue
            try:
                entry = self._read(p) if (p / RECORD).is_file() else None
                if entry is None:
                    raise StoreError(f"task store entry {p.name}: no {RECORD}")
                _servable(entry, ident)
            except UserError as err:
                bad[p.name] = str(err).replace(str(self.root) + os.sep, "")
                continue
            good[entry.name] = entry
        return good, bad

    def quarantine(self, name: str, reason: str) -> Path:
        """Move entry NAME out of the store, to ROOT/.quarantine/NAME-TIME with `reason.txt`
        (kept for the operator to inspect; a restart no longer sees it)."""
        p = self.root / check_name(name)
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
        (self.root / ".quarantine").mkdir(exist_ok=True)
        dest = Path(tempfile.mkdtemp(prefix=f"{name}-{stamp}-", dir=self.root / ".quarantine"))
        os.rename(p, dest / name)
        (dest / "reason.txt").write_text(reason + "\n")
        return dest


def _servable(entry: Entry, ident: Any) -> None:
    """StoreError (one line naming the entry) unless a server on `ident` can serve it."""
    from safetensors import safe_open

    from ltv_vllm.serving.store.lora import VLLM_LORA_RANKS, refuse_non_lora

    where = f"task store entry {entry.name}"
    try:
        tv = entry.vector()
        tv.check_model(ident)
        if isinstance(tv, LayerTask) != (entry.layer is not None):
            raise StoreError(f"{where}: its record and its file disagree on whether it is a "
                             "layer task")
        if isinstance(tv, LayerTask):
            return  # no adapter: served per request
        refuse_non_lora(tv)
    except UserError as err:
        raise StoreError(f"{where}: {err}") from None
    try:
        cfg = json.loads((entry.path / "adapter_config.json").read_text())
        r = int(cfg["r"])
        with safe_open(entry.path / "adapter_model.safetensors", "pt") as f:
            a = f.get_slice("base_model.model.lm_head.lora_A.weight").get_shape()
            b = f.get_slice("base_model.model.lm_head.lora_B.weight").get_shape()
    except Exception as err:  # noqa: BLE001 - missing file, bad JSON, bad safetensors, key
        raise StoreError(f"{where}: its LoRA adapter does not read ({type(err).__name__})"
                         ) from None
    if r > VLLM_LORA_RANKS[-1] or r < tv.rank:
        raise StoreError(f"{where}: adapter rank {r} cannot serve its rank-{tv.rank} vector "
                         f"(vLLM's largest LoRA rank is {VLLM_LORA_RANKS[-1]})")
    d_out = ident.vocab_size
    if list(a) != [r, ident.hidden_size] or list(b) != [d_out, r]:
        raise StoreError(f"{where}: adapter shapes {list(a)}, {list(b)} do not fit the model")


def _listing(d: Path) -> list[Path]:
    try:
        return list(d.iterdir())
    except FileNotFoundError:
        return []


def alive(pid: str) -> bool:
    """Whether the process `pid` (a holder's file name) runs (on this machine: the processes
    of one server share its pins)."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
