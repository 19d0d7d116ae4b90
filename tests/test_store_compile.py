"""Compiles over HTTP on a running server (`serve --task-store`): the worker compiles while
traffic flows, killed and dying workers leave nothing, bad requests are 4xx. Helpers:
`test_store_server.py`.
"""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time

import openai
import pytest
import torch
from test_server import HTTP, PROMPTS, check_mixed, make_assets, oracle, start_server, stop
from test_store_server import compile_body, no_paths, wait_status

from ltv_vllm.serving.store.taskstore import TaskStore

pytestmark = pytest.mark.slow(seconds=41)  # see conftest's ordering


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    return make_assets(tmp_path_factory, tokenizer, tie=False)  # answers differ in tokens


# -- 3. compiles: the server alone publishes; bad requests are 4xx ----------------------------
HOOK = textwrap.dedent("""
    # test hook (tests/test_store_compile.py): a compile worker for a task named "die*" dies
    # right after writing its entry, before it can report success
    import os, sys
    if "ltv_vllm.serving.store.compile" in getattr(sys, "orig_argv", []):
        from ltv_vllm.serving.store import taskstore
        _stage = taskstore.TaskStore.stage
        def stage(self, name, *a, **kw):
            out = _stage(self, name, *a, **kw)
            if name.startswith("die"):
                os._exit(9)
            return out
        taskstore.TaskStore.stage = stage
""")


