"""The task store: whole entries or none, checked against the model, served by name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_model_and_vectors
from ltv_vllm.core.vector import load_task_vector
from ltv_vllm.errors import UserError
from ltv_vllm.models.checkpoint import read_lm_head
from ltv_vllm.serving.store.taskstore import (
    EntryExists,
    NoSuchEntry,
    StoreError,
    StoreFull,
    TaskStore,
    check_name,
)


@pytest.fixture()
def setup(tmp_path, tokenizer):
    good, other = write_model_and_vectors(tmp_path, tokenizer)
    return tmp_path, load_task_vector(good), load_task_vector(other)


def test_add_get_list_remove(setup):
    tmp, good, _ = setup
    store = TaskStore(tmp / "store")
    e = store.add("alpha", good, tmp / "m", source="uploaded")
    assert store.names() == ["alpha"] and store.get("alpha").record == e.record
    rec = e.record
    assert (rec["name"], rec["source"], rec["kind"], rec["rank"]) == ("alpha", "uploaded",
                                                                      "hidden", 2)
    assert rec["model"] == good.model.to_dict() and rec["task"] == {"name": "alpha"}
    # the vector round-trips, and the adapter is the LoRA of W_lm U Vᵀ (checked by hand)
    back = e.vector()
    assert torch.equal(back.U, good.U) and torch.equal(back.V, good.V)
    cfg = json.loads((e.path / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tmp / "m")  # what vLLM's resolver compares
    assert cfg["target_modules"] == ["lm_head"] and cfg["r"] == rec["lora_rank"] == 8
    t = load_file(e.path / "adapter_model.safetensors")
    a, b = t["base_model.model.lm_head.lora_A.weight"], t["base_model.model.lm_head.lora_B.weight"]
    delta = read_lm_head(tmp / "m").double() @ (good.U @ good.V.T).double()
    torch.testing.assert_close((b.double() @ a.double()) * cfg["lora_alpha"] / cfg["r"], delta,
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(EntryExists, match="already exists"):
        store.add("alpha", good, tmp / "m")
    store.remove("alpha")
    assert store.names() == [] and os.listdir(store.root) == []
    with pytest.raises(NoSuchEntry, match="no task 'alpha'"):
        store.get("alpha")
    with pytest.raises(NoSuchEntry):
        store.remove("alpha")


def test_bad_names_and_wrong_model_are_refused_before_writing(setup):
    tmp, good, other = setup
    store = TaskStore(tmp / "store")
    for bad in ("", "../x", ".hidden", "a/b", "x" * 65, "sp ace"):
        with pytest.raises(StoreError, match="task name"):
            store.add(bad, good, tmp / "m")
    assert check_name("sst2-v1.2_x") == "sst2-v1.2_x"
    with pytest.raises(UserError, match="extracted from other"):
        store.add("beta", other, tmp / "m")
    assert os.listdir(store.root) == []


def test_a_chat_fitted_entry_keeps_its_rendering(setup):
    """A chat-fitted vector is stored as it is: the entry lists its rendering, and the gate's
    template digest is read back from the vector itself."""
    from dataclasses import replace

    tmp, good, _ = setup
    store = TaskStore(tmp / "store")
    fmt = {"name": "chat", "demos": "turns", "template_sha256": "0" * 64}
    chat = replace(good, provenance=replace(good.provenance, prompt_format=fmt))
    entry = store.add("alpha", chat, tmp / "m")
    assert entry.record["prompt_format"] == fmt and entry.chat_template() == "0" * 64
    assert store.get("alpha").chat_template() == "0" * 64
    assert "prompt_format" not in store.add("beta", good, tmp / "m").record
    assert store.get("beta").chat_template() is None


def test_a_crash_mid_write_leaves_no_entry(setup, monkeypatch):
    """A failure after the adapter is written (here: saving the vector) leaves nothing; a
    process killed mid-write leaves only a .tmp- directory, invisible and swept."""
    tmp, good, _ = setup
    store = TaskStore(tmp / "store")

    def boom(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(good), "save", boom)
    with pytest.raises(StoreFull, match="'alpha' was not stored: the task store's disk is full "
                                         r"\(.*: No space left on device\)"):
        store.add("alpha", good, tmp / "m")
    assert os.listdir(store.root) == []
    monkeypatch.undo()
    # a writer killed between writing and publishing: its temp directory stays behind
    code = textwrap.dedent(f"""
        import os
        from ltv_vllm.serving.store.taskstore import TaskStore
        from ltv_vllm.core.vector import load_task_vector
        os.rename = lambda *a: os._exit(9)   # die just before the publishing rename
        TaskStore({str(tmp / 'store')!r}).add("alpha", load_task_vector({str(tmp / 'good.pt')!r}),
                                              {str(tmp / 'm')!r})
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    left = os.listdir(store.root)
    assert len(left) == 1 and left[0].startswith(".tmp-alpha-")
    assert store.names() == []
    with pytest.raises(NoSuchEntry):
        store.get("alpha")
    assert store.sweep() == left and os.listdir(store.root) == []
    assert store.add("alpha", good, tmp / "m").name == "alpha"


