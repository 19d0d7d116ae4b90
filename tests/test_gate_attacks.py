"""No request and no store operation can stop the engine or give a request anything but its
own task's answer at its own steps (docs/task-store.md): the attacks that once did, each
through the real server, and a request fuzzer over every route.

The oracle is a probe model whose tasks cannot be mistaken for one another: residual
coordinate 0 of the tiny Llama is a constant (its embedding column is 0.5 and no layer writes
to it), so the final state's h_0 lies in [6, 8] for every prompt; each probe token's LM-head
row is −4·e_0, so the bare model gives it a logit near −27 (its best token: ~+14) and never
emits it; each task is a rank-1 logit-space vector U = 15·e_T, V = e_0, which adds ~+100 to
its own token T. So a task's answer is T at exactly its shifted steps and never another
task's token, whatever the sampling (temperature ≤ 2, penalties, top-k/p), and the bare
model's answer holds no probe token at all (`check_tokens`). `test_probe_margins` holds those
margins against transformers.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from test_server import HTTP, Shared, start_server, stop

from conftest import make_tokenizer, make_vllm_llama
from ltv_vllm.core.vector import TaskVector, model_identity
from ltv_vllm.core.vector_files import read_safetensors
from ltv_vllm.serving.contract.keys import OPERATOR_ROUTES
from ltv_vllm.serving.store.taskstore import TaskStore, vector_digest

pytestmark = pytest.mark.slow(seconds=490)  # see conftest's ordering

PROBES = {"alpha": 300, "beta": 301, "gamma": 302, "delta": 303}  # the token each task forces
SCALE = 15.0
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["Review: the plot is dull\nSentiment:", "News: leaders meet for peace talks\nType:",
           "Question: Who wrote Hamlet?\nAnswer Type:", "x"]
SECRET_WORDS = ("Traceback", 'File "', "/tmp/", "site-packages")


def probe_of(name: str) -> str:
    """The probe a task forces: its name up to a '-' (a test's own task names, such as
    gamma-free, force gamma's token)."""
    return name.partition("-")[0]


def probe_model(directory: Path):
    """The probe model (module docstring) saved with a chat template; (model, tokenizer)."""
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = make_vllm_llama(tok, seed=41, tie=False)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.5
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0
            layer.mlp.down_proj.weight[0, :] = 0
        for t in PROBES.values():
            model.lm_head.weight[t] = 0
            model.lm_head.weight[t, 0] = -4.0
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model, tok


def probe_vector(model, d: Path, name: str, steps: str | None, nonce: int = 0) -> TaskVector:
    vocab, hidden = model.lm_head.weight.shape
    U = torch.zeros(vocab, 1)
    U[PROBES[probe_of(name)], 0] = SCALE
    V = torch.zeros(hidden, 1)
    V[0, 0] = 1.0
    meta = {"task": {"name": name, "in_prefix": "Review", "label_prefix": "Sentiment",
                     "labels": ["negative", "positive"]}, "nonce": nonce}
    if steps is not None:
        meta["shift_steps"] = steps
    return TaskVector("logit", U, V, None, model_identity(model, str(d)),
                      (PROBES[probe_of(name)],), meta)


def save_with_steps(tv: TaskVector, path: Path, steps: str) -> Path:
    """`tv` as .safetensors whose header says meta.shift_steps = `steps` (any string: a
    TaskVector itself would refuse to be built with a bad one)."""
    from safetensors.torch import save_file

    tv.save(path)
    header_json, held = read_safetensors(path)
    header = json.loads(header_json)
    header["meta"]["shift_steps"] = steps
    save_file({k: t.contiguous() for k, t in held.items()}, str(path),
              metadata={"ltv_vllm": json.dumps(header)})
    return path


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe-model")
    model, tok = probe_model(d)
    return d, model, tok


def test_probe_margins(probe):
    """The oracle's premise, in transformers: over prompts and 12 greedy steps the bare
    model's best probe logit is ≥ 30 below its best token, and each task's shift puts its
    own token ≥ 50 above every other token (the bare model's best and the other probes)."""
    d, model, tok = probe
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=12, do_sample=False)
            out = model(seq, output_hidden_states=True)
        logits, h = out.logits[0], out.hidden_states[-1][0]
        probes = torch.tensor(list(PROBES.values()))
        bare_best = logits.max(-1).values
        assert (bare_best - logits[:, probes].max(-1).values).min() > 30
        for name, t in PROBES.items():
            shifted = logits + probe_vector(model, d, name, None).delta(h)
            others = torch.cat([shifted[:, :t], shifted[:, t + 1:]], -1).max(-1).values
            assert (shifted[:, t] - others).min() > 50, name


def test_a_stored_bad_field_is_quarantined_not_served(probe, tmp_path):
    """An entry whose vector says shift_steps "-1" (written before uploads checked it) once
    was served again after every restart, and killed the engine at its first request; `serve
    --dry-run` did not warn. Now the start-up check reads every field the engine parses:
    --dry-run names it ("would be moved"), and nothing is moved by a dry run."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main
    from ltv_vllm.serving.store.taskstore import VECTOR

    d, model, _ = probe
    store = TaskStore(tmp_path / "store")
    entry = store.add("alpha", probe_vector(model, d, "alpha", "all"), d)
    save_with_steps(entry.vector(), entry.path / VECTOR, "-1")
    r = CliRunner().invoke(main, ["serve", "--model", str(d), "--task-store", str(store.root),
                                  "--allow-unauthenticated", "--dry-run"])
    assert r.exit_code == 0, r.output
    warning = [line for line in r.output.splitlines() if "'alpha' is not served" in line]
    assert len(warning) == 1 and "shift_steps" in warning[0] and "would be moved" in \
        warning[0], r.output
    assert store.names() == ["alpha"]  # a dry run moves nothing


# -- the oracle ------------------------------------------------------------------------------
def check_tokens(tokens: list[int], task: str | None, steps: int | None, where: str) -> None:
    """A task's answer holds its probe token at exactly its first `steps` tokens (None: all)
    and no other probe token; the bare model's holds none."""
    for i, t in enumerate(tokens):
        shifted = task is not None and (steps is None or i < steps)
        want = PROBES[probe_of(task)] if shifted else None
        if want is not None:
            assert t == want, f"{where}: token {i} is {t}, not task {task}'s {want}: {tokens}"
        else:
            assert t not in PROBES.values(), f"{where}: token {i} is probe {t}: {tokens}"


def answer_tokens(r: httpx.Response, stream: bool) -> dict[int, list[int]]:
    """Each choice's generated token ids (the request asked for `return_token_ids`)."""
    out: dict[int, list[int]] = {}
    if not stream:
        for c in r.json()["choices"]:
            out[c["index"]] = list(c.get("token_ids") or [])
        return out
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:]).get("choices", []):
                out.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    return out


def response_model(r: httpx.Response, stream: bool) -> set:
    """The `model` every answer (every event of a stream) names."""
    if not stream:
        return {r.json().get("model")}
    return {json.loads(line[6:]).get("model") for line in r.text.splitlines()
            if line.startswith("data: {")}


def clean_error(r: httpx.Response, secrets: tuple[str, ...]) -> None:
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    for w in (*SECRET_WORDS, *secrets):
        assert w not in r.text, f"error names {w!r}: {r.text[:500]}"


