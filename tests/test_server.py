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
import math
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from conftest import (
    MARGIN,
    assert_told_apart,
    make_vllm_llama,
    plan,
    record_start,
    reference_logprobs,
)
from ltv_vllm.core.vector import TaskVector, model_identity
from ltv_vllm.serving.client import classify
from ltv_vllm.tasks.specs import BUILTIN_TASKS, label_token_ids

pytestmark = pytest.mark.slow(seconds=215)  # see conftest's ordering

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


def runner_test_env(runner: str | None) -> dict[str, str]:
    """The environment that starts an engine on vLLM's V1 ("0") or V2 ("1") runner; V2 on
    this CPU build through `tests/v2shim` (test scaffolding: Triton's interpreter)."""
    if runner is None:
        return {}
    env = {"VLLM_USE_V2_MODEL_RUNNER": runner}
    if runner == "1":
        shim = str(Path(__file__).parent / "v2shim")
        env.update(LTV_TEST_TRITON_CPU_SHIM="1", PYTHONPATH=os.pathsep.join(
            p for p in (shim, os.environ.get("PYTHONPATH", "")) if p))
    return env


RUNNERS = ["0", "1"]  # vLLM's V1 and V2 model runners: every serving configuration on both


def assert_runner(log, runner: str | None) -> None:
    """The runner this server's engine was built with is the one asked for ("0": V1, "1":
    V2, None: vLLM's default, V1 on this CPU build): vLLM's own start-up line says V2 when
    it chose V2, and the start-up self-check (where the server runs one) names the runner
    it read from vLLM's config."""
    want = "V2" if runner == "1" else "V1"
    text = Path(log.name).read_text(errors="replace")
    assert ("Using V2 Model Runner" in text) == (want == "V2"), f"not the {want} runner"
    check = re.search(r"selfcheck passed on vLLM [^,]+, (V\d) runner", text)
    if check is not None:
        assert check[1] == want, check[0]


def start_server(model_dir: Path | str, vector_args: list[str], tmp: Path,
                 extra: tuple[str, ...] = (), *, cwd: Path | None = None,
                 env_extra: dict[str, str] | None = None, attempts: int = 3,
                 kv_bytes: int = 64 << 20, runner: str | None = None, launcher=None,
                 layout: str = "inproc",
                 model_flags: tuple[str, ...] = ("--dtype", "float32", "--max-model-len", "256")):
    """`ltv-vllm serve` on a free port; (process, url, log). `model_dir` may be relative to
    `cwd` (then it is also the served base model's name). The server runs in a process group
    of its own (`stop` ends all of it). A port taken between `free_port` and the server's
    bind (another process may win it) is retried on a new port. `kv_bytes`: the KV cache
    (the default, 64 MiB, holds some 65,000 tokens of this model: nothing is preempted).
    `runner`: vLLM's model runner ("1": V2, through `tests/v2shim`; None: as `serve` picks).
    `launcher(port)`: another command to start (a user's own `vllm serve`), in place of
    `ltv-vllm serve` (then `model_dir`, `vector_args` and `extra` are not used).
    `layout`: "inproc" runs the worker inside the engine-core process (faster to start);
    "default" is vLLM's own, what users run: the worker in a process of its own.
    `model_flags`: float32 and a 256-token context for the tiny models; () serves a real
    model as `serve` would by default."""
    assert layout in ("inproc", "default"), layout
    for attempt in range(attempts):
        port = free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "LTV_VLLM_CACHE": str(tmp / "cache"), "TOKENIZERS_PARALLELISM": "false"}
        if layout == "inproc":
            # the CPU backend then runs its one worker inside the engine-core process
            # (the "uni" executor) instead of a third process: ~10 s less per start here;
            # the API server and the engine core stay separate processes, as served
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:  # unset, whatever this pytest inherited: vLLM's MultiprocExecutor
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env.update({**runner_test_env(runner), **(env_extra or {})})
        cmd = [sys.executable, "-m", "ltv_vllm.cli", "serve", "--model", str(model_dir),
               "--port", str(port), *model_flags,
               *[a for v in vector_args for a in ("--task-vector", v)], *extra,
               *open_store(extra),
               "--enforce-eager",
               # not vLLM's 1 GiB: half a second of page faults per start, for nothing
               "--kv-cache-memory-bytes", str(kv_bytes)]
        if launcher is not None:
            cmd = launcher(port)
        log_path = tmp / f"server-{port}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        # the log is copied through a pipe, so the server never writes a file of its own
        # (file_size_limit below limits only the task store's writes)
        started = time.monotonic()
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
                    record_start("server", time.monotonic() - started)
                    assert_runner(log, runner)
                    return proc, url, log
            except httpx.HTTPError:
                pass
            # a poll, not a wait for something: /health is the only sign of readiness a
            # server gives, and its start-up takes tens of seconds
            time.sleep(0.2)
        else:
            stop(proc, log)
            raise RuntimeError("server did not start: " + log_path.read_text()[-3000:])
    raise AssertionError("unreachable")