def test_checked_names_the_entry_that_does_not_fit(setup, tokenizer):
    tmp, good, _ = setup
    store = TaskStore(tmp / "store")
    store.add("alpha", good, tmp / "m")
    assert set(store.checked(tmp / "m")[0]) == {"alpha"}
    # the same store against another model directory
    other_dir = tmp / "o"
    (tmp / "o2").mkdir()
    write_model_and_vectors(tmp / "o2", tokenizer)  # seed-4 model again: same identity
    assert set(store.checked(tmp / "o2" / "m")[0]) == {"alpha"}
    from conftest import make_llama

    make_llama(len(tokenizer), seed=6).save_pretrained(other_dir)
    ok, bad = store.checked(other_dir)  # never raises: the server quarantines it
    assert ok == {} and list(bad) == ["alpha"]
    assert re.fullmatch(r"task store entry alpha: .*extracted from.*", bad["alpha"])
    (store.root / "alpha" / "entry.json").write_text("{not json")
    with pytest.raises(StoreError, match="entry alpha: unreadable entry.json"):
        store.entries()


def test_a_cut_entry_stores_what_it_serves(tmp_path, tokenizer):
    """An entry cut to the served rank stores the cut vector: its file, its adapter and its
    record agree (a restart serves exactly it), and the record keeps the full rank."""
    from conftest import make_llama
    from ltv_vllm.core.vector import TaskVector, model_identity

    model = make_llama(len(tokenizer), seed=4)
    model.save_pretrained(tmp_path / "m")
    g = torch.Generator().manual_seed(0)
    tv = TaskVector("hidden", torch.randn(64, 12, generator=g), torch.randn(64, 12, generator=g),
                    None, model_identity(model, "m"), (1, 2), {"task": {"name": "t"}})
    store = TaskStore(tmp_path / "store")
    e = store.add("t", tv, tmp_path / "m", rank=8)
    held = e.vector()
    assert held.rank == 8 and e.record["rank"] == 8 and e.record["full_rank"] == 12
    cut = tv.truncated(8, lm_head=read_lm_head(tmp_path / "m"))
    torch.testing.assert_close(held.U @ held.V.T, cut.U @ cut.V.T)
    t = load_file(e.path / "adapter_model.safetensors")
    a, b = t["base_model.model.lm_head.lora_A.weight"], t["base_model.model.lm_head.lora_B.weight"]
    torch.testing.assert_close(b.double() @ a.double(),
                               read_lm_head(tmp_path / "m").double() @ (held.U @ held.V.T).double(),
                               atol=1e-4, rtol=1e-4)
    assert set(store.checked(tmp_path / "m")[0]) == {"t"}