class Server:
    """A live store server, its tasks and what each serves (task → default steps)."""

    def __init__(self, d: Path, tmp: Path, model, mode: str, runner: str | None = None):
        self.d, self.model, self.mode, self.runner = d, model, mode, runner
        self.store = TaskStore(tmp / "store")
        # alpha: a store entry at start (every step); beta: a command-line task (first)
        self.store.add("alpha", probe_vector(model, d, "alpha", "all"), d)
        beta = probe_vector(model, d, "beta", "first").save(tmp / "beta.pt")
        self.defaults: dict[str, int | None] = {"alpha": None, "beta": 1}
        # scale-out's token-in/token-out routes (/inference/v1/generate) carry raw
        # sampling params; responses may run in the background (stored): both reach the
        # engine past the routes the gate serves tasks on
        # --max-logprobs: a held stream's answer outgrows the socket buffers (`HeldStream`)
        self.args = ("--task-store", str(self.store.root), "--max-tasks", "3",
                     "--multi-task", mode, "--max-num-seqs", "2", "--enable-scale-out",
                     "--max-logprobs", str(HELD_LOGPROBS))
        self.beta, self.tmp, self.nonce = beta, tmp, 0
        self.shared: Shared | None = None
        self.start()

    def start(self) -> None:
        # DELETE answers after 1 s at most (202 while the task's requests run on)
        self.proc, self.url, self.log = start_server(
            self.d, [f"beta={self.beta}"], self.tmp, self.args,
            # VLLM_SERVER_DEV_MODE: vLLM's /pause and /resume (`paused_engine`)
            env_extra={"LTV_VLLM_DELETE_WAIT": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1",
                       "VLLM_SERVER_DEV_MODE": "1"},
            # V1 in vLLM's default layout (what users run); V2, through the shim, in-process
            runner=self.runner, layout="default" if self.runner is None else "inproc")
        self.watch()

    def watch(self) -> None:
        """The guard of this shared server (`test_server.Shared`): made at its first start;
        after a restart (an engine death the fuzzer reports) it follows the new address and
        still compares with what the first start served."""
        if self.shared is None:
            self.shared = Shared(self.url)
        else:
            self.shared.url = self.url

    def restart(self) -> None:
        """After an engine death (what the fuzzer reports): the store's tasks as served."""
        stop(self.proc, self.log)
        self.start()
        self.defaults = {"beta": 1, **{n: self.defaults.get(n, 1)
                                       for n in self.store.names()}}

    @property
    def base(self) -> str:
        return str(self.d)

    def steps(self, task: str | None, xargs: dict) -> int | None:
        if task is None:
            return 0
        if self.mode == "lora":
            return None
        from ltv_vllm.serving.contract.wire import parse_steps

        if "ltv_steps" not in xargs:
            return self.defaults[task]
        try:
            return parse_steps(xargs["ltv_steps"])
        except ValueError:
            raise AssertionError(f"ltv_steps {xargs['ltv_steps']!r} was accepted") from None

    def alive(self) -> None:
        assert self.is_alive(), "the server or its engine died"

    def is_alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            return HTTP.get(f"{self.url}/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def keys(self) -> tuple[str, ...]:
        """The store tasks' engine keys' digests: no answer may show one."""
        return tuple(vector_digest(e.vector_path) for e in self.store.entries())

    def upload(self, name: str, steps: str | None) -> httpx.Response:
        self.nonce += 1
        tv = probe_vector(self.model, self.d, name, "first", self.nonce)
        path = self.tmp / f"{name}-{self.nonce}.safetensors"
        if steps is None:
            tv.save(path)
        else:
            save_with_steps(tv, path, steps)
        r = HTTP.post(f"{self.url}/v1/ltv/tasks", data={"name": name},
                      files={"vector": (path.name, path.read_bytes())}, timeout=60)
        if r.status_code == 201:
            from ltv_vllm.serving.contract.wire import parse_steps

            try:
                self.defaults[name] = parse_steps(steps or "first")
            except ValueError:  # stored anyway: what the fuzzer reports
                self.defaults[name] = 1
        return r

    def delete(self, name: str) -> httpx.Response:
        r = HTTP.delete(f"{self.url}/v1/ltv/tasks/{name}", timeout=300)
        if r.status_code in (200, 202):
            self.defaults.pop(name, None)
        return r

    def raw_key(self, name: str) -> str:
        return f"{name}@{vector_digest(self.store.get(name).vector_path)}"


@pytest.fixture(scope="module", params=["shift", "lora", "shift-v2", "lora-v2"])
def shared_server(request, probe, tmp_path_factory):
    """A store server with per-request tasks ("shift") or LoRA adapters, on vLLM's V1
    runner; "-v2": the same on the V2 runner (`test_server.runner_test_env`)."""
    d, model, _ = probe
    mode, _, v2 = request.param.partition("-")
    srv = Server(d, tmp_path_factory.mktemp(f"gate-{request.param}"), model, mode,
                 runner="1" if v2 else None)
    try:
        yield srv
        srv.shared.close()
    finally:
        stop(srv.proc, srv.log)


@pytest.fixture
def server(shared_server, request):
    """`shared_server` for one test (`Shared.use`): a test's own task names go through
    `own_tasks`, which deletes whatever it leaves of them."""
    shared_server.shared.use(request)
    return shared_server


class FusedServer(Server):
    """A fused server: the probe task alpha's vector (every step) shifts every request; no
    store (so no raw key to name), the self-check's probes held beside it. `fold`: the
    vector folded into the LM head (`folded_probe`), where a request cannot set ltv_steps."""

    def __init__(self, d: Path, tmp: Path, model, fold: bool = False,  # noqa: D107
                 runner: str | None = None) -> None:
        self.mode = "folded" if fold else "fused"
        self.runner = runner
        self.model, self.tmp, self.nonce = model, tmp, 0
        self.store = TaskStore(tmp / "no-store")  # empty: nothing is named by key
        self.defaults = {"alpha": None}
        if fold:
            self.d, tv = folded_probe(model, tmp / "folded-model")
        else:
            self.d, tv = d, probe_vector(model, d, "alpha", "all")
        self.vector = tv.save(tmp / "alpha.pt")
        self.shared = None
        self.start()

    def start(self) -> None:
        fold = ("--fold",) if self.mode == "folded" else ()
        self.proc, self.url, self.log = start_server(
            self.d, [str(self.vector)], self.tmp,
            ("--max-num-seqs", "2", "--enable-scale-out", *fold),
            env_extra={"VLLM_ENABLE_RESPONSES_API_STORE": "1"}, runner=self.runner)
        self.watch()

    def steps(self, task: str | None, xargs: dict) -> int | None:
        if self.mode == "folded":  # the head itself is shifted: ltv_steps is refused
            assert "ltv_steps" not in xargs, f"ltv_steps {xargs['ltv_steps']!r} accepted"
            return None
        return super().steps(task, xargs)

    def restart(self) -> None:
        stop(self.proc, self.log)
        self.start()


def folded_probe(model, directory: Path) -> tuple[Path, TaskVector]:
    """The probe model with alpha's token the only LM-head row reading coordinate 0 (its
    −4·e_0; every other row's weight there zeroed), saved to `directory`, and a hidden-space
    vector a head can fold that lifts it: h ← h + U Vᵀ h with V = e_0, U = −25·e_0 turns the
    constant h_0 ∈ [6, 8] into −24·h_0, alpha's logit into 96·h_0 ≥ 576, and moves no other
    token. Its margin (≥ 50 over every other token, 12 greedy steps) is checked here in
    transformers, as `test_probe_margins` checks the others'."""
    import copy

    folded = copy.deepcopy(model)
    t = PROBES["alpha"]
    with torch.no_grad():
        col = folded.lm_head.weight[:, 0].clone()
        folded.lm_head.weight[:, 0] = 0
        folded.lm_head.weight[t, 0] = col[t]
    folded.save_pretrained(directory)
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    hidden = folded.lm_head.weight.shape[1]
    U, V = torch.zeros(hidden, 1), torch.zeros(hidden, 1)
    U[0, 0], V[0, 0] = -25.0, 1.0
    meta = {"task": {"name": "alpha", "in_prefix": "Review", "label_prefix": "Sentiment",
                     "labels": ["negative", "positive"]}, "shift_steps": "all"}
    tv = TaskVector("hidden", U, V, None, model_identity(folded, str(directory)), (t,), meta)
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            seq = folded.generate(ids, max_new_tokens=12, do_sample=False)
            h = folded(seq, output_hidden_states=True).hidden_states[-1][0]
            logits = folded.lm_head(h + tv.delta(h))
        others = torch.cat([logits[:, :t], logits[:, t + 1:]], -1).max(-1).values
        assert (logits[:, t] - others).min() > 50
    return directory, tv


@pytest.fixture(scope="module", params=["fused", "folded", "fused-v2", "folded-v2"])
def shared_fused_server(request, probe, tmp_path_factory):
    d, model, _ = probe
    mode, _, v2 = request.param.partition("-")
    srv = FusedServer(d, tmp_path_factory.mktemp(f"gate-{request.param}"), model,
                      fold=mode == "folded", runner="1" if v2 else None)
    try:
        yield srv
        srv.shared.close()
    finally:
        stop(srv.proc, srv.log)


@pytest.fixture
def fused_server(shared_fused_server, request):
    shared_fused_server.shared.use(request)
    return shared_fused_server


def post(srv: Server, path: str, body, headers: dict | None = None,
         content: bytes | None = None) -> httpx.Response:
    data = content if content is not None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    return HTTP.post(f"{srv.url}{path}", content=data, headers=h, timeout=120)


def completion(model: str | None, **kw) -> dict:
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "return_token_ids": True,
            **kw}
    if model is not None:
        body["model"] = model
    return body


