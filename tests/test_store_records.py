"""A replica's own copy of a shared store never wedges it: an entry directory that does not
read is skipped (and reported), an adoption that would not read is refused or removed, and
an error names no store path or URL. The server-level behaviour (a corrupted shared index,
followed by real replicas) is `test_replicas.test_replicas_skip_what_they_cannot_use`."""

from __future__ import annotations

import json
import math

import pytest

from conftest import write_model_and_vectors
from ltv_vllm.serving.store.taskstore import StoreError, TaskStore


@pytest.fixture()
def setup(tmp_path, tokenizer):
    """A model directory, and an entry's vector bytes and record as a replica's upload
    publishes them to a shared store (written by `stage`)."""
    from ltv_vllm.core.vector import load_task_vector

    good, _ = write_model_and_vectors(tmp_path, tokenizer)
    e = TaskStore(tmp_path / "src").add("alpha", load_task_vector(good), tmp_path / "m")
    return tmp_path, e.vector_path.read_bytes(), e.record


def test_an_entry_that_does_not_read_is_skipped_and_reported(setup):
    tmp, data, rec = setup
    store = TaskStore(tmp / "copy")
    staged = store.adopt("alpha", data, rec, tmp / "m")
    store.publish(staged, "alpha")
    for name, text in (("future", json.dumps({**rec, "format": 2})), ("broken", "{not json"),
                       ("listy", "[1, 2]")):
        (store.root / name).mkdir()
        (store.root / name / "entry.json").write_text(text)
    assert [e.name for e in store.readable()] == ["alpha"]
    assert set(store.unreadable) == {"future", "broken", "listy"}
    assert all("\n" not in why for why in store.unreadable.values())
    assert "not a format-1 entry" in store.unreadable["future"]
    with pytest.raises(StoreError):  # the strict listing (the CLI's) still says so
        store.entries()
    store.discard("future")
    store.discard("broken")
    store.discard("listy")
    store.discard("never-there")
    assert store.names() == ["alpha"] and store.unreadable == {}
    assert sorted(p.name for p in store.root.iterdir()) == ["alpha"]


def test_an_adoption_that_would_not_read_is_refused_and_leaves_nothing(setup):
    tmp, data, rec = setup
    store = TaskStore(tmp / "copy")
    for bad, words in (({**rec, "lam": math.nan}, "not strict JSON"),
                       ({**rec, "format": 2}, "not a format-1 entry"),
                       ({**rec, "format": True}, "not a format-1 entry"),
                       ({k: v for k, v in rec.items() if k != "format"}, "not a format-1")):
        with pytest.raises(StoreError, match=words) as e:
            store.adopt("alpha", data, bad, tmp / "m")
        assert "\n" not in str(e.value)
    assert list(store.root.iterdir()) == []
    # a record naming another task is served under the name it is adopted as
    entry = store.publish(store.adopt("other", data, rec, tmp / "m"), "other")
    assert entry.record["name"] == "other"


def test_a_published_entry_that_does_not_read_is_removed(setup):
    tmp, data, rec = setup
    store = TaskStore(tmp / "copy")
    staged = store.adopt("alpha", data, rec, tmp / "m")
    (staged / "entry.json").write_text('{"format": 2}')  # changed under the staging
    with pytest.raises(StoreError, match="not a format-1 entry"):
        store.publish(staged, "alpha")
    assert list(store.root.iterdir()) == []


@pytest.mark.parametrize("kind", ["dir", "file-url", "s3"])
def test_errors_name_no_store_path_or_url(tmp_path, monkeypatch, kind):
    """`_public`: the shared store's path and URL read as "<task store>" in an answer, as
    this server's copy and the model's directory already did."""
    from ltv_vllm.serving.api_server.endpoints import TaskEndpoints
    from ltv_vllm.serving.store.shared_store import SharedStore

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    spec = {"dir": str(tmp_path / "shared"), "file-url": f"file://{tmp_path / 'shared'}",
            "s3": "s3://bucket/some/prefix"}[kind]
    ep = TaskEndpoints()
    ep.store = TaskStore(tmp_path / "copy")
    ep.model_dir = tmp_path / "model"
    ep.shared = SharedStore(spec, create=kind != "s3")
    for where in (spec, str(ep.shared)):
        text = ep._public(f"task store {where}: could not read its index (OSError: {where}/x)")
        assert text == ("task store <task store>: could not read its index "
                        "(OSError: <task store>/x)"), text