def test_unservable_entries_are_named_and_quarantined(setup):
    tmp, good, _ = setup
    store = TaskStore(tmp / "store")
    for n in ("a", "b", "c", "d"):
        store.add(n, good, tmp / "m")
    (store.root / "b" / "adapter_model.safetensors").write_bytes(b"junk")
    (store.root / "c" / "vector.safetensors").unlink()
    cfg = json.loads((store.root / "d" / "adapter_config.json").read_text())
    (store.root / "d" / "adapter_config.json").write_text(json.dumps({**cfg, "r": 1024}))
    ok, bad = store.checked(tmp / "m")
    assert list(ok) == ["a"] and sorted(bad) == ["b", "c", "d"]
    assert bad["b"] == "task store entry b: its LoRA adapter does not read (SafetensorError)"
    assert bad["c"].startswith("task store entry c: task-vector file not found")
    assert "adapter rank 1024" in bad["d"]
    assert str(store.root) not in "".join(bad.values())
    dest = store.quarantine("b", bad["b"])
    assert dest.parent == store.root / ".quarantine" and (dest / "b" / "entry.json").is_file()
    assert (dest / "reason.txt").read_text() == bad["b"] + "\n"
    assert store.names() == ["a", "c", "d"] and "b" not in store.checked(tmp / "m")[1]
    assert store.sweep() == []  # quarantine is kept


def test_publish_refuses_a_taken_name_and_drops_the_staged_entry(setup):
    tmp, good, _ = setup
    store = TaskStore(tmp / "store")
    staged = store.stage("a", good, tmp / "m")
    assert staged.name.startswith(".tmp-a-") and store.names() == []
    other = store.stage("a", good, tmp / "m")
    assert store.publish(staged, "a").name == "a"
    with pytest.raises(EntryExists):
        store.publish(other, "a")
    assert not other.exists() and store.names() == ["a"]


def test_records_are_strict_json():
    from ltv_vllm.core.vector import finite_or_none

    x = {"metrics": {"ltv": {"accuracy": float("nan"), "d_ntp": float("inf"), "k": 3}},
         "l": [1.5, float("-inf")]}
    assert json.dumps(finite_or_none(x), allow_nan=False) == json.dumps(
        {"metrics": {"ltv": {"accuracy": None, "d_ntp": None, "k": 3}}, "l": [1.5, None]})


def test_listing_skips_an_entry_removed_while_it_is_read(setup, monkeypatch):
    """A server lists the store while a DELETE renames an entry away: the entry vanishes
    between the directory listing and the read of its record (3 listings in 52,723 once
    failed with a 500). It is no entry any more: skipped; a record that is there but
    unreadable still fails loudly."""
    tmp, good, _ = setup
    store = TaskStore(tmp / "store")
    store.add("alpha", good, tmp / "m")
    store.add("beta", good, tmp / "m")
    read = TaskStore._read

    def read_after_delete(self, p):
        if p.name == "alpha" and p.exists():
            self.remove("alpha")  # a concurrent DELETE wins the race
        return read(self, p)

    monkeypatch.setattr(TaskStore, "_read", read_after_delete)
    assert store.names() == ["beta"]
    monkeypatch.setattr(TaskStore, "_read", read)
    (store.root / "beta" / "entry.json").write_text("{not json")
    with pytest.raises(StoreError, match="unreadable entry.json"):
        store.names()


