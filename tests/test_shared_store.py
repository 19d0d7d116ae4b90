"""The shared task store (`serving.shared_store`) on both of its storages: a directory and a
real S3-API server process (moto's standalone server, started here). What many replicas rely
on: a name's writers race and exactly one wins, an index generation is never torn, objects
are checked against their names, and a store that does not answer is one line, quickly."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ltv_vllm.serving.store.shared_store import (
    KEEP,
    SharedStore,
    StoreUnavailable,
    is_shared,
)
from ltv_vllm.serving.store.taskstore import EntryExists, NoSuchEntry, StoreError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3-API server in a process of its own (stop / start it like a real one)."""

    def __init__(self, tmp: Path) -> None:
        self.port = _free_port()
        self.tmp = tmp
        self.proc: subprocess.Popen | None = None
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
                    "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                    "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> None:
        import httpx

        log = open(self.tmp / f"moto-{self.port}.log", "ab")  # noqa: SIM115 - the process's
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                httpx.get(self.env["AWS_ENDPOINT_URL"], timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("moto's server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def bucket(self, name: str) -> str:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"],
                          aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
        s3.create_bucket(Bucket=name)
        return f"s3://{name}/tasks"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("moto"))
    server.start()
    old = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(params=["dir", "s3"])
def store_url(request, tmp_path):
    if request.param == "dir":
        return f"file://{tmp_path / 'shared'}"
    server = request.getfixturevalue("s3")
    return server.bucket(f"b{tmp_path.name.lower().replace('_', '-')[-40:]}")


