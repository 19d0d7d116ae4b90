"""The real OpenAI server on 127.0.0.1 with a tiny model and three task vectors (two
hidden-space, one logit-space).

Concurrent mixed requests (three tasks and the bare model in flight together) through the
`openai` client; every returned logprob is checked against transformers + the reference
hook within 1e-4 (float32), in fused mode and in multi-task (LoRA) mode. Bad requests get
OpenAI-style errors and the server stays up.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
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

from conftest import make_vllm_llama, reference_logprobs
from ltv_vllm.core.vector import TaskVector, model_identity
from ltv_vllm.serving.client import classify
from ltv_vllm.tasks.specs import BUILTIN_TASKS, label_token_ids

pytestmark = pytest.mark.slow(seconds=49)  # see conftest's ordering

PROMPTS = ["Review: the plot is dull\nSentiment:", "News: leaders meet for peace talks\nType:"]
SST2 = BUILTIN_TASKS["sst2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    # untied: a regression vector's greedy answers then vary (test_regression_vector_server)
    return make_assets(tmp_path_factory, tokenizer, tie=False)


def make_assets(tmp_path_factory, tokenizer, tie: bool = True):
    """A tiny model directory, the model, and three vectors {name: (TaskVector, .pt path)}."""
    d = tmp_path_factory.mktemp("srv-model")
    model = make_vllm_llama(tokenizer, seed=31, tie=tie)
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


def start_server(model_dir: Path | str, vector_args: list[str], tmp: Path,
                 extra: tuple[str, ...] = (), *, cwd: Path | None = None,
                 env_extra: dict[str, str] | None = None, attempts: int = 3):
    """`ltv-vllm serve` on a free port; (process, url, log). `model_dir` may be relative to
    `cwd` (then it is also the served base model's name). The server runs in a process group
    of its own (`stop` ends all of it). A port taken between `free_port` and the server's
    bind (another process may win it) is retried on a new port."""
    for attempt in range(attempts):
        port = free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "LTV_VLLM_CACHE": str(tmp / "cache"), "TOKENIZERS_PARALLELISM": "false",
               # the CPU backend then runs its one worker inside the engine-core process
               # (the "uni" executor) instead of a third process: ~10 s less per start here;
               # the API server and the engine core stay separate processes, as served
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               **(env_extra or {})}
        cmd = [sys.executable, "-m", "ltv_vllm.cli", "serve", "--model", str(model_dir),
               "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
               *[a for v in vector_args for a in ("--task-vector", v)], *extra,
               "--enforce-eager",
               # 64 MiB, some 65,000 tokens of this model: a 1 GiB cache is half a second
               # of page faults per start, for nothing
               "--kv-cache-memory-bytes", str(64 << 20)]
        log_path = tmp / f"server-{port}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        # the log is copied through a pipe, so the server never writes a file of its own
        # (file_size_limit below limits only the task store's writes)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                cwd=cwd, start_new_session=True)
        proc.copier = threading.Thread(target=_copy, args=(proc.stdout, log), daemon=True)
        proc.copier.start()
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 400
        while time.time() < deadline:
            if proc.poll() is not None:
                stop(proc, log)
                text = log_path.read_text()
                if "address already in use" in text.lower() and attempt + 1 < attempts:
                    break  # lost the port race: another port
                raise RuntimeError(text[-3000:])
            try:
                if HTTP.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url, log
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            stop(proc, log)
            raise RuntimeError("server did not start: " + log_path.read_text()[-3000:])
    raise AssertionError("unreachable")


def _copy(src, dst) -> None:
    for chunk in iter(lambda: src.read1(1 << 16), b""):
        dst.write(chunk)
        dst.flush()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(proc, log) -> None:
    """End the server's whole process group (API server, engine core, compile workers):
    SIGTERM, then SIGKILL after 30 s; no process of it outlives the test."""
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    deadline = time.time() + 30
    while _group_alive(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    if _group_alive(proc.pid):  # a child ignored SIGTERM: end it, and say so
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("a server process outlived its server by 30 s")
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


# one client for the tests' plain HTTP calls: `httpx.get` builds a client, and its TLS
# context, per call (20 ms of CPU each, some 600 times a run, beside the servers starting);
# no keep-alive, so every request still opens a connection of its own, as the module-level
# calls did
HTTP = httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))

_ORACLE: dict = {}


def oracle(model, tokenizer, prompt: str, tokens: list[int], tv) -> torch.Tensor:
    """`reference_logprobs`, remembered: the server checks ask the same model, prompt, tokens
    and vector again and again (every name three times a check, the fixed names after every
    change), and the oracle model is never changed. The key holds the model and the vector
    themselves, so their ids cannot be reused while remembered."""
    key = (id(model), id(tv), prompt, tuple(tokens))
    if key not in _ORACLE:
        _ORACLE[key] = (model, tv, reference_logprobs(model, tokenizer, prompt, tokens, tv))
    return _ORACLE[key][2]


def check_mixed(url: str, served: dict, model, tokenizer, per_request: bool = False) -> None:
    """served: OpenAI model name → TaskVector or None (no shift expected). Sends the key "x"
    (the tests' servers with --api-key use it). `per_request`: the server applies each
    vector's own step policy (its meta.shift_steps; older vectors: every step), else (LoRA)
    every step is shifted."""
    from ltv_vllm.serving.step_policy import parse_steps

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
        tv = served[name]
        ref = oracle(model, tokenizer, prompt, toks, tv)
        plain = oracle(model, tokenizer, prompt, toks, None)
        n = (parse_steps(tv.provenance.shift_steps or "all")
             if per_request and tv is not None else None)
        for step, top in enumerate(lp.top_logprobs):
            row = (ref if n is None or step < n else plain)[n_prompt[prompt] - 1 + step]
            assert int(row.argmax()) == toks[step], (name, step)
            for key, v in top.items():
                assert abs(v - float(row[int(key.split(":", 1)[1])])) < 1e-4, (name, step, key)


def check_policies(client, model_name: str, tv, model, tokenizer, cases,
                   xargs: dict | None = None) -> None:
    """Each (steps, n, stream) of `cases` through the OpenAI client: the request's tokens and
    logprobs are the greedy loop's that shifts exactly its first n steps with `tv`, streamed
    or not; the response (every streamed chunk) names the task it got as its `model`."""
    n_prompt = len(tokenizer(PROMPTS[0])["input_ids"])
    for steps, n, stream in cases:
        kw = dict(model=model_name, prompt=PROMPTS[0], max_tokens=3, temperature=0.0,
                  logprobs=5, extra_body={"return_tokens_as_token_ids": True,
                                          "vllm_xargs": {**(xargs or {}), "ltv_steps": steps}})
        chunks = (list(client.completions.create(**kw, stream=True)) if stream
                  else [client.completions.create(**kw)])
        assert {c.model for c in chunks} == {(xargs or {}).get("ltv_task", model_name)}
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        tops = [t for c in chunks for t in c.choices[0].logprobs.top_logprobs]
        assert len(tops) == 3
        toks = [int(t.split(":", 1)[1]) for t in tokens]
        shifted = oracle(model, tokenizer, PROMPTS[0], toks, tv)
        plain = oracle(model, tokenizer, PROMPTS[0], toks, None)
        for step, top in enumerate(tops):
            row = (shifted if step < n else plain)[n_prompt - 1 + step]
            for key, v in top.items():
                assert abs(v - float(row[int(key.split(":", 1)[1])])) < 1e-4, (steps, step)


# a chat template that renders a conversation as its messages' text: a chat request then
# carries exactly the completion prompt the vector was fitted on
PLAIN_CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def check_chat(url: str, task: str, tv, model, tokenizer) -> None:
    """A chat request the vector would shift is refused (400: the vector was fitted on the
    completion prompt); with `ltv_chat: "allow"` it is shifted like the completion request
    (`PLAIN_CHAT` renders the same prompt), at the task's steps; with `ltv_steps: 0`, nothing
    is shifted, so nothing is refused."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    chat = dict(model=task, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=3,
                temperature=0.0, logprobs=True, top_logprobs=5)
    with pytest.raises(openai.BadRequestError, match="fitted on the task's completion prompt"):
        client.chat.completions.create(**chat)
    n_prompt = len(tokenizer(PROMPTS[0])["input_ids"])
    for xargs, n in (({"ltv_chat": "allow", "ltv_steps": "all"}, 3),
                     ({"ltv_chat": "allow", "ltv_steps": "first"}, 1), ({"ltv_steps": 0}, 0)):
        c = client.chat.completions.create(**chat, extra_body={
            "vllm_xargs": xargs, "return_tokens_as_token_ids": True}).choices[0]
        steps = c.logprobs.content
        toks = [int(t.token.split(":", 1)[1]) for t in steps]
        shifted = reference_logprobs(model, tokenizer, PROMPTS[0], toks, tv)
        plain = reference_logprobs(model, tokenizer, PROMPTS[0], toks, None)
        assert len(steps) == 3
        for step, lp in enumerate(steps):
            row = (shifted if step < n else plain)[n_prompt - 1 + step]
            for top in lp.top_logprobs:
                tok = int(top.token.split(":", 1)[1])
                assert abs(top.logprob - float(row[tok])) < 1e-4, (xargs, step)


def prefix_hits(url: str) -> float:
    """vLLM's prefix-cache hit counter (tokens), from /metrics."""
    text = HTTP.get(f"{url}/metrics", headers={"Authorization": "Bearer x"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


@pytest.fixture(scope="module")
def multi_task_server(assets, tmp_path_factory):
    """One server for both tests of its configuration (a start is two fresh interpreters
    importing vLLM): named vectors, per-request tasks (the default), the three vectors of
    `assets` and a regression vector `relu` extracted on the same model; (url, relu path)."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    d, _model, vecs = assets
    tmp = tmp_path_factory.mktemp("multi-task-server")
    relu = tmp / "relu.pt"
    r = CliRunner().invoke(main, [
        "extract", "--model", str(d), "--task", "relu", "--k", "3", "--n", "12",
        "--n-test", "3", "--seed", "2", "--dtype", "float32", "-o", str(relu), "--quiet"])
    assert r.exit_code == 0, r.output
    names = [f"{n}={p}" for n, (_, p) in vecs.items()] + [f"relu={relu}"]
    proc, url, log = start_server(d, names, tmp, ("--chat-template", PLAIN_CHAT))
    try:
        yield url, relu
    finally:
        stop(proc, log)


def test_multi_task_server(assets, tokenizer, multi_task_server):
    """Named vectors, per-request tasks (the default): the `model` name chooses the task
    (or `vllm_xargs.ltv_task` beside the base model's name); each request is shifted by its
    own vector at its own steps, with the three tasks and the bare model in flight together;
    tasks share prefix-cache blocks; bad requests are 4xx and the server stays right."""
    d, model, vecs = assets
    url, _relu = multi_task_server
    served = {name: tv for name, (tv, _) in vecs.items()} | {str(d): None}
    check_mixed(url, served, model, tokenizer)
    # the logit vector really moves the logits
    moved = (reference_logprobs(model, tokenizer, PROMPTS[0], [], vecs["gamma"][0])
             - reference_logprobs(model, tokenizer, PROMPTS[0], [], None))
    assert moved.abs().max() > 1e-2
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    # a step policy per request, per task, streamed or not
    check_policies(client, "alpha", vecs["alpha"][0], model, tokenizer,
                   [("first", 1, True), (2, 2, False)])
    check_policies(client, "gamma", vecs["gamma"][0], model, tokenizer,
                   [("first", 1, False), (0, 0, True)])
    # the task as a request field beside the base model's name
    check_policies(client, str(d), vecs["beta"][0], model, tokenizer, [("all", 3, False)],
                   xargs={"ltv_task": "beta"})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="omega", prompt=PROMPTS[0], max_tokens=1)
    for kw, words in (
            ({"model": "alpha", "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
            ({"model": "alpha", "extra_body": {"vllm_xargs": {"ltv_task": "beta"}}},
             "name two tasks"),
            ({"model": str(d), "extra_body": {"vllm_xargs": {"ltv_task": "omega"}}},
             "unknown ltv_task 'omega'"),
            ({"model": "alpha", "extra_body": {"vllm_xargs": {"ltv_steps": "most"}}},
             "ltv_steps must be")):
        with pytest.raises(openai.BadRequestError, match=words):
            client.completions.create(prompt=PROMPTS[0], max_tokens=1, **kw)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="alpha", prompt="word " * 400, max_tokens=1)
    # a route that would answer a task's name with the bare model refuses it
    r = HTTP.post(f"{url}/v1/responses", json={"model": "alpha", "input": "hi"},
                   headers={"Authorization": "Bearer x"})
    assert r.status_code == 400 and "tasks are served on /v1/completions" in r.text, r.text
    # one prompt, two tasks: the second finds the first's KV blocks (LoRA adapters could
    # not share them: vLLM's prefix-cache key holds the adapter's name)
    long = "Review: " + "word " * 60 + "\nSentiment:"  # 186 tokens: a whole block
    client.completions.create(model="alpha", prompt=long, max_tokens=1)
    before = prefix_hits(url)
    client.completions.create(model="beta", prompt=long, max_tokens=1)
    assert prefix_hits(url) - before >= 64, prefix_hits(url) - before
    check_chat(url, "alpha", vecs["alpha"][0], model, tokenizer)
    # the task as a field beside the base model's name is refused in chat alike
    r = HTTP.post(f"{url}/v1/chat/completions", json={
        "model": str(d), "messages": [{"role": "user", "content": PROMPTS[0]}],
        "vllm_xargs": {"ltv_task": "beta"}}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 400 and "fitted on the task's completion prompt" in r.text
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


def test_fused_server(assets, tokenizer, tmp_path):
    d, model, vecs = assets
    tv, path = vecs["alpha"]
    proc, url, log = start_server(d, [str(path)], tmp_path, ("--chat-template", PLAIN_CHAT))
    try:
        check_chat(url, "alpha", tv, model, tokenizer)
        # fused: every request is shifted, whichever served name it uses
        check_mixed(url, {"alpha": tv, str(d): tv}, model, tokenizer)
        # a request's step policy through the OpenAI API (`vllm_xargs`), streamed or not:
        # shifted at exactly its first n steps
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        check_policies(client, "alpha", tv, model, tokenizer,
                       [("first", 1, False), (2, 2, True), (0, 0, False)])
        with pytest.raises(openai.BadRequestError, match="ltv_steps must be"):
            client.completions.create(model="alpha", prompt=PROMPTS[0], max_tokens=2,
                                      extra_body={"vllm_xargs": {"ltv_steps": "most"}})
    finally:
        stop(proc, log)


def test_regression_vector_server(assets, tokenizer, multi_task_server):
    """A regression LTV (`extract --task relu`) served by name beside the bare model: the
    completion's greedy tokens, over several generated tokens, are transformers' with the
    shift at every position (the reference hook; `ltv_steps: all`), and their log-probs agree
    within 1e-4; a request naming no policy gets the vector's recorded one (first)."""
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.serving.client import ClientError, first_step_only
    from ltv_vllm.tasks.data import sample_regression_episode
    from ltv_vllm.tasks.specs import get_task

    d, model, _vecs = assets  # untied: answers that vary
    url, vec = multi_task_server  # `relu` was extracted (`extract --task relu`) on `d`
    tv = load_task_vector(vec)
    assert tv.provenance.shift_steps == "first"  # what extract records
    task = get_task("relu", regression=True)
    prompts = [task.query(e.text) for e in sample_regression_episode(
        task, k=3, n=12, n_test=3, seed=2).test]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    got = {}
    for name, shift in (("relu", tv), (str(d), None)):
        for p in prompts:
            c = client.completions.create(
                model=name, prompt=p, max_tokens=8, temperature=0.0, logprobs=1,
                extra_body={"return_tokens_as_token_ids": True,
                            "vllm_xargs": {"ltv_steps": "all"}}).choices[0]
            toks = [int(t.split(":", 1)[1]) for t in c.logprobs.tokens]
            ref = reference_logprobs(model, tokenizer, p, toks, shift)
            n_prompt = len(tokenizer(p)["input_ids"])
            assert len(toks) > 1  # several generated tokens, each one shifted
            for step, tok in enumerate(toks):
                row = ref[n_prompt - 1 + step]
                assert int(row.argmax()) == tok, (name, p, step)
                assert abs(c.logprobs.token_logprobs[step] - float(row[tok])) < 1e-4
            got[name, p] = toks
    assert any(got["relu", p] != got[str(d), p] for p in prompts)
    # first step only: the vector's first token, then the bare model; the vector's
    # default (no ltv_steps) is the same
    for p in prompts:
        g = first_step_only(url, p, vector="relu", max_tokens=8)
        default = client.completions.create(
            model="relu", prompt=p, max_tokens=8, temperature=0.0, logprobs=0,
            extra_body={"return_tokens_as_token_ids": True}).choices[0]
        assert [int(t.split(":", 1)[1]) for t in default.logprobs.tokens] == g.token_ids
        n_prompt = len(tokenizer(p)["input_ids"])
        shifted = reference_logprobs(model, tokenizer, p, g.token_ids, tv)
        plain = reference_logprobs(model, tokenizer, p, g.token_ids, None)
        assert len(g.token_ids) == len(got["relu", p])  # no EOS in this model's answers
        assert g.token_ids[0] == got["relu", p][0] == int(shifted[n_prompt - 1].argmax())
        for step, tok in enumerate(g.token_ids[1:], 1):
            assert int(plain[n_prompt - 1 + step].argmax()) == tok, (p, step)
        # vLLM's incremental detokenizer holds back a character cut off by max_tokens
        # (decode writes U+FFFD for its bytes); the rest is the same text
        full = tokenizer.decode(g.token_ids)
        assert full.startswith(g.text) and set(full[len(g.text):]) <= {"\ufffd"}
    with pytest.raises(ClientError, match="server refused \\(404\\)"):
        first_step_only(url, prompts[0], vector="nope")
    with pytest.raises(ClientError, match="at least 1"):
        first_step_only(url, prompts[0], vector="relu", max_tokens=0)
