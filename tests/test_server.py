"""The real OpenAI server on 127.0.0.1 with a tiny model and three task vectors (two
hidden-space, one logit-space).

Concurrent mixed requests (three tasks and the bare model in flight together) through the
`openai` client; every returned logprob is checked against transformers + the reference
hook within 1e-4 (float32), in fused mode and in multi-task (LoRA) mode. Bad requests get
OpenAI-style errors and the server stays up.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from conftest import make_vllm_llama, reference_logprobs, write_model_and_vectors
from ltv_vllm.client import classify
from ltv_vllm.tasks import BUILTIN_TASKS, label_token_ids
from ltv_vllm.vector import TaskVector, model_identity

PROMPTS = ["Review: the plot is dull\nSentiment:", "News: leaders meet for peace talks\nType:"]
SST2 = BUILTIN_TASKS["sst2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("srv-model")
    model = make_vllm_llama(tokenizer, seed=31)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    vd = tmp_path_factory.mktemp("srv-vectors")
    ident = model_identity(model, str(d))
    vecs = {}
    # gamma is logit-space: its LoRA's lora_B is U itself (vocab-sized), not W_lm U
    for name, kind, seed in (("alpha", "hidden", 1), ("beta", "hidden", 2), ("gamma", "logit", 3)):
        g = torch.Generator().manual_seed(seed)
        U = (0.5 * torch.randn(128, 8, generator=g) if kind == "hidden"
             else 2.0 * torch.randn(len(tokenizer), 8, generator=g))
        tv = TaskVector(kind, U, torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None, ident,
                        tuple(label_token_ids(SST2, tokenizer)),
                        {"task": {**SST2.to_dict(), "name": name}})
        vecs[name] = (tv, tv.save(vd / f"{name}.pt"))
    return d, model, vecs


def start_server(model_dir: Path, vector_args: list[str], tmp: Path, extra: tuple[str, ...] = ()):
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "LTV_VLLM_CACHE": str(tmp / "cache"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "ltv_vllm.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
           *[a for v in vector_args for a in ("--task-vector", v)], *extra, "--enforce-eager"]
    log = open(tmp / f"server-{port}.log", "wb")  # noqa: SIM115 - closed in stop()
    # the log is copied through a pipe, so the server never writes a file of its own
    # (file_size_limit below limits only the task store's writes)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    proc.copier = threading.Thread(target=_copy, args=(proc.stdout, log), daemon=True)
    proc.copier.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 400
    while time.time() < deadline:
        if proc.poll() is not None:
            proc.copier.join(10)
            raise RuntimeError((tmp / f"server-{port}.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    proc.copier.join(10)
    raise RuntimeError("server did not start: " + (tmp / f"server-{port}.log").read_text()[-3000:])


def _copy(src, dst) -> None:
    for chunk in iter(lambda: src.read1(1 << 16), b""):
        dst.write(chunk)
        dst.flush()


def stop(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.copier.join(10)
    log.close()


@contextlib.contextmanager
def file_size_limit(pid: int, nbytes: int):
    """A full disk, simulated: process `pid` (and the workers it starts meanwhile) cannot
    write a file past `nbytes` (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails
    with EFBIG)."""
    old = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, old)


def check_mixed(url: str, served: dict, model, tokenizer) -> None:
    """served: OpenAI model name → TaskVector or None (no shift expected)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    jobs = [(name, p) for _ in range(3) for name in served for p in PROMPTS]

    def call(job):
        name, prompt = job
        r = client.completions.create(model=name, prompt=prompt, max_tokens=3, temperature=0.0,
                                      logprobs=5, extra_body={"return_tokens_as_token_ids": True})
        return name, prompt, r.choices[0].logprobs

    with ThreadPoolExecutor(len(jobs)) as pool:  # all in flight together
        results = list(pool.map(call, jobs))
    n_prompt = {p: len(tokenizer(p)["input_ids"]) for p in PROMPTS}
    for name, prompt, lp in results:
        toks = [int(t.split(":", 1)[1]) for t in lp.tokens]
        ref = reference_logprobs(model, tokenizer, prompt, toks, served[name])
        for step, top in enumerate(lp.top_logprobs):
            row = ref[n_prompt[prompt] - 1 + step]
            assert int(row.argmax()) == toks[step], (name, step)
            for key, v in top.items():
                assert abs(v - float(row[int(key.split(":", 1)[1])])) < 1e-4, (name, step, key)