def wait_for(condition, what: str, seconds: float = 120) -> None:
    """Poll `condition()` until it holds; `what` failed past the deadline."""
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.02)


def task_requests(srv: Server, name: str) -> float:
    """Requests for task `name` the API server has handed to its engine so far (the
    `ltv_vllm:task_requests` counter, counted as the request enters the engine client)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in HTTP.get(
        f"{srv.url}/metrics", timeout=60).text.splitlines()
        if line.startswith("ltv_vllm:task_requests_total{") and f'task="{name}"' in line)


@contextlib.contextmanager
def paused_engine(srv: Server):
    """The engine's scheduler paused with its requests kept (vLLM's `/pause?mode=keep`,
    VLLM_SERVER_DEV_MODE): a request handed to it meanwhile waits, unscheduled, until the
    scheduler resumes at the end of the block, however fast the CPU."""
    r = HTTP.post(f"{srv.url}/pause", params={"mode": "keep"}, timeout=60)
    assert r.status_code == 200, r.text
    try:
        yield
    finally:
        r = HTTP.post(f"{srv.url}/resume", timeout=60)
        assert r.status_code == 200, r.text


def engine_finished(srv: Server) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in HTTP.get(
        f"{srv.url}/metrics", timeout=60).text.splitlines()
        if line.startswith("vllm:request_success_total"))


@contextlib.contextmanager
def own_tasks(srv: Server, *names: str):
    """A test's own task names: whatever it leaves of them (a failure midway) is deleted
    after it (waited for while its requests drain), so no later test meets it."""
    try:
        yield
    finally:
        with contextlib.suppress(httpx.HTTPError):
            for name in names:
                deadline = time.time() + 60
                while HTTP.get(f"{srv.url}/v1/ltv/tasks/{name}", timeout=60).status_code \
                        != 404 and time.time() < deadline:
                    srv.delete(name)  # 202 while its requests run on: asked again
                    time.sleep(0.1)
                srv.defaults.pop(name, None)


HELD_LOGPROBS = 300  # top logprobs per token of a held stream: some 5 KB per event


class HeldStream:
    """A streamed completion the test holds in flight by construction: sent on a socket
    that takes little (a small receive buffer, 88-byte segments), read up to its first
    event, then left unread. Its answer (max_tokens events of HELD_LOGPROBS logprobs each:
    ~1 MB for 200 tokens) outgrows what the socket and the server's transport buffer (as
    measured here: an answer of 146 KB stayed in flight, one of 95 KB did not), so the
    server's `send` blocks and the gate counts the request in flight until `finish` reads
    the rest, however soon the engine is done generating it."""

    def __init__(self, srv: Server, body: dict) -> None:
        host, port = srv.url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 88)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        self.sock.settimeout(120)
        self.sock.connect((host, int(port)))
        data = json.dumps({**body, "stream": True, "logprobs": HELD_LOGPROBS}).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                          b"Connection: close\r\n\r\n%s" % (host.encode(), len(data), data))
        self.raw = b""

    def first_event(self) -> None:
        while b"\r\n\r\n" not in self.raw or b"data: " not in self.raw.partition(
                b"\r\n\r\n")[2]:
            chunk = self.sock.recv(1024)
            assert chunk, f"the stream ended before its first event: {self.raw[:300]!r}"
            self.raw += chunk

    def finish(self) -> httpx.Response:
        """The rest of the answer, read to its end, as a response."""
        while chunk := self.sock.recv(1 << 16):
            self.raw += chunk
        self.close()
        head, _, body = self.raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            out = b""
            while body:
                size, _, body = body.partition(b"\r\n")
                n = int(size.split(b";")[0], 16)
                if n == 0:
                    break
                out, body = out + body[:n], body[n + 2:]
            body = out
        return httpx.Response(status, content=body)

    def close(self) -> None:
        self.sock.close()


# -- the attacks, one by one -----------------------------------------------------------------
def test_beam_search_is_refused_for_a_task(server):
    """Beam search once answered a task's request with the bare model's beams under the
    task's name (vLLM runs each beam step as a new request without vllm_xargs). Now: 400 for
    a task on every route it can name one; the bare model's beam search is served; a LoRA
    adapter's beams carry its shift (vLLM hands every beam step the adapter)."""
    srv = server
    beam = {"use_beam_search": True, "n": 2}
    if srv.mode == "shift":
        for path, body, headers in [
                ("/v1/completions", completion("beta", **beam), None),
                ("/v1/completions", completion(srv.base, vllm_xargs={"ltv_task": "alpha"},
                                               **beam), None),
                ("/v1/completions", completion("alpha", use_beam_search="true", n=2), None),
                ("/v1/chat/completions", {"model": "beta", "messages": [
                    {"role": "user", "content": "hi"}], "vllm_xargs": {"ltv_chat": "allow"},
                    "max_tokens": 3, **beam}, None),
                ("/invocations", completion(None, **beam), {
                    "X-Amzn-SageMaker-Adapter-Identifier": "beta"})]:
            r = post(srv, path, body, headers)
            assert r.status_code == 400 and "beam search" in r.json()["error"]["message"], \
                (path, r.text)
        r = post(srv, "/v1/completions", completion(srv.base, **beam))
        assert r.status_code == 200, r.text
        for toks in answer_tokens(r, False).values():
            check_tokens(toks, None, 0, "bare beams")
    else:
        # the best beam is the adapter's answer; the second must differ from it somewhere,
        # so it holds one token the shift makes unlikely
        r = post(srv, "/v1/completions", completion("beta", **beam))
        assert r.status_code == 200, r.text
        best, second = answer_tokens(r, False)[0], answer_tokens(r, False)[1]
        check_tokens(best, "beta", None, "adapter's best beam")
        assert sum(t != PROBES["beta"] for t in second) == 1, second
    srv.alive()


