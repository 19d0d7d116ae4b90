"""The task store: whole entries or none, checked against the model, served by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_model_and_vectors
from ltv_vllm.checkpoint import read_lm_head
from ltv_vllm.errors import UserError
from ltv_vllm.taskstore import (
    EntryExists,
    NoSuchEntry,
    StoreError,
    StoreFull,
    TaskStore,
    check_name,
)
from ltv_vllm.vector import load_task_vector


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
        from ltv_vllm.taskstore import TaskStore
        from ltv_vllm.vector import load_task_vector
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
    assert set(store.checked(tmp / "m")) == {"alpha"}
    # the same store against another model directory
    other_dir = tmp / "o"
    (tmp / "o2").mkdir()
    write_model_and_vectors(tmp / "o2", tokenizer)  # seed-4 model again: same identity
    assert set(store.checked(tmp / "o2" / "m")) == {"alpha"}
    from conftest import make_llama

    make_llama(len(tokenizer), seed=6).save_pretrained(other_dir)
    with pytest.raises(StoreError, match="task store entry alpha: .*extracted from"):
        store.checked(other_dir)
    (store.root / "alpha" / "entry.json").write_text("{not json")
    with pytest.raises(StoreError, match="entry alpha: unreadable entry.json"):
        store.entries()