def open_store(extra) -> list[str]:
    """`--allow-unauthenticated` for a test's task store served with no key (a store's own
    keys tests give theirs, and the flag then changes nothing): `serve` refuses it
    otherwise."""
    keyed = any(a in extra for a in ("--api-keys", "--api-key", "--allow-unauthenticated"))
    return ["--allow-unauthenticated"] if "--task-store" in extra and not keyed else []


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


class Shared:
    """A server that the tests of one configuration share (a module-scoped fixture starts it
    once and hands it to each test through `use`). What a test may change on it and must
    leave as it found it is read once, when it has started: the names it serves, with each
    store task's digest (`/v1/models`), the task store's listing where it has one, and the
    contents of `files` (a keys file). Each test that uses it reads that again first: if it
    differs, that test fails, naming the test that used the server before it. `close` reads
    it once more after the last test. Counters are not compared: they advance with every
    request, so a test on a shared server reads their change, never their value."""

    def __init__(self, url: str, headers: dict | None = None, files: tuple[Path, ...] = ()):
        self.url, self.headers, self.files = url, headers or {}, files
        self.start = self.state()
        self.last = "its start"

    def state(self) -> dict:
        import hashlib

        r = HTTP.get(f"{self.url}/v1/models", headers=self.headers)
        assert r.status_code == 200, r.text
        models = {c["id"]: (c.get("ltv") or {}).get("digest") for c in r.json()["data"]}
        r = HTTP.get(f"{self.url}/v1/ltv/tasks", headers=self.headers)
        tasks = (sorted((t["name"], t.get("status")) for t in r.json()["data"])
                 if r.status_code == 200 else None)
        files = {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None
                 for p in self.files}
        return {"models": models, "tasks": tasks, "files": files}

    def check(self, test: str) -> None:
        now = self.state()
        if now != self.start:
            changed = {k: {"at start": self.start[k], "now": now[k]}
                       for k in now if now[k] != self.start[k]}
            pytest.fail(f"the shared server {self.url} was left changed by {self.last}: "
                        f"{changed}", pytrace=False)
        self.last = test

    def use(self, request) -> None:
        """Before a test (`request`: its fixture request) uses the server."""
        self.check(request.node.nodeid)

    def close(self) -> None:
        """After the last test that used it."""
        self.check("the end")


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
    every step is shifted. Every name three times per prompt, 3 to 5 tokens, the requests
    arriving over half a second: each answer is its own name's greedy loop within 1e-4 and
    ≥ 10× that from every other name's and the bare model's (`assert_told_apart`)."""
    from ltv_vllm.serving.contract.wire import parse_steps

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    jobs = [(name, p, 3 + r) for r in range(3) for name in served for p in PROMPTS]

    def call(i_job):
        i, (name, prompt, max_tokens) = i_job
        time.sleep(0.5 * i / len(jobs))  # arrivals spread over the first requests' decoding
        r = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0.0, logprobs=5,
                                      extra_body={"return_tokens_as_token_ids": True,
                                                  "ignore_eos": True})
        return name, prompt, max_tokens, r.choices[0].logprobs

    with ThreadPoolExecutor(len(jobs)) as pool:  # all in flight together
        results = list(pool.map(call, enumerate(jobs)))

    def steps_of(tv):
        return (parse_steps(tv.provenance.shift_steps or "all")
                if per_request and tv is not None else None)

    for name, prompt, max_tokens, lp in results:
        toks = [int(t.split(":", 1)[1]) for t in lp.tokens]
        assert len(toks) == max_tokens, (name, toks)
        plans = {k: plan(tv, steps_of(tv), max_tokens) for k, tv in served.items()}
        plans["(bare)"] = plan(None, 0, max_tokens)
        check_answer(lp, plans, name, model, tokenizer, prompt)


def check_answer(lp, plans: dict, right, model, tokenizer, prompt: str) -> None:
    """One completion's logprobs (`return_tokens_as_token_ids`): greedy, each token the
    argmax of the right plan's reference row, and `assert_told_apart` over `plans`."""
    toks = [int(t.split(":", 1)[1]) for t in lp.tokens]
    n_prompt = len(tokenizer(prompt)["input_ids"])
    for step, tv in enumerate(plans[right][:len(toks)]):
        row = oracle(model, tokenizer, prompt, toks, tv)[n_prompt - 1 + step]
        assert int(row.argmax()) == toks[step], (right, step)
    got = [{int(k.split(":", 1)[1]): v for k, v in top.items()} for top in lp.top_logprobs]
    assert_told_apart(got, plans, right, model, tokenizer, prompt, toks, 1e-4, right,
                      ref=oracle)