def test_engine_store_vectors_check_the_digest_and_drop_the_least_recent(setup):
    """The engine's store-vector cache (`vllm_ext.steps.StoreVectors`): a key NAME@DIGEST
    loads its pin (`TaskStore.pin`, made when the server serves the entry) only while the
    pin is the file the digest names (a pin changed under its key fails loudly, never serves
    another vector under the old key); a pin outlives its entry (a DELETE removes the entry
    at once, the requests admitted before still load the vector); a loaded key keeps its
    vector; past `keep` keys the least recently used one is dropped, and is read (and
    checked) again when next asked for."""
    import shutil

    from ltv_vllm.serving.contract.wire import task_key
    from ltv_vllm.serving.engine.steps import StoreVectors
    from ltv_vllm.serving.store.taskstore import vector_digest

    tmp, good, _ = setup
    store = TaskStore(tmp / "store")
    vecs = {n: replace_uv(good, s) for n, s in (("a", 1), ("b", 2), ("c", 3), ("b2", 4))}
    keys = {}
    for n in "abc":
        e = store.add(n, vecs[n], tmp / "m")
        keys[n] = task_key(n, vector_digest(e.vector_path))
        assert store.pin(e, keys[n]).stat().st_ino == e.vector_path.stat().st_ino  # a link
    cache = StoreVectors(str(store.root), keep=2)
    for n in "ab":
        assert torch.equal(cache.get(keys[n]).U, vecs[n].U)
    assert torch.equal(cache.get(keys["a"]).U, vecs["a"].U)  # a is now the most recent
    assert torch.equal(cache.get(keys["c"]).U, vecs["c"].U)  # b, the least recent, goes
    # b's name deleted and added again with another vector: the old key still loads the
    # old vector (its pin), the new entry is another key
    store.remove("b")
    e = store.add("b", vecs["b2"], tmp / "m")
    new_b = task_key("b", vector_digest(e.vector_path))
    store.pin(e, new_b)
    assert new_b != keys["b"]
    assert torch.equal(cache.get(keys["b"]).U, vecs["b"].U)  # re-read from its pin
    # a pin changed under its key is refused (it was dropped, so it is re-read)
    assert torch.equal(cache.get(keys["a"]).U, vecs["a"].U)  # b2 read next: c goes
    assert torch.equal(cache.get(new_b).U, vecs["b2"].U)
    pinned_c = store.pinned(keys["c"])
    pinned_c.unlink()
    shutil.copyfile(e.vector_path, pinned_c)
    with pytest.raises(RuntimeError, match="changed under key"):
        cache.get(keys["c"])
    # a kept key is served from memory, files or not; an unpinned, dropped one is gone
    store.remove("a")
    store.unpin(keys["a"])
    assert torch.equal(cache.get(keys["a"]).U, vecs["a"].U)
    store.unpin(keys["b"])
    with pytest.raises(FileNotFoundError):  # dropped: read again, and its pin is gone
        cache.get(keys["b"])
    for bad in ("a", "../a@" + keys["c"].partition("@")[2], "a@../../x"):
        with pytest.raises((RuntimeError, UserError)):
            cache.get(bad)
    # a restart's sweep removes every pin (the server pins what it serves again)
    store.sweep()
    assert not (store.root / ".pins").exists()