def test_multi_task_server(assets, tokenizer, tmp_path):
    d, model, vecs = assets
    proc, url, log = start_server(d, [f"{n}={p}" for n, (_, p) in vecs.items()], tmp_path)
    try:
        served = {name: tv for name, (tv, _) in vecs.items()} | {str(d): None}
        check_mixed(url, served, model, tokenizer)
        # the logit vector really moves the logits
        moved = (reference_logprobs(model, tokenizer, PROMPTS[0], [], vecs["gamma"][0])
                 - reference_logprobs(model, tokenizer, PROMPTS[0], [], None))
        assert moved.abs().max() > 1e-2
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="omega", prompt=PROMPTS[0], max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            client.completions.create(model="alpha", prompt=PROMPTS[0], max_tokens=1,
                                      extra_body={"prompt_logprobs": 1})
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="alpha", prompt="word " * 400, max_tokens=1)
        # still up and still right after the bad requests
        check_mixed(url, {"beta": vecs["beta"][0]}, model, tokenizer)
        # label-restricted classification through the server = transformers' restricted softmax
        res = classify(url, SST2, ["the plot is dull"], model="alpha")
        ids = label_token_ids(SST2, tokenizer)
        ref = reference_logprobs(model, tokenizer, SST2.query("the plot is dull"), [],
                                 vecs["alpha"][0])[-1, ids]
        ref = torch.softmax(ref, -1)
        for lab, p in zip(SST2.labels, ref.tolist(), strict=True):
            assert abs(res[0].probs[lab] - p) < 1e-4
    finally:
        stop(proc, log)


def test_fused_server(assets, tokenizer, tmp_path):
    d, model, vecs = assets
    tv, path = vecs["alpha"]
    proc, url, log = start_server(d, [str(path)], tmp_path)
    try:
        # fused: every request is shifted, whichever served name it uses
        check_mixed(url, {"alpha": tv, str(d): tv}, model, tokenizer)
    finally:
        stop(proc, log)