def check_policies(client, model_name: str, tv, model, tokenizer, cases,
                   xargs: dict | None = None) -> None:
    """Each (steps, n, stream) of `cases` through the OpenAI client: the request's tokens and
    logprobs are the greedy loop's that shifts exactly its first n steps with `tv`, streamed
    or not; the response (every streamed chunk) names the task it got as its `model`."""
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
        lp = SimpleNamespace(tokens=tokens, top_logprobs=tops)
        # every other policy's answer is a wrong one (0: the bare model's)
        plans = {k: plan(tv, k, 3) for k in (0, 1, 2, 3)}
        check_answer(lp, plans, min(n, 3), model, tokenizer, PROMPTS[0])


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
    for xargs, n in (({"ltv_chat": "allow", "ltv_steps": "all"}, 3),
                     ({"ltv_chat": "allow", "ltv_steps": "first"}, 1), ({"ltv_steps": 0}, 0)):
        c = client.chat.completions.create(**chat, extra_body={
            "vllm_xargs": xargs, "return_tokens_as_token_ids": True}).choices[0]
        steps = c.logprobs.content
        assert len(steps) == 3
        lp = SimpleNamespace(tokens=[s.token for s in steps], top_logprobs=[
            {t.token: t.logprob for t in s.top_logprobs} for s in steps])
        check_answer(lp, {k: plan(tv, k, 3) for k in (0, 1, 2, 3)}, n, model, tokenizer,
                     PROMPTS[0])