def test_compile_over_http_while_serving(assets, tokenizer, tmp_path):
    """POST demonstrations to a running server: two tasks compiled by the worker while a
    client keeps requesting a third; their answers equal transformers + the vector the store
    holds; the concurrent client saw no error and no wrong shift; a compiling task's name is
    a 404; bad requests are 4xx naming no server path; a worker that dies (mid-compile, or
    right after writing its entry) leaves no entry; a queued compile deleted leaves no
    files; the served base model's name cannot be taken."""
    d, model, vecs = assets
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    store = TaskStore(tmp_path / "store")
    # the model given relative to its parent: its directory name is the base model's name
    base = d.name
    proc, url, log = start_server(base, [f"beta={vecs['beta'][1]}"], tmp_path,
                                  ("--task-store", str(store.root), "--max-tasks", "4"),
                                  cwd=d.parent, env_extra={
                                      "PYTHONPATH": os.pathsep.join(
                                          [str(hook), os.environ.get("PYTHONPATH", "")])})
    tasks = f"{url}/v1/ltv/tasks"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    seen, errors, stop_flag = [], [], threading.Event()

    def traffic():
        # a steady client, not a flood: back to back it took a core from the compile workers
        # for the whole test, and hundreds of answers to check
        while not stop_flag.wait(0.1):
            try:
                r = client.completions.create(
                    model="beta", prompt=PROMPTS[len(seen) % 2], max_tokens=2, temperature=0.0,
                    logprobs=1, extra_body={"return_tokens_as_token_ids": True})
                seen.append((PROMPTS[len(seen) % 2], r.choices[0].logprobs))
            except Exception as e:  # noqa: BLE001 - every failure is a test failure
                errors.append(repr(e))

    t = threading.Thread(target=traffic)
    t.start()
    try:
        for name, flip in (("c1", False), ("c2", True)):
            r = HTTP.post(tasks, json=compile_body(name, flip), timeout=30)
            assert r.status_code == 202, r.text
            assert r.json()["status"] in ("queued", "compiling")
        with pytest.raises(openai.NotFoundError):  # not served until it is complete
            client.completions.create(model="c2", prompt=PROMPTS[0], max_tokens=1)
        raw = {"content-type": "application/json"}
        cases = [(HTTP.post(tasks, content=b"{oops", timeout=30, headers=raw), 400,
                  "malformed"),
                 (HTTP.post(tasks, content=b"[" * 100_000, timeout=30, headers=raw), 400,
                  "nested too deeply"),
                 (HTTP.post(tasks, json=compile_body("c1"), timeout=30), 409, "exists"),
                 (HTTP.post(tasks, json=compile_body(base)), 409, "base model's name"),
                 (HTTP.post(tasks, data={"name": base}, files={
                     "vector": ("v.pt", vecs["alpha"][1].read_bytes())}), 409,
                  "base model's name"),
                 (HTTP.post(tasks, json={**compile_body("c9"), "colour": 1}), 400, "unknown"),
                 (HTTP.post(tasks, json=compile_body("c9", queries=["word " * 300])), 400,
                  "served context is 256 tokens"),
                 # counted in tokens: 150 characters, 300 byte-level tokens, the longest
                 # input although not the longest in characters
                 (HTTP.post(tasks, json=compile_body(
                     "c9", queries=["word " * 40, "\u0436" * 150])), 400,
                  "served context is 256 tokens"),
                 (HTTP.post(tasks, content=json.dumps(compile_body("c9"))[:-1].encode()
                             + b', "lam": 1e400}', headers=raw), 400, "lam: a positive finite"),
                 (HTTP.post(tasks, content=json.dumps(compile_body("c9"))[:-1].encode()
                             + b', "lam": 1' + b"0" * 400 + b"}", headers=raw), 400,
                  "lam: a positive finite")]
        for r, code, words in cases:
            assert r.status_code == code and words in r.json()["error"]["message"], r.text
            no_paths(r, store.root, d)
        assert len(tokenizer("\u0436" * 150)["input_ids"]) >= 256  # the case above is real
        deadline = time.time() + 600
        while time.time() < deadline:
            states = {x["name"]: x["status"] for x in HTTP.get(tasks).json()["data"]}
            if states == {"c1": "ready", "c2": "ready"}:
                break
            assert "failed" not in states.values(), HTTP.get(tasks).json()
            time.sleep(0.2)
        assert store.names() == ["c1", "c2"]
        held = {n: store.get(n).vector() for n in ("c1", "c2")}
        assert store.get("c1").record["source"] == "compiled"
        assert not torch.equal(held["c1"].U, held["c2"].U)
        # compiled vectors record the first step as their policy; the server applies it
        assert held["c1"].provenance.shift_steps == "first"
        check_mixed(url, {**held, "beta": vecs["beta"][0]}, model, tokenizer, True)

        # a worker that dies right after writing its entry: no entry, one listing (failed),
        # the name still taken by the failed job until DELETE, then free
        assert HTTP.post(tasks, json=compile_body("die1")).status_code == 202
        got = wait_status(url, "die1", "failed", deadline)
        assert "worker died (exit 9)" in got["error"], got
        assert store.names() == ["c1", "c2"] and not (store.root / "die1").exists()
        listed = [x["name"] for x in HTTP.get(tasks).json()["data"]]
        assert sorted(listed) == ["c1", "c2", "die1"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="die1", prompt=PROMPTS[0], max_tokens=1)
        assert HTTP.post(tasks, json=compile_body("die1")).status_code == 409
        assert HTTP.delete(f"{tasks}/die1").status_code == 200
        assert HTTP.get(f"{tasks}/die1").status_code == 404
        assert HTTP.delete(f"{tasks}/die1").status_code == 404

        # a worker killed mid-compile, and a queued compile deleted: nothing left of either
        r = HTTP.post(tasks, json=compile_body("c3", queries=["so so film"] * 3000))
        assert r.status_code == 202, r.text
        job_status = {}
        while job_status.get("state") != "extracting":  # kill inside the extraction only
            assert job_status.get("state") not in ("writing", "done", "failed"), job_status
            assert time.time() < deadline
            time.sleep(0.02)
            found = list((store.root / ".jobs").glob("c3-*/status.json"))
            if found:
                job_status = json.loads(found[0].read_text())
        r = HTTP.post(tasks, json=compile_body("c4"))
        assert r.status_code == 202 and r.json()["status"] == "queued", r.text
        assert len(list((store.root / ".jobs").glob("c4-*"))) == 1
        assert HTTP.delete(f"{tasks}/c4").status_code == 200
        assert list((store.root / ".jobs").glob("c4-*")) == []
        os.kill(job_status["pid"], 9)
        got = wait_status(url, "c3", "failed", deadline)
        assert "worker died" in got["error"]
        assert HTTP.delete(f"{tasks}/c3").status_code == 200
        assert store.names() == ["c1", "c2"] and HTTP.get(f"{tasks}/c3").status_code == 404
        assert not any((store.root / ".jobs").iterdir())
    finally:
        stop_flag.set()
        t.join()
        stop(proc, log)
    assert not errors, errors[:3]
    assert len(seen) > 5
    n_prompt = {p: len(tokenizer(p)["input_ids"]) for p in PROMPTS}
    for prompt, lp in seen:  # every concurrent answer carried beta's shift, and only it
        toks = [int(x.split(":", 1)[1]) for x in lp.tokens]
        ref = oracle(model, tokenizer, prompt, toks, vecs["beta"][0])
        for step, tok in enumerate(toks):
            row = ref[n_prompt[prompt] - 1 + step]
            assert abs(lp.token_logprobs[step] - float(row[tok])) < 1e-4