def test_regression_vector_server(tokenizer, tmp_path):
    """A regression LTV (`extract --task relu`) served by name beside the bare model: the
    completion's greedy tokens, over several generated tokens, are transformers' with the
    shift at every position (the reference hook), and their log-probs agree within 1e-4."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main
    from ltv_vllm.client import ClientError, first_step_only
    from ltv_vllm.data import sample_regression_episode
    from ltv_vllm.tasks import get_task
    from ltv_vllm.vector import load_task_vector

    model = make_vllm_llama(tokenizer, seed=31, tie=False)  # untied: answers that vary
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    vec = tmp_path / "relu.pt"
    r = CliRunner().invoke(main, [
        "extract", "--model", str(tmp_path / "m"), "--task", "relu", "--k", "3", "--n", "12",
        "--n-test", "3", "--seed", "2", "--dtype", "float32", "-o", str(vec), "--quiet"])
    assert r.exit_code == 0, r.output
    tv = load_task_vector(vec)
    task = get_task("relu", regression=True)
    prompts = [task.query(e.text) for e in sample_regression_episode(
        task, k=3, n=12, n_test=3, seed=2).test]
    proc, url, log = start_server(tmp_path / "m", [f"relu={vec}"], tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        got = {}
        for name, shift in (("relu", tv), (str(tmp_path / "m"), None)):
            for p in prompts:
                c = client.completions.create(
                    model=name, prompt=p, max_tokens=8, temperature=0.0, logprobs=1,
                    extra_body={"return_tokens_as_token_ids": True}).choices[0]
                toks = [int(t.split(":", 1)[1]) for t in c.logprobs.tokens]
                ref = reference_logprobs(model, tokenizer, p, toks, shift)
                n_prompt = len(tokenizer(p)["input_ids"])
                assert len(toks) > 1  # several generated tokens, each one shifted
                for step, tok in enumerate(toks):
                    row = ref[n_prompt - 1 + step]
                    assert int(row.argmax()) == tok, (name, p, step)
                    assert abs(c.logprobs.token_logprobs[step] - float(row[tok])) < 1e-4
                got[name, p] = toks
        assert any(got["relu", p] != got[str(tmp_path / "m"), p] for p in prompts)
        # first step only (client side): the vector's first token, then the bare model
        for p in prompts:
            g = first_step_only(url, p, vector="relu", base=str(tmp_path / "m"), max_tokens=8)
            n_prompt = len(tokenizer(p)["input_ids"])
            shifted = reference_logprobs(model, tokenizer, p, g.token_ids, tv)
            plain = reference_logprobs(model, tokenizer, p, g.token_ids, None)
            assert len(g.token_ids) == len(got["relu", p])  # no EOS in this model's answers
            assert g.token_ids[0] == got["relu", p][0] == int(shifted[n_prompt - 1].argmax())
            for step, tok in enumerate(g.token_ids[1:], 1):
                assert int(plain[n_prompt - 1 + step].argmax()) == tok, (p, step)
            assert g.text == tokenizer.decode(g.token_ids)
        with pytest.raises(ClientError, match="server refused \\(404\\)"):
            first_step_only(url, prompts[0], vector="nope", base=str(tmp_path / "m"))
        with pytest.raises(ClientError, match="at least 1"):
            first_step_only(url, prompts[0], vector="relu", base=str(tmp_path / "m"),
                            max_tokens=0)
    finally:
        stop(proc, log)


def test_task_store_server(assets, tokenizer, tmp_path):
    """`serve --task-store`: entries already there are served; a task-vector file POSTed to
    /v1/ltv/tasks is checked, stored and served at once (answers = transformers + the
    vector the store holds); bad uploads get 4xx and leave nothing; a full disk is a 507
    (upload) or a failed compile, leaving nothing; DELETE unserves and removes; after a
    restart the store's tasks are served again."""
    from ltv_vllm.taskstore import TaskStore

    d, model, vecs = assets
    store = TaskStore(tmp_path / "store")
    store.add("alpha", vecs["alpha"][0], d)
    args = ("--task-store", str(store.root), "--max-tasks", "2")
    proc, url, log = start_server(d, [f"beta={vecs['beta'][1]}"], tmp_path, args)
    tasks = f"{url}/v1/ltv/tasks"
    try:
        listed = httpx.get(tasks).json()["data"]
        assert [(t["name"], t["served"]) for t in listed] == [("alpha", True)]
        served = {"alpha": store.get("alpha").vector(), "beta": vecs["beta"][0]}
        check_mixed(url, served, model, tokenizer)

        def post(name, path=None, data=None, **kw):
            files = {"vector": (Path(path).name, Path(path).read_bytes())} if path else None
            return httpx.post(tasks, data={"name": name, **(data or {})}, files=files,
                              timeout=60, **kw)

        # a .pt upload of rank 8 on a 128-dim model: stored, served, equal to the reference
        g = post("gamma", vecs["beta"][1])  # a .pt file (a zip; loaded with weights_only)
        assert g.status_code == 201, g.text
        assert g.json()["name"] == "gamma" and g.json()["served"]
        held = store.get("gamma").vector()
        assert torch.equal(held.U, vecs["beta"][0].U)
        check_mixed(url, {"gamma": held, "alpha": served["alpha"]}, model, tokenizer)
        # refusals: nothing is written, the server stays up
        bad = tmp_path / "junk.safetensors"
        bad.write_bytes(b"\x00garbage")
        (tmp_path / "o").mkdir()
        _, wrong_path = write_model_and_vectors(tmp_path / "o", tokenizer)  # another model
        as_st = vecs["alpha"][0].save(tmp_path / "alpha.safetensors")
        cases = [(post("gamma", vecs["alpha"][1]), 409, "exists"),
                 (post("../x", vecs["alpha"][1]), 400, "task name"),
                 (post("delta", bad), 422, "corrupt"),
                 (post("delta", wrong_path), 422, "hidden size"),
                 (post("delta", vecs["alpha"][1], {"extra": "1"}), 400, "unknown field"),
                 (post("delta", vecs["alpha"][1]), 409, "holds 2 tasks"),
                 (httpx.post(tasks, json={"name": "delta"}), 400, "missing field 'task'"),
                 (httpx.post(tasks, content=b"x", headers={"content-type": "text/plain"}), 415,
                  "multipart"),
                 (httpx.delete(f"{tasks}/beta"), 409, "command line"),
                 (httpx.delete(f"{tasks}/nope"), 404, "no task"),
                 (httpx.get(f"{tasks}/nope"), 404, "no task")]
        for r, code, words in cases:
            assert r.status_code == code and words in r.json()["error"]["message"], r.text
        assert store.names() == ["alpha", "gamma"]
        assert sorted(p.name for p in store.root.iterdir()) == [".jobs", "alpha", "gamma"]
        assert not any((store.root / ".jobs").iterdir())  # uploads leave no temp files
        # DELETE: unserved (404 for its requests), removed, and the slot is free again
        assert httpx.delete(f"{tasks}/gamma").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gamma", prompt=PROMPTS[0], max_tokens=1)
        assert store.names() == ["alpha"]
        # a full disk: the store's writes fail past a size the upload's temp file and
        # a compile's job file fit under, but no adapter does (lora_B alone is vocab x 8
        # floats): 507, nothing left behind, the server stays up
        limit = as_st.stat().st_size + 512
        assert limit < len(tokenizer) * 8 * 4
        with file_size_limit(proc.pid, limit):
            r = post("delta", as_st)
            assert r.status_code == 507 and "disk is full" in r.json()["error"]["message"], r.text
            assert httpx.post(tasks, json=_compile_body("c6")).status_code == 202
            deadline = time.time() + 300
            while (got := httpx.get(f"{tasks}/c6").json())["status"] != "failed":
                assert got["status"] != "ready" and time.time() < deadline, got
                time.sleep(0.5)
        assert "disk is full" in got["error"], got
        assert httpx.delete(f"{tasks}/c6").status_code == 200
        assert store.names() == ["alpha"]
        assert sorted(p.name for p in store.root.iterdir()) == [".jobs", "alpha"]
        assert not any((store.root / ".jobs").iterdir())
        assert post("delta", as_st).status_code == 201  # a .safetensors upload
    finally:
        stop(proc, log)
    # a restart serves what the store holds; --api-key guards the store's routes like vLLM's
    proc, url, log = start_server(d, [], tmp_path, (*args, "--api-key", "x"))
    try:
        assert httpx.get(f"{url}/v1/ltv/tasks").status_code == 401
        listed = httpx.get(f"{url}/v1/ltv/tasks", headers={"Authorization": "Bearer x"}
                           ).json()["data"]
        assert [(t["name"], t["served"]) for t in listed] == [("alpha", True), ("delta", True)]
        check_mixed(url, {"delta": store.get("delta").vector(), str(d): None}, model, tokenizer)
        # the command-line client: list, delete, upload, compile from files and wait
        from click.testing import CliRunner

        from ltv_vllm.cli import main

        def cli(*a):
            r = CliRunner().invoke(main, [*a, "--url", url, "--api-key", "x"])
            return r.exit_code, r.output

        code, out = cli("tasks", "remote", "list")
        assert code == 0 and out.split("\n")[0].split()[:2] == ["alpha", "ready"], out
        assert cli("tasks", "remote", "delete", "delta") == (0, "deleted delta\n")
        code, out = cli("tasks", "remote", "delete", "delta")
        assert code == 1 and "server refused (404)" in out and len(out.splitlines()) == 1
        files = {}
        body = _compile_body("c5")
        for key in ("demos", "queries"):
            files[key] = tmp_path / f"{key}.jsonl"
            files[key].write_text("".join(json.dumps(x) + "\n" for x in body[key]))
        code, out = cli("compile", "--name", "c5", "--task", "sst2", "--demos",
                        str(files["demos"]), "--queries", str(files["queries"]), "--wait")
        assert code == 0, out
        assert json.loads(out[out.index("{"):])["status"] == "ready"
        c5 = store.get("c5").vector()
        assert c5.provenance.task["labels"] == ["negative", "positive"]  # sst2's template
        check_mixed(url, {"c5": c5, "alpha": store.get("alpha").vector()}, model, tokenizer)
        code, out = cli("tasks", "remote", "add", "c5", str(vecs["beta"][1]))
        assert code == 1 and "(409)" in out, out
    finally:
        stop(proc, log)