def prefix_hits(url: str) -> float:
    """vLLM's prefix-cache hit counter (tokens), from /metrics."""
    text = HTTP.get(f"{url}/metrics", headers={"Authorization": "Bearer x"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


# The multi-task server's scheduler is pushed where a busy GPU server's goes: a step budget of
# 32 tokens (every prompt over it is prefilled in chunks, beside other rows' decoding), at
# most 8 requests running (the rest wait; finished rows' slots are reused and the batch is
# compacted), and a KV cache of 512 tokens, which a burst of long prompts overflows
# (running requests are preempted and recomputed). `test_scheduler_paths`.
SCHEDULER = ("--max-num-batched-tokens", "32", "--max-num-seqs", "8")
KV_BYTES = 256 << 10  # 512 tokens of this model (vLLM's start-up log: 2,048 per MiB)


@pytest.fixture(scope="module", params=RUNNERS, ids=["v1", "v2"])
def shared_multi_task_server(assets, tmp_path_factory, request):
    """One server for the tests of its configuration (a start is two fresh interpreters
    importing vLLM): named vectors, per-request tasks (the default), the three vectors of
    `assets` and a regression vector `relu` extracted on the same model; (its `Shared`,
    relu path).
    On vLLM's V1 and V2 runners (V2 through `tests/v2shim`)."""
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
    # V1 in vLLM's default layout (what users run); V2, through the shim, in-process
    proc, url, log = start_server(d, names, tmp, ("--chat-template", PLAIN_CHAT, *SCHEDULER),
                                  kv_bytes=KV_BYTES, runner=request.param,
                                  layout="default" if request.param is None else "inproc")
    try:
        shared = Shared(url)
        yield shared, relu
        shared.close()
    finally:
        stop(proc, log)


@pytest.fixture
def multi_task_server(shared_multi_task_server, request):
    """`shared_multi_task_server` for one test (`Shared.use`): (url, relu path). Its tests
    only send requests: none may leave a name served or gone."""
    shared, relu = shared_multi_task_server
    shared.use(request)
    return shared.url, relu


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
    # label-restricted classification through the server = transformers' restricted softmax;
    # compared as log-probabilities: this model's label distributions are saturated (p of
    # the likelier label 0.9993 bare, 0.99994 for alpha, 1 - 1e-9 for beta), which a
    # probability tolerance cannot tell apart, while the unlikely label's log-probability
    # is 2 nats and more apart between them
    res = classify(url, SST2, ["the plot is dull"], model="alpha")
    ids = label_token_ids(SST2, tokenizer)
    query = SST2.query("the plot is dull")
    got = torch.tensor([math.log(res[0].probs[lab]) for lab in SST2.labels], dtype=torch.float64)
    for name, tv in {"alpha": vecs["alpha"][0], "beta": vecs["beta"][0],
                     "gamma": vecs["gamma"][0], "bare": None}.items():
        want = torch.log_softmax(reference_logprobs(model, tokenizer, query, [], tv)[-1, ids], -1)
        off = float((got - want).abs().max())
        assert off < 1e-4 if name == "alpha" else off >= MARGIN * 1e-4, (name, off)


def test_docs_client_blocks_run(multi_task_server, tmp_path):
    """README's and the docs' `openai` client blocks, run as scripts against this server:
    its URL for the README's, its task `alpha` for their `trec` (test_docs runs the others)."""
    from test_docs import CLIENT, run_client_blocks

    url, _relu = multi_task_server
    run_client_blocks(CLIENT, url, "alpha", tmp_path)


@pytest.mark.parametrize("runner", RUNNERS, ids=["v1", "v2"])
def test_fused_server(assets, tokenizer, tmp_path, runner):
    d, model, vecs = assets
    tv, path = vecs["alpha"]
    proc, url, log = start_server(d, [str(path)], tmp_path, ("--chat-template", PLAIN_CHAT),
                                  runner=runner)
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
        check_fused_admission(url, d)
    finally:
        stop(proc, log)
    # folded into the head: the same admission rule (and beam search refused: its steps
    # carry no stamp)
    proc, url, log = start_server(d, [str(path)], tmp_path, ("--fold",), runner=runner)
    try:
        check_fused_admission(url, d)
        r = httpx.post(f"{url}/v1/completions", json={
            "model": "alpha", "prompt": PROMPTS[0], "max_tokens": 2, "n": 2,
            "use_beam_search": "yes"}, timeout=60)
        assert r.status_code == 400 and "beam search" in r.text, r.text
    finally:
        stop(proc, log)


def check_fused_admission(url: str, d: Path) -> None:
    """On a fused server every request is shifted, so every request must be one the gate
    admitted: a route it does not serve the vector on (/generative_scoring once scored a
    completion-shaped prompt shifted by a chat-fitted fused vector, W3) is a 4xx from the
    engine's admission check, as is a forged stamp; the served routes answer."""
    scoring = {"model": "alpha", "query": PROMPTS[0], "items": [" good"],
               "label_token_ids": [5, 6]}
    for path, body in (("/generative_scoring", scoring),
                       ("/generative_scoring", {**scoring, "model": str(d)}),
                       ("/v1/completions", {"model": "alpha", "prompt": PROMPTS[0],
                                            "max_tokens": 2,
                                            "vllm_xargs": {"ltv_admit": "0" * 32}})):
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        assert "Traceback" not in r.text
    r = httpx.post(f"{url}/v1/completions", json={"model": "alpha", "prompt": PROMPTS[0],
                                                  "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


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


WORDS = "the plot is dull and the acting is worse but a gorgeous witty seductive movie".split()


def long_prompt(tokenizer, tokens: int, seed: int) -> str:
    """An sst2-style prompt of about `tokens` tokens."""
    import random

    rng = random.Random(seed)
    text = "Review:"
    while len(tokenizer(text + "\nSentiment:")["input_ids"]) < tokens:
        text += " " + rng.choice(WORDS)
    return text + "\nSentiment:"


def constrained_greedy(model, tokenizer, prompt: str, tv, n: int, choices: list[str]):
    """transformers' greedy loop under a `choice` constraint, shifting its first n steps:
    each step takes the likeliest token whose text keeps the answer a prefix of a choice,
    until the answer is one, then the end of text (the only token the grammar then allows).
    (token ids, the answer)"""
    from ltv_vllm.extraction.apply import task_vector_applied

    texts = {t: tokenizer.decode([t]) for t in range(len(tokenizer))}
    ids, text, out = tokenizer(prompt)["input_ids"], "", []
    while text not in choices:
        ok = [t for t, s in texts.items() if s and any(c.startswith(text + s) for c in choices)]
        with torch.no_grad():
            if len(out) < n:
                with task_vector_applied(model, tv):
                    logits = model(torch.tensor([ids + out])).logits[0, -1]
            else:
                logits = model(torch.tensor([ids + out])).logits[0, -1]
        best = max(ok, key=lambda t: float(logits[t]))
        out.append(best)
        text += texts[best]
    return [*out, tokenizer.eos_token_id], text


# the burst's first requests, 8 × ~240 tokens against a 512-token KV cache: with a 32-token
# step budget a request is admitted every few steps while the earlier ones decode, so well
# before the first is done the running rows need more blocks than there are (in steps, not
# seconds: however slow the machine)
HEAVY = 8


def test_scheduler_paths(assets, tokenizer, multi_task_server):
    """Through the real server (`SCHEDULER`), each answer against transformers' greedy loop:
    a burst of 16 requests — three tasks and the bare model, named or as `ltv_task`, every
    policy: first 8 of about 90 prompt and 140 answer tokens at once, then 6 of 40 to 115
    prompt tokens and 4 to 24 answer tokens and 2 prompt lists sampled with n = 2, arriving
    30 ms apart. Prompts over the 32-token budget are prefilled in chunks, eight
    run at once (the others wait, the batch compacts as rows finish), and the 512-token KV
    cache overflows: vLLM counts preemptions. Every answer is its own task's at its own steps
    (`assert_told_apart`: ≥ 10× the tolerance from every other task, policy and the bare
    model). Then structured outputs (`choice` over the labels) under `first` and `0`: the
    constrained greedy loop's answer, which the task's first step changes."""
    d, model, vecs = assets
    url, _relu = multi_task_server
    tasks = {name: tv for name, (tv, _) in vecs.items()}
    base = str(d)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    names = ["alpha", "beta", "gamma", base]
    policies = [None, "first", 2, "all", 0]
    jobs = []
    for i in range(14):
        name = names[i % 4]
        task = name if name != base else (["beta", None][i % 2] if i % 3 else None)
        xargs = {}
        if name == base and task:
            xargs["ltv_task"] = task
        if policies[i % 5] is not None and task:
            xargs["ltv_steps"] = policies[i % 5]
        if i < HEAVY:  # sent at once, long answers: the running rows outgrow the KV cache
            max_tokens = 140 + 3 * (i % 3)
            length = 100 - 2 * i
        else:
            max_tokens = 4 + (7 * i) % 21
            length = 40 + 15 * (i - HEAVY)
        jobs.append(dict(model=name, prompt=long_prompt(tokenizer, length, i),
                         max_tokens=max_tokens, temperature=0.0,
                         extra_body={"vllm_xargs": xargs}, _task=task, _steps=policies[i % 5]))
    for i, (name, steps) in enumerate((("alpha", "first"), ("gamma", 2))):  # sampled, n = 2
        jobs.append(dict(model=name, prompt=[long_prompt(tokenizer, 60, 100 + i), PROMPTS[i]],
                         max_tokens=6, n=2, temperature=1.0,
                         extra_body={"vllm_xargs": {"ltv_steps": steps}},
                         _task=name, _steps=steps))

    def call(i_job):
        i, job = i_job
        # arrivals spread on purpose: the light requests join while the heavy ones prefill
        time.sleep(0.03 * max(0, i - HEAVY + 1))
        kw = {k: v for k, v in job.items() if not k.startswith("_")}
        kw["extra_body"] = {**kw["extra_body"], "return_tokens_as_token_ids": True,
                            "ignore_eos": True}
        return client.completions.create(**kw, logprobs=5)

    before = preemptions(url)
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(call, enumerate(jobs)))
    assert preemptions(url) > before, "the burst did not overflow the KV cache"
    from ltv_vllm.serving.contract.wire import parse_steps

    sampled = []
    for job, r in zip(jobs, results, strict=True):
        prompts = job["prompt"] if isinstance(job["prompt"], list) else [job["prompt"]]
        n = job.get("n", 1)
        assert len(r.choices) == len(prompts) * n
        for c in r.choices:
            prompt = prompts[c.index // n]
            lp = c.logprobs
            steps = len(lp.tokens)
            assert steps == job["max_tokens"]
            tv = tasks.get(job["_task"])
            k = 0 if tv is None else parse_steps(job["_steps"] if job["_steps"] is not None
                                                 else "all")
            plans = {(t, m): plan(v, m, steps) for t, v in tasks.items()
                     for m in (0, 1, 2, None)}
            plans[("bare", 0)] = plan(None, 0, steps)
            right = ("bare", 0) if tv is None or k == 0 else (job["_task"], k)
            if n == 1:
                check_answer(lp, plans, right, model, tokenizer, prompt)
            else:  # sampled: no argmax to hold, the distribution along its own tokens
                toks = [int(t.split(":", 1)[1]) for t in lp.tokens]
                got = [{int(x.split(":", 1)[1]): v for x, v in top.items()}
                       for top in lp.top_logprobs]
                assert_told_apart(got, plans, right, model, tokenizer, prompt, toks, 1e-4,
                                  right, ref=oracle)
                sampled.append((prompt, tuple(toks)))
    assert len(set(sampled)) > len({p for p, _ in sampled}), "n = 2 gave one answer twice"
    # structured outputs: gamma's first step flips this text's label
    choices = [" negative", " positive"]
    prompt = SST2.query("i loved it")
    want = {steps: constrained_greedy(model, tokenizer, prompt, tasks["gamma"], n, choices)
            for steps, n in (("first", 1), (0, 0))}
    assert want["first"][1] != want[0][1]  # the oracle's premise
    for steps in ("first", 0):
        c = client.completions.create(
            model="gamma", prompt=prompt, max_tokens=8, temperature=0.0,
            extra_body={"structured_outputs": {"choice": choices},
                        "vllm_xargs": {"ltv_steps": steps},
                        "return_tokens_as_token_ids": True}, logprobs=1).choices[0]
        toks = [int(t.split(":", 1)[1]) for t in c.logprobs.tokens]
        assert (toks, c.text) == want[steps], (steps, toks, c.text)


def preemptions(url: str) -> float:
    """vLLM's preemption counter, from /metrics."""
    text = HTTP.get(f"{url}/metrics", headers={"Authorization": "Bearer x"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_preemptions_total"))


@pytest.mark.parametrize("target", ["group", "main"])
def test_sigterm_shuts_the_server_down_cleanly(assets, tmp_path, target):
    """SIGTERM to the server's process group (systemd's default) or to its main process
    alone, in vLLM's default process layout, with a request answered before: every process
    ends, the exit status is 0, the log holds no traceback and no EngineDeadError, and a
    stream open when the signal came ends as vLLM ends an aborted request ([DONE], no chunk
    claiming a finished answer) instead of holding the server up (`api_server.shutdown`)."""
    d, _, vecs = assets
    proc, url, log = start_server(d, [], tmp_path, (
        "--task-store", str(tmp_path / "store"), "--allow-unauthenticated",
        "--fidelity-sample", "1"), layout="default")
    try:
        with open(vecs["alpha"][1], "rb") as f:
            r = HTTP.post(f"{url}/v1/ltv/tasks", files={"vector": ("alpha.pt", f)},
                          data={"name": "alpha"}, timeout=120)
        assert r.status_code in (200, 201), r.text
        r = HTTP.post(f"{url}/v1/completions", json={"model": "alpha", "prompt": "a b c",
                                                     "max_tokens": 2, "temperature": 0.0})
        assert r.status_code == 200, r.text
        # held open by construction: the engine core is stopped (SIGSTOP) before the stream
        # is sent, so the engine cannot have finished it when the signal lands (the tiny
        # model finishes 200 tokens before a client reads its first chunk); the stream is
        # open once its headers arrive. The core resumes right after the signal, so with the
        # group's signal it races the API server's shutdown as it would under systemd.
        core = engine_core_of(proc.pid)
        os.kill(core, signal.SIGSTOP)
        try:
            stream = HTTP.stream("POST", f"{url}/v1/completions", json={
                "model": "alpha", "prompt": "a b c", "max_tokens": 200, "ignore_eos": True,
                "stream": True, "temperature": 0.0})
            response = stream.__enter__()
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()
            if target == "group":
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                os.kill(proc.pid, signal.SIGTERM)
        finally:
            os.kill(core, signal.SIGCONT)
        rc = proc.wait(60)
        deadline = time.time() + 30
        while _group_alive(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not _group_alive(proc.pid), "a server process outlived SIGTERM"
        rest = list(_drain(lines))
    finally:
        stop(proc, log)
    text = open(log.name).read()
    assert "Traceback" not in text and "EngineDeadError" not in text, text[-3000:]
    assert rc == 0, (rc, text[-2000:])
    # it ends, and nothing in it claims a finished answer: a request the engine had not
    # started ends with [DONE] alone (vLLM's stream of an abort without output), one it had
    # started with a last chunk whose finish reason is "abort"
    data = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
    finishes = [c["finish_reason"] for d in data for c in d["choices"] if c["finish_reason"]]
    assert finishes in ([], ["abort"]), rest
    assert [x for x in rest if x][-1] == "data: [DONE]", rest


def engine_core_of(pid: int) -> int:
    """The pid of the engine-core process under server `pid` (vLLM names it EngineCore)."""
    import psutil

    cores = [c.pid for c in psutil.Process(pid).children(recursive=True)
             if "EngineCore" in " ".join([c.name(), *c.cmdline()])]
    assert len(cores) == 1, [(c.pid, c.name()) for c in psutil.Process(pid).children(True)]
    return cores[0]


def _drain(lines):
    """What is left of a stream: its lines until it ends, or nothing where the connection
    was cut."""
    try:
        yield from lines
    except httpx.HTTPError:
        return