def test_bad_stored_fields_are_refused_at_upload(server):
    """A vector whose meta.shift_steps is not a policy was stored (201) and killed the engine
    at its first request, again after every restart. Now every field the engine parses is
    checked at upload: 422, nothing stored; a Gram matrix that cannot be cut is a 422, not
    torch's Cholesky message in a 500; a layer task, on a server started without
    --layer-uploads (its engine has no layer hooks), is a 422 in one line."""
    srv, name = server, "gamma-fields"
    with own_tasks(srv, name):
        for steps in ("bogus", "-1", "١", "true"):
            r = srv.upload(name, steps)
            assert r.status_code == 422 and "shift_steps" in r.json()["error"]["message"], r.text
            clean_error(r, srv.keys())
        # a file that is not a vector: the message names "the upload", not its staging path
        r = HTTP.post(f"{srv.url}/v1/ltv/tasks", data={"name": name},
                      files={"vector": ("x.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}")},
                      timeout=60)
        assert r.status_code == 422 and ".up-" not in r.text and "<task store>" not in r.text, \
            r.text
        assert name not in srv.store.names()
        # rank 300 (> the served 256) with a gram that is not positive definite
        tv = probe_vector(srv.model, srv.d, name, "first")
        g = torch.Generator().manual_seed(0)
        big = TaskVector("logit", torch.randn(tv.U.shape[0], 300, generator=g) * 1e-3,
                         torch.randn(tv.V.shape[0], 300, generator=g), None, tv.model,
                         tv.label_token_ids, tv.provenance, gram=-torch.eye(300))
        path = big.save(srv.tmp / "badgram.safetensors")
        r = HTTP.post(f"{srv.url}/v1/ltv/tasks", data={"name": name},
                      files={"vector": (path.name, path.read_bytes())}, timeout=60)
        assert r.status_code == 422 and "gram" in r.json()["error"]["message"], r.text
        # a layer task (it acts inside the decoder): this server has no layer hooks
        from ltv_vllm.core.layer_task import LayerTask

        lt = LayerTask(layers=(0,), bias=torch.ones(1, tv.V.shape[0]), U=None, V=None,
                       model=tv.model)
        path = lt.save(srv.tmp / "layer.safetensors")
        r = HTTP.post(f"{srv.url}/v1/ltv/tasks", data={"name": name},
                      files={"vector": (path.name, path.read_bytes())}, timeout=60)
        assert r.status_code == 422 and "--layer-uploads" in r.json()["error"]["message"], r.text
        assert "\n" not in r.json()["error"]["message"] and name not in srv.store.names()
        r = srv.upload(name, "2")
        assert r.status_code == 201, r.text
        r = post(srv, "/v1/completions", completion(name, max_tokens=5))
        assert r.status_code == 200, r.text
        check_tokens(answer_tokens(r, False)[0], name, srv.steps(name, {}), name)
        assert srv.delete(name).status_code == 200
        srv.alive()


def test_delete_waits_for_queued_requests(server):
    """DELETE once removed files a queued request still needed, and the engine died loading
    them: (a) a request naming the raw engine key was not counted, so DELETE returned at
    once; (b) a drain deadline deleted anyway. Now the raw key is refused (400; no error
    lists one), and a DELETE of a task whose requests wait in the engine — named by
    `model`, or by `vllm_xargs.ltv_task` beside the base model — never removes what they
    load before they are done: each is answered with the task's shift, on a task its engine
    has not loaded yet (their first use). The requests are held queued by construction: the
    engine's scheduler is paused (vLLM's `/pause?mode=keep`, a dev route) from before they
    are sent until after the DELETE's effects are checked, so none can be answered before
    the DELETE (asserted). Per-request tasks: the DELETE answers at once and the pin goes
    after them; LoRA: it answers after its wait (1 s on this server) with 202 "deleting"
    and the files go after them."""
    srv, name = server, "delta-queued"
    for queued in (["raw"], ["named", "named"], ["xargs", "xargs"]):
        if srv.mode == "lora" and queued != ["named", "named"]:
            continue  # an engine key or an ltv_task is no LoRA task's name (refused)
        with own_tasks(srv, name):
            assert srv.upload(name, None).status_code == 201
            key = srv.raw_key(name)
            pin = srv.store.root / ".pins" / f"{key}.safetensors"
            steps = srv.steps(name, {})
            bodies = [completion(name, max_tokens=3, prompt=PROMPTS[i]) if q == "named" else
                      completion(srv.base, max_tokens=3, prompt=PROMPTS[i],
                                 vllm_xargs={"ltv_task": name}) if q == "xargs" else
                      completion(srv.base, max_tokens=3, vllm_xargs={"ltv_task": key})
                      for i, q in enumerate(queued)]
            held = [i for i, q in enumerate(queued) if q != "raw"]  # the raw key's: refused
            refused = [i for i, q in enumerate(queued) if q == "raw"]
            results: dict[int, httpx.Response] = {}

            def send(i: int, body: dict, results: dict = results) -> None:
                results[i] = post(srv, "/v1/completions", body)

            handed = task_requests(srv, name)
            threads = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate(bodies)]
            with paused_engine(srv):
                for t in threads:
                    t.start()
                # each held request handed to the engine (where it waits: nothing is
                # scheduled), each refused one answered
                wait_for(lambda handed=handed, held=held, refused=refused, results=results:
                         task_requests(srv, name) >= handed + len(held)
                         and all(i in results for i in refused),
                         "the task's requests never reached the engine")
                r = srv.delete(name)
                if srv.mode == "lora":  # its requests cannot end: the DELETE's wait runs out
                    assert r.status_code == 202 and r.json()["status"] == "deleting", r.text
                    view = HTTP.get(f"{srv.url}/v1/ltv/tasks/{name}").json()
                    assert view["status"] == "deleting" and view["in_flight"] == len(held), \
                        view
                    assert name in srv.store.names(), "the files went before the requests"
                else:  # the name goes at once, the pin stays for the requests queued
                    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
                    assert HTTP.get(f"{srv.url}/v1/ltv/tasks/{name}").status_code == 404
                    assert pin.exists() or not held, "the pin went before the requests"
                assert not [i for i in held if i in results], \
                    "a request was answered while the engine was paused"
            for t in threads:
                t.join(120)
            for i, q in enumerate(queued):
                if q == "raw":
                    assert results[i].status_code == 400, results[i].text
                    clean_error(results[i], srv.keys())
                else:
                    assert results[i].status_code == 200, results[i].text
                    check_tokens(answer_tokens(results[i], False)[0], name, steps, f"q{i}")
            deadline = time.time() + 60
            while HTTP.get(f"{srv.url}/v1/ltv/tasks/{name}").status_code != 404 or \
                    pin.exists():
                assert time.time() < deadline, "the deleted task's files were never removed"
                time.sleep(0.1)
            assert name not in srv.store.names()
            srv.alive()