def test_names_race_and_one_wins(store_url):
    """16 writers of distinct names all land (one generation each, contiguous); 8 writers of
    one name: exactly one wins, the rest get EntryExists, and the index holds the winner's."""
    store = SharedStore(store_url)
    assert store.index().generation == 0 and store.index().tasks == {}
    errors: list[BaseException] = []

    def add(name: str, digest: str) -> None:
        try:
            SharedStore(store_url, create=False).add(name, digest, {"n": name}, "t")
        except BaseException as e:  # noqa: BLE001 - collected
            errors.append(e)

    threads = [threading.Thread(target=add, args=(f"t{i}", f"{i:064x}")) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    idx = store.index()
    assert idx.generation == 16
    assert {n: v["digest"] for n, v in idx.tasks.items()} == {
        f"t{i}": f"{i:064x}" for i in range(16)}
    threads = [threading.Thread(target=add, args=("same", f"{100 + i:064x}"))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 7 and all(isinstance(e, EntryExists) for e in errors), errors
    won = store.index().tasks["same"]["digest"]
    assert won in {f"{100 + i:064x}" for i in range(8)}
    assert store.index().generation == 17
    # a rollback removes only its own vector
    with pytest.raises(NoSuchEntry):
        store.remove("same", "t", digest="f" * 64)
    store.remove("same", "t", digest=won)
    assert "same" not in store.index().tasks
    with pytest.raises(NoSuchEntry):
        store.remove("same", "t")


def test_objects_are_content_addressed_and_checked(store_url):
    store = SharedStore(store_url)
    data = os.urandom(1000)
    digest = store.put_vector(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.put_vector(data) == digest  # the same bytes: kept as they are
    assert store.vector(digest) == data
    with pytest.raises(StoreError, match="missing"):
        store.vector("0" * 64)
    # bytes changed in storage (a truncated copy, a bit flip): refused, never served
    backend = store.backend
    key = f"objects/{'1' * 64}.safetensors"
    backend.create(key, data)
    with pytest.raises(StoreError, match="does not match its digest"):
        store.vector("1" * 64)


def test_old_generations_are_collected_and_the_newest_read(tmp_path):
    store = SharedStore(tmp_path / "s")
    for i in range(KEEP + 10):
        store.add(f"n{i}", f"{i:064x}", {}, "t")
    gens = store._generations()
    assert gens[-1] == KEEP + 10 and len(gens) <= KEEP + 1, gens
    assert len(store.index().tasks) == KEEP + 10
    doc = json.loads((tmp_path / "s" / "index" / f"{KEEP + 10:012d}.json").read_text())
    assert doc["generation"] == KEEP + 10 and doc["writer"] == "t"


def test_a_directory_store_is_marked_and_others_refused(tmp_path):
    assert not is_shared(tmp_path / "s")
    SharedStore(f"file://{tmp_path / 's'}")
    assert is_shared(tmp_path / "s") and is_shared("s3://b/p")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "trec").mkdir()  # a store of one server's own, or anything else
    with pytest.raises(StoreError, match="not a shared store"):
        SharedStore(tmp_path / "local")


def test_a_store_that_does_not_answer_is_one_line_and_quick(s3):
    url = s3.bucket("downtest")
    store = SharedStore(url)
    store.add("a", "a" * 64, {}, "t")
    s3.stop()
    try:
        t0 = time.time()
        with pytest.raises(StoreUnavailable) as e:
            store.index()
        assert time.time() - t0 < 30
        assert "\n" not in str(e.value) and url in str(e.value)
        with pytest.raises(StoreUnavailable):
            store.add("b", "b" * 64, {}, "t")
    finally:
        s3.start()
    # moto keeps its data in memory: a restarted server is an empty one, as a new bucket
    with pytest.raises(StoreUnavailable):
        SharedStore(url).index()


def test_several_api_server_processes_need_a_shared_store_served_by_key(tmp_path,
                                                                          monkeypatch):
    """A user's `vllm serve --api-server-count 2`: each API-server process follows a shared
    store; on a store DIR of one server's, or with adapters loaded at run time (vLLM loads
    them in one process only), the endpoint plugin stops the start in one line; a shared
    store served by key goes on to the store's own set-up."""
    import argparse
    import asyncio

    from ltv_vllm.serving.api_server.endpoints import TaskEndpoints
    from ltv_vllm.serving.contract.settings import ServerSettings

    args = argparse.Namespace(api_server_count=2, model=str(tmp_path / "m"))
    copy = str(tmp_path / "copy")
    for settings, words in [(ServerSettings(task_store=copy, task_metrics=False),
                             "give --task-store file://DIR"),
                            (ServerSettings(task_store=copy, shared_store=str(tmp_path / "s"),
                                            store_lora=True, task_metrics=False),
                             "one API-server process only")]:
        monkeypatch.setenv("LTV_VLLM_SERVER", settings.to_env()["LTV_VLLM_SERVER"])
        with pytest.raises(RuntimeError, match=words) as e:
            asyncio.run(TaskEndpoints().init_state(object(), object(), args))
        assert "\n" not in str(e.value)
    monkeypatch.setenv("LTV_VLLM_SERVER", ServerSettings(
        task_store=copy, shared_store=str(tmp_path / "s"),
        task_metrics=False).to_env()["LTV_VLLM_SERVER"])
    with pytest.raises(AttributeError, match="openai_serving_models"):
        asyncio.run(TaskEndpoints().init_state(object(), object(), args))


def test_a_store_being_made_reads_as_empty(tmp_path):
    """Replicas start together on a new store: one has written the marker, not yet the first
    index generation; another replica's plan reads it as empty, not as an error."""
    from ltv_vllm.serving.store.shared_store import MARKER

    (tmp_path / "s").mkdir()
    (tmp_path / "s" / MARKER).write_text('{"format": 1}')
    assert SharedStore(tmp_path / "s", create=False).size() == 0
    store = SharedStore(tmp_path / "s")  # the first replica finishes making it
    store.add("a", "a" * 64, {}, "t")
    assert SharedStore(tmp_path / "s", create=False).size() == 1


# -- the index is untrusted input: each entry checked --------------------------------------
GOOD_RECORD = {"format": 1, "name": "alpha", "source": "uploaded", "rank": 2, "full_rank": 2,
               "lora_rank": 8, "lam": 0.5, "metrics": {"ltv": {"accuracy": 0.9}},
               "task": {"name": "alpha"}, "l": [1.5, None]}


@pytest.mark.parametrize("name, item, reason", [
    ("../evil", {"digest": "a" * 64, "record": GOOD_RECORD}, "name"),
    ("a b", {"digest": "a" * 64, "record": GOOD_RECORD}, "name"),
    ("x" * 65, {"digest": "a" * 64, "record": GOOD_RECORD}, "name"),
    ("", {"digest": "a" * 64, "record": GOOD_RECORD}, "name"),
    ("evil", "not-a-dict", "entry"),
    ("evil", None, "entry"),
    ("evil", ["a" * 64, GOOD_RECORD], "entry"),
    ("evil", {"digest": "a" * 64}, "entry"),
    ("evil", {"digest": "a" * 64, "record": GOOD_RECORD, "size": 3}, "entry"),
    ("evil", {"digest": "A" * 64, "record": GOOD_RECORD}, "digest"),
    ("evil", {"digest": "a" * 63, "record": GOOD_RECORD}, "digest"),
    ("evil", {"digest": "../../etc/passwd", "record": GOOD_RECORD}, "digest"),
    ("evil", {"digest": 7, "record": GOOD_RECORD}, "digest"),
    ("evil", {"digest": "a" * 64, "record": "not-a-dict"}, "record"),
    ("evil", {"digest": "a" * 64, "record": [GOOD_RECORD]}, "record"),
    ("evil", {"digest": "a" * 64, "record": {**GOOD_RECORD, "lam": float("nan")}}, "record"),
    ("evil", {"digest": "a" * 64, "record": {**GOOD_RECORD, "metrics": {
        "ltv": {"accuracy": float("inf")}}}}, "record"),
    ("evil", {"digest": "a" * 64, "record": {**GOOD_RECORD, "l": [[-float("inf")]]}},
     "record"),
    ("evil", {"digest": "a" * 64, "record": {**GOOD_RECORD, "rank": "2"}}, "record"),
    ("evil", {"digest": "a" * 64, "record": {**GOOD_RECORD, "rank": True}}, "record"),
    ("evil", {"digest": "a" * 64, "record": {**GOOD_RECORD, "lora_rank": -1}}, "record"),
    ("evil", {"digest": "a" * 64, "record": {**GOOD_RECORD, "format": 2}}, "format"),
    ("evil", {"digest": "a" * 64, "record": {**GOOD_RECORD, "format": True}}, "format"),
    ("evil", {"digest": "a" * 64, "record": {**GOOD_RECORD, "format": 1.0}}, "format"),
    ("evil", {"digest": "a" * 64, "record": {k: v for k, v in GOOD_RECORD.items()
                                             if k != "format"}}, "format"),
])
def test_an_index_entry_is_checked(name, item, reason):
    """Every kind of entry a replica cannot use is named with its reason (one of the
    metric's fixed labels) and one line; a good one passes."""
    from ltv_vllm.serving.store.shared_store import SKIPS, entry_problem

    assert entry_problem("alpha", {"digest": "a" * 64, "record": GOOD_RECORD}) is None
    got = entry_problem(name, item)
    assert got is not None and got[0] == reason and reason in SKIPS, got
    assert "\n" not in got[1]


def test_an_index_is_served_in_its_order_up_to_a_bound(tmp_path):
    """`Index.servable`: the broken entries skipped with why, the good ones served oldest
    first (the index's order, as `add` appends) up to the bound, the rest skipped as past
    it; what the index holds is kept as it is (a writer keeps a newer release's records)."""
    from ltv_vllm.serving.store.shared_store import Index

    good = {"digest": "b" * 64, "record": GOOD_RECORD}
    raw = {"zeta": good, "evil": "not-a-dict", "nan": {"digest": "c" * 64, "record": {
        **GOOD_RECORD, "lam": float("nan")}}, "alpha": good, "bad name": good, "mid": good,
        "new": {"digest": "d" * 64, "record": {**GOOD_RECORD, "format": 2}}}
    idx = Index(3, raw)
    tasks, skipped = idx.servable(2)
    assert list(tasks) == ["zeta", "alpha"]
    assert {n: r for n, (r, _) in skipped.items()} == {
        "evil": "entry", "nan": "record", "bad name": "name", "mid": "max_tasks",
        "new": "format"}
    assert list(idx.servable()[0]) == ["zeta", "alpha", "mid"]
    assert idx.digest("evil") is None and idx.digest("zeta") == "b" * 64
    # the store keeps what it cannot read, and a change goes on around it
    store = SharedStore(tmp_path / "s")
    store.update(lambda t: t.update(raw), "test")
    store.add("late", "e" * 64, GOOD_RECORD, "t")
    assert list(store.index().tasks)[:-1] == list(raw)
    assert store.index().servable(3)[0].keys() == {"zeta", "alpha", "mid"}
    with pytest.raises(NoSuchEntry):  # a rollback of a broken entry's name: not its vector
        store.remove("evil", "t", digest="a" * 64)
    store.remove("evil", "t")
    assert "evil" not in store.index().tasks


@pytest.mark.parametrize("text", [b"not json", b"[1, 2]", b'"a string"', b"7",
                                  b'{"generation": 5}', b'{"generation": 5, "tasks": []}',
                                  b"[" * 100_000])
def test_an_unreadable_generation_is_one_store_error(tmp_path, text):
    """A whole index generation that is not an index (not JSON, not an object, nested past
    the parser): one StoreError line naming it, never another exception."""
    store = SharedStore(tmp_path / "s")
    store.add("a", "a" * 64, GOOD_RECORD, "t")
    (tmp_path / "s" / "index" / f"{5:012d}.json").write_bytes(text)
    with pytest.raises(StoreError, match="index generation 5 is unreadable") as e:
        store.index()
    assert "\n" not in str(e.value)
