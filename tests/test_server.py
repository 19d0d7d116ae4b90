"""The real OpenAI server on 127.0.0.1 with a tiny model and three task vectors (two
hidden-space, one logit-space).

Concurrent mixed requests (three tasks and the bare model in flight together) through the
`openai` client; every returned logprob is checked against transformers + the reference
hook within 1e-4 (float32), in fused mode and in multi-task (LoRA) mode. Bad requests get
OpenAI-style errors and the server stays up.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
    log = open(tmp / f"server-{port}.log", "w")  # noqa: SIM115 - closed in stop()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 400
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((tmp / f"server-{port}.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not start: " + (tmp / f"server-{port}.log").read_text()[-3000:])


def stop(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


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
    vector the store holds); bad uploads get 4xx and leave nothing; DELETE unserves and
    removes; after a restart the store's tasks are served again."""
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
                 (httpx.post(tasks, json={"name": "delta"}), 415, "multipart"),
                 (httpx.delete(f"{tasks}/beta"), 409, "command line"),
                 (httpx.delete(f"{tasks}/nope"), 404, "no task"),
                 (httpx.get(f"{tasks}/nope"), 404, "no task")]
        for r, code, words in cases:
            assert r.status_code == code and words in r.json()["error"]["message"], r.text
        assert store.names() == ["alpha", "gamma"]
        assert sorted(p.name for p in store.root.iterdir()) == ["alpha", "gamma"]
        # DELETE: unserved (404 for its requests), removed, and the slot is free again
        assert httpx.delete(f"{tasks}/gamma").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gamma", prompt=PROMPTS[0], max_tokens=1)
        assert store.names() == ["alpha"]
        assert post("delta", as_st).status_code == 201  # a .safetensors upload
    finally:
        stop(proc, log)
    # a restart serves what the store holds
    proc, url, log = start_server(d, [], tmp_path, args)
    try:
        listed = httpx.get(f"{url}/v1/ltv/tasks").json()["data"]
        assert [(t["name"], t["served"]) for t in listed] == [("alpha", True), ("delta", True)]
        check_mixed(url, {"delta": store.get("delta").vector(), str(d): None}, model, tokenizer)
    finally:
        stop(proc, log)