def test_routes_that_bypassed_the_gate(server):
    """/invocations (chat or completion, SageMaker's adapter header), the batch chat route,
    liveness probes with bodies, bodies without a content type, odd ltv_steps spellings,
    unknown models beside a store task, a content type in capitals: each once bypassed a
    check or killed the engine. Now each is refused or served right."""
    srv = server
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0, "return_token_ids": True}
    # the chat opt-in on every chat route: batch chat, /invocations with messages, header
    refusals = [("/v1/chat/completions/batch", {**chat, "model": srv.base, "messages": [
                    chat["messages"]], "vllm_xargs": {"ltv_task": "beta"}}, None),
                ("/invocations", {**chat, "model": "beta"}, None),
                ("/invocations", {**chat}, {"X-Amzn-SageMaker-Adapter-Identifier": "beta"}),
                ("/v1/completions", completion("beta", vllm_xargs={"ltv_steps": True}), None),
                ("/v1/completions", completion("beta", vllm_xargs={"ltv_steps": "١"}), None),
                ("/v1/completions", completion("beta", vllm_xargs={"ltv_steps": "２"}), None),
                # past what Python's int() and vLLM's int64 take: our one line, not theirs
                ("/v1/completions", completion("beta", vllm_xargs={"ltv_steps": "9" * 4301}),
                 None),
                ("/v1/completions", completion("beta", vllm_xargs={"ltv_steps": 2 ** 64}), None),
                # the start-up self-check's probes are the engine's, never a client's
                ("/v1/completions", completion(srv.base, vllm_xargs={
                    "ltv_task": "@selfcheck-first"}), None)]
    if srv.mode == "lora":
        refusals = refusals[1:3] + refusals[-1:] + [
            ("/invocations", completion("beta", prompt_logprobs=1), None),
            ("/invocations", completion(srv.base, echo=True, logprobs=1), None),
            ("/v1/completions", completion(srv.base, prompt_logprobs=0), None)]
    else:
        refusals += [("/v1/completions", completion("nope", vllm_xargs={"ltv_task": "alpha"}),
                      None)]
    for path, body, headers in refusals:
        r = post(srv, path, body, headers)
        assert r.status_code == 400, (path, body, r.text)
        clean_error(r, srv.keys())
        steps = (body.get("vllm_xargs") or {}).get("ltv_steps")
        if isinstance(steps, int) and not isinstance(steps, bool) or (
                isinstance(steps, str) and len(steps) > 100):
            assert "ltv_steps must be 'all', 'first' or a count" in r.text and \
                len(r.text) < 600, r.text
    # the same requests without a content type (FastAPI reads such a body as JSON)
    r = HTTP.post(f"{srv.url}/v1/completions", content=json.dumps(completion(
        "beta", use_beam_search=True, n=2)).encode(), timeout=60)
    assert r.status_code in (400, 415) if srv.mode == "shift" else r.status_code != 500, r.text
    # /invocations served: the task from the body or from the header, named in the answer
    for body, headers in [(completion("beta"), None),
                          (completion(srv.base), {"X-Amzn-SageMaker-Adapter-Identifier":
                                                  "beta"}),
                          ({**chat, "model": "beta", "vllm_xargs": {"ltv_chat": "allow"}},
                           None)]:
        r = post(srv, "/invocations", body, headers)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "beta", r.text
        check_tokens(answer_tokens(r, False)[0], "beta", srv.steps("beta", {}), "invocations")
    # a liveness probe reads no more than 1 KiB of body, key or not
    r = HTTP.post(f"{srv.url}/ping", content=b"x" * (64 << 10), timeout=60)
    assert r.status_code == 413, r.text
    assert HTTP.post(f"{srv.url}/ping", timeout=60).status_code == 200
    # a content type in capitals is still a compile request (400 for its content, not 415)
    log = Path(srv.log.name)
    compile_line = b'"POST /v1/ltv/tasks HTTP/1.1" 400'
    compiles = log.read_bytes().count(compile_line)
    r = HTTP.post(f"{srv.url}/v1/ltv/tasks", content=b'{"name": "x"}',
                  headers={"Content-Type": "APPLICATION/JSON"}, timeout=60)
    assert r.status_code == 400, r.text
    # a body vLLM's own validator refuses (stream_options without stream) once got the
    # gate's "could not be read" and a traceback in the log per request: now vLLM's own
    # 400 and message, and no more than the request's access line in the log
    # the access line of the request above may reach the log after its answer: wait for it,
    # so that only the two requests below are counted
    wait_for(lambda: log.read_bytes().count(compile_line) > compiles,
             "the compile request's access line was never logged")
    start = log.stat().st_size
    for path in ("/v1/completions", "/invocations"):
        r = post(srv, path, completion(srv.base, stream_options={"include_usage": True}))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "stream_options" and err[
            "message"].startswith("Stream options can only be defined when `stream=True`"), \
            r.text
    wait_for(lambda: b'"POST /invocations HTTP/1.1" 400' in log.read_bytes()[start:],
             "the request's access line was never logged")
    logged = log.read_bytes()[start:].decode("utf-8", "replace").splitlines()
    assert not [x for x in logged if "Traceback" in x or 'File "' in x or "ltv-vllm gate" in x], \
        "\n".join(logged)
    assert len([x for x in logged if "POST /" in x]) == 2, "\n".join(logged)
    srv.alive()


def test_routes_the_gate_does_not_serve_tasks_on_cannot_shift(server):
    """Requests that reached the engine past the gate: scale-out's /inference/v1/generate
    with `sampling_params.extra_args` naming the self-check's probe (answered with its
    vector) or a store task's raw key (its queued request then outlived a DELETE: engine
    dead), E3; a background response for a LoRA task, which outlived the gate's count (E2);
    /generative_scoring for a LoRA task (W3). Now the engine shifts only what the gate
    admitted (its stamp, checked where vLLM admits every request of every route), and in
    LoRA mode a task is served on the proven routes only: each is a 4xx, a forged stamp
    too, and the bare model is still served on those routes."""
    srv = server
    ids = HTTP.post(f"{srv.url}/tokenize", json={"model": srv.base, "prompt": PROMPTS[2]},
                    timeout=60).json()["tokens"]

    def generate(model: str, extra: dict | None) -> dict:
        params = {"max_tokens": 3, "temperature": 0, **({"extra_args": extra} if extra
                                                          else {})}
        return {"token_ids": ids, "model": model, "sampling_params": params}

    refused = [("/v1/completions", completion(srv.base, vllm_xargs={"ltv_admit": "0" * 32})),
               ("/v1/completions", completion("beta", vllm_xargs={"ltv_admit": "0" * 32})),
               # live fidelity's readout: the server's own on the gate's routes, and checked
               # where vLLM admits a request of any route
               ("/v1/completions", completion("beta", vllm_xargs={"ltv_readout": [5, 6]})),
               ("/inference/v1/generate", generate(srv.base, {"ltv_readout": [5, 5]})),
               ("/inference/v1/generate", generate(srv.base, {"ltv_readout": "5"})),
               ("/v1/responses", {"model": "beta", "input": PROMPTS[0], "background": True,
                                  "max_output_tokens": 3}),
               ("/v1/responses", {"model": "alpha", "input": PROMPTS[0], "background": True,
                                  "max_output_tokens": 3}),
               ("/generative_scoring", {"model": "beta", "query": PROMPTS[0],
                                        "items": [" good"], "label_token_ids": [5, 6]})]
    if srv.mode == "shift":
        refused += [("/inference/v1/generate", generate(srv.base, x)) for x in (
            {"ltv_task": "@selfcheck-all"}, {"ltv_task": srv.raw_key("alpha")},
            {"ltv_task": "beta"}, {"ltv_task": "beta", "ltv_admit": "0" * 32},
            {"ltv_task": "beta", "ltv_steps": 0})]
    else:
        refused += [("/inference/v1/generate", generate("beta", None))]
    for path, body in refused:
        r = post(srv, path, body)
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text[:300])
        clean_error(r, srv.keys())
        srv.alive()
    # a background response naming a task in vllm_xargs: a LoRA server once answered it 200
    # "queued" and refused it in the background (then "queued" forever); now a 400 here
    r = post(srv, "/v1/responses", {"model": srv.base, "input": PROMPTS[0], "background": True,
                                    "max_output_tokens": 3, "vllm_xargs": {"ltv_task": "beta"}})
    assert r.status_code == 400 and "\n" not in r.json()["error"]["message"], r.text
    # the bare model on those routes: served, with no task's token
    r = post(srv, "/inference/v1/generate", generate(srv.base, None))
    assert r.status_code == 200, r.text
    toks = [t for c in r.json()["choices"] for t in c["token_ids"]]
    check_tokens(toks, None, 0, "bare generate")
    r = post(srv, "/generative_scoring", {"model": srv.base, "query": PROMPTS[0],
                                          "items": [" good"], "label_token_ids": [5, 6]})
    assert r.status_code == 200, r.text
    srv.alive()


