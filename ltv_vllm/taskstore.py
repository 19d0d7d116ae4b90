"""The task store: tasks compiled (or uploaded) for a server, one directory per task.

    ROOT/NAME/                    one entry: complete, or absent
        adapter_config.json       the task's lm_head LoRA in PEFT format (`vllm_ext.lora`),
        adapter_model.safetensors   so vLLM's runtime LoRA loading takes ROOT/NAME as it is
        ltv_vllm.json             the adapter's provenance (written by export_lora)
        vector.safetensors        the task-vector file itself
        entry.json                the task spec and how the entry was made (`Entry.record`)
    ROOT/.tmp-NAME-XXXX/          an entry being written; renamed to ROOT/NAME when complete
    ROOT/.del-NAME-XXXX/          an entry being removed; renamed away first, then deleted
    ROOT/.up-XXXX/                an upload being parsed (the server's /v1/ltv/tasks)

A directory rename is atomic, so a reader (the server, vLLM's filesystem LoRA resolver) sees
a whole entry or none: a crash mid-write leaves only a `.tmp-` directory, which `sweep()`
removes. Each adapter records the served model's path as its base model, which is what vLLM's
filesystem resolver compares against the engine's `--model`.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError
from .fileio import umask
from .vector import TaskVector, load_task_vector

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
FORMAT = 1
VECTOR, RECORD = "vector.safetensors", "entry.json"


class StoreError(UserError):
    """A task-store request that cannot be done (one line)."""


class EntryExists(StoreError):
    """The name is taken (HTTP 409)."""


class NoSuchEntry(StoreError):
    """No complete entry of that name (HTTP 404)."""


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

    def vector(self) -> TaskVector:
        return load_task_vector(self.vector_path)


def record_of(name: str, tv: TaskVector, *, source: str, lora_rank: int,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What `entry.json` says about a task: enough to list it without loading tensors."""
    p = tv.provenance
    return {"format": FORMAT, "name": name, "source": source,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "task": p.task, "kind": tv.kind, "rank": tv.rank, "lora_rank": lora_rank,
            "k": p.k_used, "n": p.n, "lam": p.lam, "episode": p.episode, "metrics": p.metrics,
            "model": tv.model.to_dict(), **(extra or {})}


class TaskStore:
    """A task-store directory (created if missing)."""

    def __init__(self, root: str | Path, *, create: bool = True):
        self.root = Path(root).absolute()
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

    def sweep(self) -> list[str]:
        """Remove what interrupted writes and removals left; the names removed."""
        gone = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith((".tmp-", ".del-", ".up-")):
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
        return gone

    def entries(self) -> list[Entry]:
        out = []
        if not self.root.is_dir():
            return out
        for p in sorted(self.root.iterdir()):
            if p.is_dir() and NAME.fullmatch(p.name) and (p / RECORD).is_file():
                out.append(self._read(p))
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

    def add(self, name: str, tv: TaskVector, model_dir: str | Path, *, source: str = "added",
            base_model: str | None = None, rank: int | None = None,
            extra: dict[str, Any] | None = None) -> Entry:
        """Write an entry for `tv` (checked against `model_dir`) and publish it by a rename.

        `base_model`: the model path the serving engine was started with (vLLM's filesystem
        resolver compares it with the adapter's base model); default `model_dir`."""
        from .checkpoint import identity_from_dir
        from .vllm_ext.lora import export_lora, refuse_non_lora

        check_name(name)
        tv.check_model(identity_from_dir(model_dir))
        refuse_non_lora(tv)
        if (self.root / name).exists():
            raise EntryExists(f"task {name!r} already exists in {self.root}")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self.root))
        try:
            export_lora(tv, model_dir, tmp, rank=rank,
                        base_model=base_model or str(Path(model_dir)))
            tv.save(tmp / VECTOR)
            lora_r = json.loads((tmp / "adapter_config.json").read_text())["r"]
            (tmp / RECORD).write_text(json.dumps(
                record_of(name, tv, source=source, lora_rank=lora_r, extra=extra), indent=1))
            os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; as a plain mkdir would
            try:
                # no replace: renaming onto an existing non-empty directory fails, so two
                # writers of one name cannot both win
                os.rename(tmp, self.root / name)
            except OSError:
                raise EntryExists(f"task {name!r} already exists in {self.root}") from None
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if (full := full_disk(e, f"task {name!r} was not stored", self.root)) is not None:
                raise full from e
            raise
        return self.get(name)

    def remove(self, name: str) -> None:
        """Take the entry out of sight by a rename, then delete it."""
        p = self.root / check_name(name)
        if not (p / RECORD).is_file():
            raise NoSuchEntry(f"no task {name!r} in {self.root}")
        gone = Path(tempfile.mkdtemp(prefix=f".del-{name}-", dir=self.root))
        os.rename(p, gone / name)
        shutil.rmtree(gone, ignore_errors=True)

    def checked(self, model_dir: str | Path) -> dict[str, Entry]:
        """Every entry, its vector checked against `model_dir` (one line naming the entry
        that does not fit)."""
        from .checkpoint import identity_from_dir

        ident = identity_from_dir(model_dir)
        out = {}
        for e in self.entries():
            try:
                e.vector().check_model(ident)
            except UserError as err:
                raise StoreError(f"task store entry {e.name}: {err}") from None
            out[e.name] = e
        return out