def test_pins_shared_by_processes_go_with_their_last_holder(setup):
    """Several API-server processes of one server pin into one place (`TaskStore(pins=)`):
    a pin stays while another live process holds it, and goes with the last holder's unpin
    (a holder that died is no holder). The other process is a real one."""
    import signal

    from ltv_vllm.serving.contract.wire import task_key
    from ltv_vllm.serving.store.taskstore import PINS, vector_digest

    tmp, good, _ = setup
    root = tmp / "copy"
    mine = TaskStore(root / ".api-a", pins=root / PINS)
    e = mine.add("a", good, tmp / "m")
    key = task_key("a", vector_digest(e.vector_path))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from ltv_vllm.serving.store.taskstore import PINS, TaskStore
        other = TaskStore({str(root / ".api-b")!r}, pins=Path({str(root)!r}) / PINS)
        mine = TaskStore({str(root / ".api-a")!r}, create=False)
        other.pin(mine.get("a"), {key!r})
        print("pinned", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "pinned"
        path = mine.pin(e, key)
        assert path == root / PINS / f"{key}.safetensors" == mine.pinned(key)
        assert sorted(p.name for p in (root / PINS / f"{key}.held").iterdir()) == sorted(
            [str(os.getpid()), str(child.pid)])
        mine.unpin(key)
        assert path.is_file()  # the other process still holds it
        child.send_signal(signal.SIGKILL)
        child.wait()
        mine.unpin(key)  # its holder died: the pin goes
        assert not path.exists() and not (root / PINS / f"{key}.held").exists()
    finally:
        child.kill()
        child.wait()

def replace_uv(tv, seed: int):
    """`tv` with other random factors (same model, same shapes)."""
    from ltv_vllm.core.vector import TaskVector

    g = torch.Generator().manual_seed(seed)
    return TaskVector(tv.kind, torch.randn(tv.U.shape, generator=g),
                      torch.randn(tv.V.shape, generator=g), tv.bias, tv.model,
                      tv.label_token_ids, tv.meta)


def test_a_layer_task_is_an_entry_without_an_adapter(setup):
    """A layer task (`core.layer_task`) in the store: its file and record only (no LoRA
    adapter carries a shift inside the decoder); the record says its kind, blocks, default
    positions and additivity, read back as `Entry.layer` (what the gate serves it by);
    servable on its model, refused for another, named where its record and file disagree. A
    shared store's copy: its kind read from its file whatever the record says, refused by a
    replica without layer hooks or in LoRA mode; a LoRA server's start on such a store is
    one line."""
    from ltv_vllm.core.layer_task import LayerPolicy, LayerTask
    from ltv_vllm.core.vector import VectorError
    from ltv_vllm.serving.launcher.store_setup import store_entries

    tmp, good, other = setup
    lt = LayerTask((0,), torch.ones(1, good.model.hidden_size), None, None, good.model,
                   LayerPolicy.parse("last"))
    store = TaskStore(tmp / "store")
    e = store.add("ctl", lt, tmp / "m", source="uploaded")
    assert sorted(os.listdir(e.path)) == ["entry.json", "vector.safetensors"]
    rec = e.record
    assert (rec["kind"], rec["layers"], rec["positions"], rec["additive"]) == \
        ("layer", [0], "last", True)
    assert e.layer == ("last", True) and store.get("ctl").layer == ("last", True)
    back = e.vector()
    assert isinstance(back, LayerTask) and torch.equal(back.bias, lt.bias)
    assert store.checked(tmp / "m") == ({"ctl": store.get("ctl")}, {})
    assert store_entries(str(store.root), tmp / "m", {})[2] is True
    with pytest.raises(VectorError, match="'ctl' is a layer task, which no LoRA adapter"):
        store_entries(str(store.root), tmp / "m", {}, lora=True)
    alien = LayerTask((0,), torch.ones(1, other.model.hidden_size), None, None, other.model)
    with pytest.raises(UserError):
        store.add("alien", alien, tmp / "m")
    assert store.names() == ["ctl"]
    # the record says a vector, the file is a layer task: named, not served
    (e.path / "entry.json").write_text(json.dumps({**rec, "kind": "hidden"}))
    assert "disagree on whether it is a layer task" in store.checked(tmp / "m")[1]["ctl"]
    data = e.vector_path.read_bytes()
    staged = store.adopt("copy", data, {**rec, "kind": "hidden"}, tmp / "m", adapter=False,
                         layers=True)
    assert json.loads((staged / "entry.json").read_text())["kind"] == "layer"
    assert sorted(os.listdir(staged)) == ["entry.json", "vector.safetensors"]
    for adapter, layers in ((False, False), (True, True)):
        with pytest.raises(StoreError, match="is a layer task: this replica serves none"):
            store.adopt("copy2", data, rec, tmp / "m", adapter=adapter, layers=layers)
    assert not [p for p in os.listdir(store.root) if p.startswith(".tmp-copy2")]