def test_a_second_server_on_a_held_store_refuses_to_start(server, tmp_path):
    """Two servers on one store once killed each other's engines: a DELETE on one removed
    files the other's engine loaded next, and the second's start swept the first's compiles
    and quarantined entries under it (E1). Now the store is locked by the server that holds
    it: a second `serve` on it exits non-zero in one line before it touches anything (its
    dry run warns), and the first serves on."""
    import subprocess
    import sys

    srv = server
    before = sorted(p.name for p in srv.store.root.iterdir())
    cmd = [sys.executable, "-m", "ltv_vllm.cli", "serve", "--model", str(srv.d),
           "--task-store", str(srv.store.root), "--port", "1", "--dtype", "float32",
           "--allow-unauthenticated"]
    env = {**__import__("os").environ, "LTV_VLLM_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if "served by another running server" in x]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    # the refusal alone: not vLLM's command line (the store's path in it) before it
    assert [x for x in r.stderr.splitlines() if str(srv.store.root) in x] == lines, \
        r.stderr[-2000:]
    assert sorted(p.name for p in srv.store.root.iterdir()) == before
    r = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0 and "this server would refuse to start" in r.stderr, r.stderr
    srv.alive()
    r = post(srv, "/v1/completions", completion("alpha"))
    assert r.status_code == 200, r.text
    check_tokens(answer_tokens(r, False)[0], "alpha", srv.steps("alpha", {}), "alpha")


def test_a_delete_frees_the_name_at_once(server):
    """A client that held a stream for a task held its DELETE (202 "deleting") and its name
    (409 on a new upload) for as long as it kept the request open (R1). Now, with per-request
    tasks, a DELETE removes the entry at once (200, the name free: a new upload of it is a
    201 while the old requests run on), the requests admitted before finish on the vector
    they started with (its pin), and the pin goes when they are done. LoRA mode keeps the
    name until its requests are done (vLLM's adapters are by name): 202 "deleting", 409 on
    a new upload meanwhile, then free. The four streams are held in flight by the test
    (`HeldStream`), not by their length: the engine has generated them all before the
    DELETE's effects are checked, and the gate still counts them."""
    srv, name = server, "gamma-free"
    with own_tasks(srv, name):
        assert srv.upload(name, "all").status_code == 201
        old_key = srv.raw_key(name)
        finished = engine_finished(srv)
        long = completion(name, max_tokens=200, ignore_eos=True)
        # two running, two queued behind them (--max-num-seqs 2): each read to its first
        # event, so each was admitted and started on the vector uploaded above
        streams = [HeldStream(srv, long) for _ in range(4)]
        try:
            for h in streams:
                h.first_event()
            wait_for(lambda: engine_finished(srv) >= finished + 4,
                     "the engine did not finish the held streams")
            t0 = time.time()
            r = srv.delete(name)
            if srv.mode == "shift":
                assert r.status_code == 200 and r.json()["deleted"] is True, r.text
                assert time.time() - t0 < 5
                assert HTTP.get(f"{srv.url}/v1/ltv/tasks/{name}").status_code == 404
                # the held requests keep the old key's pin (the gate counts them)
                pins = srv.store.root / ".pins"
                assert (pins / f"{old_key}.safetensors").exists()
                assert srv.upload(name, "first").status_code == 201  # the name, free at once
                assert srv.raw_key(name) != old_key
                r = post(srv, "/v1/completions", completion(name, max_tokens=4))
                check_tokens(answer_tokens(r, False)[0], name, 1, "the new task")
                assert (pins / f"{old_key}.safetensors").exists()
            else:  # LoRA: its requests are in flight (held), so the DELETE waits past 1 s
                assert r.status_code == 202 and r.json()["status"] == "deleting", r.text
                view = HTTP.get(f"{srv.url}/v1/ltv/tasks/{name}").json()
                assert view["status"] == "deleting" and view["in_flight"] == 4, view
                assert srv.upload(name, "first").status_code == 409
            results = [h.finish() for h in streams]
        finally:
            for h in streams:
                h.close()
        for i, r in enumerate(results):  # each on the vector it started with: every step
            assert r.status_code == 200, r.text
            check_tokens(answer_tokens(r, True)[0], name, None, f"old task, stream {i}")
        deadline = time.time() + 60
        if srv.mode == "shift":
            while (pins / f"{old_key}.safetensors").exists():
                assert time.time() < deadline, "the deleted key's pin was never removed"
                time.sleep(0.1)
            assert (pins / f"{srv.raw_key(name)}.safetensors").is_file()
        else:
            while HTTP.get(f"{srv.url}/v1/ltv/tasks/{name}").status_code != 404:
                assert time.time() < deadline, "the deleted task's files were never removed"
                time.sleep(0.1)
            assert srv.upload(name, "first").status_code == 201
        assert srv.delete(name).status_code == 200
        srv.alive()


def test_listing_survives_concurrent_deletes(server):
    """GET /v1/ltv/tasks once failed (500) when a DELETE renamed an entry away between the
    listing and its read. Listing in a tight loop through 6 add/delete cycles: always 200."""
    srv, name = server, "gamma-list"
    stop_at = threading.Event()
    codes: list[int] = []

    def lister() -> None:
        while not stop_at.is_set():
            codes.append(HTTP.get(f"{srv.url}/v1/ltv/tasks", timeout=60).status_code)

    t = threading.Thread(target=lister)
    with own_tasks(srv, name):
        t.start()
        try:
            for _ in range(6):
                assert srv.upload(name, None).status_code == 201
                assert srv.delete(name).status_code == 200
        finally:
            stop_at.set()
            t.join(60)
    assert codes and set(codes) == {200}, sorted(set(codes))
    srv.alive()


# -- the fuzzer ------------------------------------------------------------------------------
ROUTES = ["/v1/completions", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions",
          "/invocations", "/invocations", "/v1/chat/completions/batch", "/v1/responses",
          "/v1/messages", "/tokenize", "/detokenize", "/v1/completions/",
          "/inference/v1/generate", "/generative_scoring"]
STEP_VALUES = ["first", "all", 0, 1, 2, "3", True, False, "١", "２", -1, 1.5, "x", "00",
               "9" * 30, 2 ** 64]
# routes that generate nothing: any 200 is right (render routes only render a prompt)
NO_GENERATION = ("/ping", "/health", "/tokenize", "/detokenize", "/inference/v1/abort_requests")
# on the V2 runner here (Triton's interpreter, test scaffolding) vLLM's own top-k/top-p
# kernel fails in the interpreter ('int' object has no attribute 'to') and stops the engine
# with or without ltv-vllm: top_k is not fuzzed there (a GPU compiles it). Structured
# outputs are (their bitmask kernel runs once the shim reads its mask as compiled Triton)
INTERPRETER_CANNOT = ("top_k",)
# operator routes of the live server that change it for every request (never fuzzed)
# the store's own route (fuzzed by its own bodies) and vLLM's operator routes but scale-out's
# abort by id: the dev-mode routes the store server has (`paused_engine`) would pause, sleep
# or reset its engine under the fuzzer
NOT_FUZZED = ({"/v1/ltv/tasks"} | OPERATOR_ROUTES) - {"/inference/v1/abort_requests"}
# vLLM's lax booleans (pydantic): what the gate must read as vLLM does
LAX_TRUE, LAX_FALSE = [True, "true", 1, "yes", "on", "t", "1"], [False, 0, "no", "off", "f", 0.0]


def live_routes(srv: Server) -> list[str]:
    """Every POST route the live server's /openapi.json lists (scale-out's, hidden ones and
    whatever a vLLM upgrade adds), but its operator routes."""
    spec = HTTP.get(f"{srv.url}/openapi.json", timeout=60).json()
    return sorted(p for p, ops in spec["paths"].items()
                  if "post" in ops and "{" not in p and p not in NOT_FUZZED)


def fuzz_body(rng: random.Random, srv: Server, route: str) -> tuple[dict, dict]:
    """One random request body for `route`, and its headers."""
    names = [srv.base, "alpha", "beta", "nope", None, ["alpha"], 7, *srv.defaults]
    body: dict = {}
    if (model := rng.choice(names)) is not None:
        body["model"] = model
    xargs: dict = {}
    if rng.random() < 0.4:
        xargs["ltv_task"] = rng.choice(["alpha", "beta", "nope", 5,
                                        *(srv.raw_key(n) for n in srv.store.names())])
    if rng.random() < 0.4:
        xargs["ltv_steps"] = rng.choice(STEP_VALUES)
    if rng.random() < 0.3:
        xargs["ltv_chat"] = rng.choice(["allow", "allow", "no"])
    if rng.random() < 0.1:  # a layer task's asks, on servers that hold none: always a 400
        key = rng.choice(["ltv_scale", "ltv_mix", "ltv_layer"])  # (the last the gate's own)
        xargs[key] = rng.choice([2.0, 0, -1, "1", [1], "alpha=1", "beta=0.5,alpha=1", "",
                                 "add", "map"])
    if xargs or rng.random() < 0.1:
        body["vllm_xargs"] = xargs
    chat = route in ("/v1/chat/completions", "/v1/chat/completions/batch") or (
        route == "/invocations" and rng.random() < 0.5)
    msgs = [{"role": "user", "content": rng.choice(PROMPTS)}]
    if route == "/v1/chat/completions/batch":
        body["messages"] = [msgs, msgs]
    elif route == "/v1/responses":
        body["input"] = rng.choice(PROMPTS)
    elif route == "/v1/messages":
        body["messages"], body["max_tokens"] = msgs, 3
    elif route in ("/tokenize", "/detokenize"):
        body.update({"prompt": rng.choice(PROMPTS)} if route == "/tokenize"
                    else {"tokens": [5, 6, 7]})
    elif route == "/inference/v1/generate" or route not in ROUTES:
        # raw sampling params: extra_args is the engine's own view of vllm_xargs; any other
        # live route gets every shape at once (each takes what its model knows)
        body.update({"token_ids": [5, 6, 7, 8], "sampling_params": {
            "max_tokens": rng.randint(1, 4), "temperature": 0,
            **({"extra_args": xargs} if xargs else {})}, "prompt": rng.choice(PROMPTS),
            "messages": msgs, "input": rng.choice(PROMPTS)})
        if rng.random() < 0.5:
            body["background"] = True
    elif route == "/generative_scoring":
        body.update({"query": rng.choice(PROMPTS), "items": [" good", " bad"],
                     "label_token_ids": [5, 6]})
    elif chat:
        body["messages"] = rng.choice([msgs, msgs, msgs, "x", [{"role": 5, "content": "x"}]]) \
            if route == "/invocations" else msgs
        if route == "/invocations" and body["messages"] is not msgs:
            body["prompt"] = rng.choice(PROMPTS)  # vLLM serves it as a completion
        if rng.random() < 0.15:
            body["add_generation_prompt"] = rng.choice(LAX_TRUE + LAX_FALSE)
    else:
        body["prompt"] = rng.choice([rng.choice(PROMPTS), PROMPTS[:2]])
    if route == "/v1/responses" and rng.random() < 0.5:
        body["background"] = True  # outlives the HTTP request (the response store is on)
    if route not in ("/tokenize", "/detokenize", "/v1/messages", "/inference/v1/generate",
                     "/generative_scoring") and route in ROUTES:
        body.update({"max_tokens": rng.randint(1, 6), "return_token_ids": True})
        for key, values in [("n", [1, 2, 3]), ("temperature", [0, 0.7, 2.0]),
                            ("use_beam_search", LAX_TRUE + LAX_FALSE),
                            ("logprobs", [0, 2]), ("prompt_logprobs", [0, 1]),
                            ("echo", [True, "yes", 1, "off"]), ("stop", [["\n"]]),
                            ("stream", [True]),
                            ("top_k", [5]), ("repetition_penalty", [1.5]), ("seed", [7]),
                            ("structured_outputs", [{"choice": ["negative", "positive"]}])]:
            if rng.random() < 0.15 and not (getattr(srv, "runner", None) == "1" and key in
                                              INTERPRETER_CANNOT):
                body[key] = rng.choice(values)
        if body.get("logprobs") is not None and chat:
            body["logprobs"], body["top_logprobs"] = True, 2
    headers = {}
    if route == "/invocations" and rng.random() < 0.3:
        headers["X-Amzn-SageMaker-Adapter-Identifier"] = rng.choice(["alpha", "beta",
                                                                     srv.base, "nope"])
    if rng.random() < 0.1:
        headers["Content-Type"] = rng.choice(["APPLICATION/JSON", "application/json; x=1"])
    return body, headers


def intended(srv: Server, route: str, body: dict, headers: dict) -> tuple[str | None, dict]:
    """The task a request names (by `model`, SageMaker's header, or vllm_xargs.ltv_task) and
    its vllm_xargs; None: the bare model."""
    model = headers.get("X-Amzn-SageMaker-Adapter-Identifier", body.get("model")) \
        if route == "/invocations" else body.get("model")
    xargs = body.get("vllm_xargs") if isinstance(body.get("vllm_xargs"), dict) else {}
    if srv.mode in ("fused", "folded"):  # one vector shifts every request it answers
        return "alpha", xargs
    # LoRA mode: a task is the adapter `model` names (the engine refuses an ltv_task)
    named = xargs.get("ltv_task") if srv.mode == "shift" else None
    if isinstance(named, str) and "@" in named:
        named = named.partition("@")[0]
    if isinstance(model, str) and model in srv.defaults:
        return model, xargs
    return (named if named in srv.defaults else None), xargs


def check_answer(srv: Server, route: str, body: dict, headers: dict, r: httpx.Response) -> None:
    """A request's answer against the invariant (module docstring and docs/task-store.md)."""
    where = f"{route} {json.dumps(body)} {headers}"
    if r.status_code != 200:
        clean_error(r, srv.keys())
        return
    task, xargs = intended(srv, route, body, headers)
    served_as = route.rstrip("/")
    chat_body = isinstance(body.get("messages"), list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in body["messages"])
    if served_as == "/invocations":  # as vLLM tries its request types: chat, then completion
        served_as = "/v1/chat/completions" if chat_body else "/v1/completions"
    if served_as in NO_GENERATION or served_as.endswith(("/render", "/derender",
                                                         "/count_tokens")):
        return  # nothing generated: a 200 shows no shift (a liveness probe ignores the body)
    stream = bool(body.get("stream"))
    if stream and '"error"' in r.text:  # vLLM refuses some requests inside the stream
        clean_error(r, srv.keys())
        return
    if served_as == "/inference/v1/generate":
        # no task on this route (nor its raw extra_args): the bare model's tokens only, and
        # on a fused server (whose every answer is shifted) no answer at all
        assert srv.mode not in ("fused", "folded"), \
            f"{where}: answered past the gate on a fused server"
        toks = [t for c in r.json().get("choices", []) for t in c.get("token_ids") or []]
        check_tokens(toks, None, 0, where)
        return
    # a task is served on the proven routes only (per-request tasks ride on vllm_xargs, a
    # LoRA adapter on `model`): anywhere else it is a 400
    assert served_as in ("/v1/completions", "/v1/chat/completions") or task is None, \
        f"{where}: a task answered on a route that cannot carry it"
    if task is not None and chat_body and srv.mode in ("shift", "fused", "folded") and \
            served_as != "/v1/completions":
        assert xargs.get("ltv_chat") == "allow" or srv.steps(task, xargs) == 0, \
            f"{where}: a task's chat answered without consent"
    if task is not None and srv.mode == "lora" and chat_body and served_as != \
            "/v1/completions":
        assert xargs.get("ltv_chat") == "allow", f"{where}: chat without consent"
    if served_as not in ("/v1/completions", "/v1/chat/completions"):
        return
    layer_ask = sorted({"ltv_scale", "ltv_mix", "ltv_layer"} & set(xargs))
    assert not layer_ask, f"{where}: {layer_ask} answered by a server without layer tasks"
    shown = response_model(r, stream)
    want = task if task is not None else None
    if srv.mode == "shift":
        assert shown == {want or srv.base}, f"{where}: answered as {shown!r}\n{r.text}"
    if "structured_outputs" in body:
        return  # constrained to the labels: no probe token can be chosen
    steps = srv.steps(task, xargs)
    answers = answer_tokens(r, stream)
    if not _false_word(body.get("use_beam_search")):
        # the best beam only: the others must differ from it, so they hold a token the
        # shift makes unlikely (still beam search's right answer)
        answers = {0: answers[0]} if isinstance(body.get("prompt"), str) or "messages" in \
            body else {}
    for i, toks in answers.items():
        check_tokens(toks, task, steps, f"{where} choice {i}")


def _false_word(v) -> bool:
    return v is None or v in LAX_FALSE or v in ("0", "n", "false")


def test_request_fuzzer(server):
    """300 generated request bodies (every route above and every POST route the live
    server's /openapi.json lists — scale-out's /inference/v1/generate with raw extra_args,
    /generative_scoring, background responses, render routes; random task and model names,
    raw engine keys, vllm_xargs values, n, beam search, logprobs, prompt_logprobs, echo and
    add_generation_prompt in vLLM's lax boolean spellings, /invocations messages vLLM cannot
    validate (served as a completion), stop, streaming, structured outputs, SageMaker's
    adapter header, odd content types), four at a time beside store uploads (good and bad
    fields) and DELETEs of tasks with requests in flight: no 5xx; the engine alive after
    every batch; a layer task's `ltv_scale`, `ltv_mix` or a client's own `ltv_layer` never
    answered (these servers hold none: a folded head and LoRA adapters once ignored them);
    every 200 answered by the task the request names (or the bare model) at its own steps,
    under that name; no error shows a
    path, a traceback or an engine key. Every violation is collected (a dead engine is
    reported with the requests it died under, and the server restarted), then all are
    reported together."""
    with own_tasks(server, "gamma", "delta"):  # what its store changes leave
        run_fuzzer(server, random.Random(37 if server.mode == "shift" else 38))


def test_request_fuzzer_on_a_fused_server(fused_server):
    """The fuzzer against a fused server, its vector in the head's input or folded into the
    head (one vector shifts every request): every 200 on
    /v1/completions or /v1/chat/completions (with consent) carries the vector's token at
    its steps; any route the gate does not serve the vector on is refused by the engine's
    admission check (scale-out's generate, scoring, background responses...), never an
    answer, shifted or bare."""
    run_fuzzer(fused_server, random.Random(39 if fused_server.mode == "fused" else 40))


def run_fuzzer(srv: Server, rng: random.Random) -> None:
    """75 batches of four generated requests (`fuzz_body`), store changes between them on a
    store server, every answer checked (`check_answer`); all violations reported at once."""
    routes = ROUTES + [r for r in live_routes(srv) if r not in ROUTES]
    found: list[str] = []
    pool = ThreadPoolExecutor(4)

    def send(route: str, body: dict, headers: dict) -> httpx.Response | str:
        try:
            return post(srv, route, body, headers)
        except httpx.HTTPError as e:  # the server went away mid-request
            return f"{type(e).__name__}"

    try:
        for batch in range(75):
            jobs = []
            for _ in range(4):
                route = rng.choice(routes)
                body, headers = fuzz_body(rng, srv, route)
                jobs.append((route, body, headers, pool.submit(send, route, body, headers)))
            if batch % 15 == 7 and srv.mode in ("shift", "lora"):  # a store change meanwhile
                try:
                    store_change(rng, srv, jobs)
                except (AssertionError, httpx.HTTPError) as e:
                    found.append(f"store: {str(e).splitlines()[0][:300]}")
            for route, body, headers, fut in jobs:
                r = fut.result()
                try:
                    assert not isinstance(r, str), f"no answer ({r})"
                    check_answer(srv, route, body, headers, r)
                except AssertionError as e:
                    found.append(f"{route} {json.dumps(body)[:200]} {headers}: "
                                 f"{str(e).splitlines()[0][:300]}")
            if not srv.is_alive():
                found.append(f"ENGINE DIED after batch {batch}: " + " | ".join(
                    f"{route} {json.dumps(body)[:160]} {headers}"
                    for route, body, headers, _ in jobs))
                srv.restart()
    finally:
        pool.shutdown(wait=True)
    assert not found, f"{len(found)} violations:\n" + "\n".join(found)


def store_change(rng: random.Random, srv: Server, jobs: list) -> None:
    """An upload (a good or a bad shift_steps) or a DELETE, and a request for the task by
    its raw engine key queued behind the batch in flight."""
    live = [n for n in ("gamma", "delta") if n in srv.defaults]
    if live and rng.random() < 0.5:
        name = rng.choice(live)
        if srv.mode == "shift":  # beside the DELETE: the gate refuses an engine key
            # whenever it arrives (no order to wait for)
            body = completion(srv.base, max_tokens=2,
                              vllm_xargs={"ltv_task": srv.raw_key(name)})
            jobs.append(("/v1/completions", body, {}, ThreadPoolExecutor(1).submit(
                post, srv, "/v1/completions", body)))
        r = srv.delete(name)
        assert r.status_code in (200, 202), r.text
        return
    name = rng.choice(["gamma", "delta"])
    steps = rng.choice([None, "all", "2", "bogus", "-1"])
    want = 409 if name in srv.defaults else 201 if steps in (None, "all", "2") else 422
    r = srv.upload(name, steps)
    assert r.status_code == want, f"upload shift_steps={steps!r}: {r.status_code} {r.text}"
    if r.status_code == 201:  # its first request: the engine loads it now
        body = completion(name, max_tokens=2)
        jobs.append(("/v1/completions", body, {}, ThreadPoolExecutor(1).submit(
            post, srv, "/v1/completions", body)))