def _compile_body(name: str, flip: bool = False, queries: list[str] | None = None) -> dict:
    words = ["the plot is dull", "a warm and funny film", "boring and slow", "great acting",
             "i loved it", "a waste of time", "fresh and bright", "flat and tired", "so good",
             "so bad", "the cast shines", "the script fails"]
    labs = ["negative", "positive"][::-1] if flip else ["negative", "positive"]
    return {"name": name,
            "task": {"in_prefix": "Review", "label_prefix": "Sentiment", "labels": labs},
            "demos": [{"text": w, "label": labs[i % 2]} for i, w in enumerate(words[:4])],
            "queries": queries or words[4:]}


def test_compile_over_http_while_serving(assets, tokenizer, tmp_path):
    """POST demonstrations to a running server: two tasks compiled by the worker while a
    client keeps requesting a third; their answers equal transformers + the vector the store
    holds; the concurrent client saw no error and no wrong shift; a compiling task's name is
    a 404; bad requests are 4xx; a killed worker is reported and leaves no entry."""
    from ltv_vllm.taskstore import TaskStore

    d, model, vecs = assets
    store = TaskStore(tmp_path / "store")
    proc, url, log = start_server(d, [f"beta={vecs['beta'][1]}"], tmp_path,
                                  ("--task-store", str(store.root), "--max-tasks", "3"))
    tasks = f"{url}/v1/ltv/tasks"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    seen, errors, stop_flag = [], [], threading.Event()

    def traffic():
        while not stop_flag.is_set():
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
            r = httpx.post(tasks, json=_compile_body(name, flip), timeout=30)
            assert r.status_code == 202, r.text
            assert r.json()["status"] in ("queued", "compiling")
        with pytest.raises(openai.NotFoundError):  # not served until it is complete
            client.completions.create(model="c2", prompt=PROMPTS[0], max_tokens=1)
        cases = [(httpx.post(tasks, content=b"{oops", timeout=30,
                             headers={"content-type": "application/json"}), 400, "malformed"),
                 (httpx.post(tasks, json=_compile_body("c1"), timeout=30), 409, "exists"),
                 (httpx.post(tasks, json={**_compile_body("c9"), "colour": 1}), 400, "unknown"),
                 (httpx.post(tasks, json=_compile_body("c9", queries=["word " * 300])), 400,
                  "served context is 256 tokens")]
        for r, code, words in cases:
            assert r.status_code == code and words in r.json()["error"]["message"], r.text
        deadline = time.time() + 600
        while time.time() < deadline:
            states = {x["name"]: x["status"] for x in httpx.get(tasks).json()["data"]}
            if states == {"c1": "ready", "c2": "ready"}:
                break
            assert "failed" not in states.values(), httpx.get(tasks).json()
            time.sleep(1)
        assert store.names() == ["c1", "c2"]
        held = {n: store.get(n).vector() for n in ("c1", "c2")}
        assert store.get("c1").record["source"] == "compiled"
        assert not torch.equal(held["c1"].U, held["c2"].U)
        check_mixed(url, {**held, "beta": vecs["beta"][0]}, model, tokenizer)
        # a worker killed mid-compile: reported as failed, nothing in the store
        r = httpx.post(tasks, json=_compile_body("c3", queries=["so so film"] * 3000))
        assert r.status_code == 202, r.text
        job_status = None
        while time.time() < deadline:
            found = list((store.root / ".jobs").glob("c3-*/status.json"))
            if found and json.loads(found[0].read_text())["state"] == "extracting":
                job_status = json.loads(found[0].read_text())
                break
            time.sleep(0.2)
        assert job_status is not None
        os.kill(job_status["pid"], 9)
        while httpx.get(f"{tasks}/c3").json()["status"] != "failed":
            assert time.time() < deadline
            time.sleep(0.5)
        assert "worker died" in httpx.get(f"{tasks}/c3").json()["error"]
        assert httpx.delete(f"{tasks}/c3").status_code == 200
        assert store.names() == ["c1", "c2"] and httpx.get(f"{tasks}/c3").status_code == 404
    finally:
        stop_flag.set()
        t.join()
        stop(proc, log)
    assert not errors, errors[:3]
    assert len(seen) > 5
    n_prompt = {p: len(tokenizer(p)["input_ids"]) for p in PROMPTS}
    for prompt, lp in seen:  # every concurrent answer carried beta's shift, and only it
        toks = [int(x.split(":", 1)[1]) for x in lp.tokens]
        ref = reference_logprobs(model, tokenizer, prompt, toks, vecs["beta"][0])
        for step, tok in enumerate(toks):
            row = ref[n_prompt[prompt] - 1 + step]
            assert abs(lp.token_logprobs[step] - float(row[tok])) < 1e-4
