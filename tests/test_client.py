"""client: task names are checked before any request, and every call can authenticate.

No vLLM here: the task-store calls go through a recording `httpx.request`, classify and
first_step_only through a small local HTTP server that answers as vLLM's OpenAI server does
and records what it was sent."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from ltv_vllm.serving.client import (
    ClientError,
    classify,
    compile_remote,
    delete_remote_task,
    first_step_only,
    label_ids_from_server,
    remote_task,
    upload_task,
)
from ltv_vllm.serving.store.taskstore import StoreError
from ltv_vllm.tasks.specs import BUILTIN_TASKS

TASK = BUILTIN_TASKS["sst2"]
BAD_NAMES = ["x/../cli_up", "victim?x=1", "victim#frag", "", "../etc", "a b", "x" * 65]


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    # a proxy from the environment would stand between the client and 127.0.0.1
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                "all_proxy"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def requests(monkeypatch):
    """Every httpx.request the client makes: (method, url, headers, kwargs); answers {}."""
    sent: list[tuple[str, str, dict, dict]] = []

    def fake(method, url, *, headers=None, **kw):
        sent.append((method, url, dict(headers or {}), kw))
        return httpx.Response(200, json={"name": "a.b-c_1", "status": "ready", "data": []})

    monkeypatch.setattr(httpx, "request", fake)
    return sent


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_never_leave_the_client(tmp_path, requests, name):
    vec = tmp_path / "v.pt"
    vec.write_bytes(b"PK\x03\x04")
    calls = [lambda: delete_remote_task("http://h", name, api_key="k"),
             lambda: remote_task("http://h", name),
             lambda: upload_task("http://h", name, str(vec)),
             lambda: compile_remote("http://h", {"name": name, "task": {}})]
    for call in calls:
        with pytest.raises(StoreError, match="task name"):
            call()
    assert requests == []


def test_a_good_name_goes_to_exactly_its_url(tmp_path, requests):
    delete_remote_task("http://h:1/", "a.b-c_1", api_key="s3cret")
    remote_task("http://h:1", "a.b-c_1")
    vec = tmp_path / "v.pt"
    vec.write_bytes(b"PK\x03\x04")
    upload_task("http://h:1", "a.b-c_1", str(vec), api_key="s3cret")
    assert [(m, u, h) for m, u, h, _ in requests] == [
        ("DELETE", "http://h:1/v1/ltv/tasks/a.b-c_1", {"Authorization": "Bearer s3cret"}),
        ("GET", "http://h:1/v1/ltv/tasks/a.b-c_1", {}),
        ("POST", "http://h:1/v1/ltv/tasks", {"Authorization": "Bearer s3cret"}),
    ]
    assert requests[2][3]["data"] == {"name": "a.b-c_1"}


class _Server:
    """A local stand-in for vLLM's OpenAI server: /tokenize gives each label word one token,
    /v1/completions answers with fixed label log-probabilities, /detokenize joins tokens."""

    LOGPROBS = {101: -0.25, 202: -1.75}  # token id → restricted log-probability

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, dict]] = []  # (path, Authorization, body)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.seen.append((self.path, self.headers.get("Authorization"), body))
                out = owner.answer(self.path, body)
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_a) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def answer(self, path: str, body: dict) -> dict:
        if path == "/tokenize":
            words = {" " + lab: i for lab, i in zip(TASK.labels, self.LOGPROBS, strict=True)}
            return {"tokens": [words.get(body["prompt"], 7)]}
        if path == "/detokenize":
            return {"prompt": "|".join(map(str, body["tokens"]))}
        top = {f"token_id:{i}": v for i, v in self.LOGPROBS.items()}
        first = next(iter(self.LOGPROBS))
        return {"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                             "logprobs": {"tokens": [f"token_id:{first}"],
                                          "token_logprobs": [self.LOGPROBS[first]],
                                          "top_logprobs": [top], "text_offset": [0]}}]}

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *_a) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("api_key", ["s3cret", None])
def test_classify_and_first_step_send_the_key(api_key):
    with _Server() as srv:
        [r] = classify(srv.url, TASK, ["a fine film"], api_key=api_key, concurrency=1)
        seen = len(srv.seen)
        g = first_step_only(srv.url, "p", vector="v", max_tokens=3, api_key=api_key)
    # one request: the step policy travels with it (no second request re-prefilling the
    # prompt with the bare model)
    assert [(path, body["vllm_xargs"], body["max_tokens"]) for path, _, body in srv.seen[seen:]
            ] == [("/v1/completions", {"ltv_steps": "first"}, 3)]
    # every request, the httpx ones and the openai ones, carried the key; without one, the
    # httpx calls send none and openai its placeholder
    auth = {path: a for path, a, _ in srv.seen}
    bearer = f"Bearer {api_key}" if api_key else None
    assert auth == {"/tokenize": bearer, "/v1/completions": f"Bearer {api_key or 'ltv-vllm'}"}
    # the restricted distribution, renormalised over the two labels, computed here directly
    z = sum(math.exp(v) for v in _Server.LOGPROBS.values())
    want = {lab: math.exp(v) / z
            for lab, v in zip(TASK.labels, _Server.LOGPROBS.values(), strict=True)}
    assert r.probs == pytest.approx(want) and r.label == max(want, key=want.__getitem__)
    assert g.token_ids == [101] and g.text == "x"


def test_unreachable_server_is_a_client_error():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ClientError) as e:
        label_ids_from_server(url, "m", TASK, api_key="k")
    assert str(e.value) == f"cannot reach {url}"
    with pytest.raises(ClientError, match="cannot reach"):
        classify(url, TASK, ["x"])


def test_cli_classify_passes_the_api_key(monkeypatch):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    with _Server() as srv:
        monkeypatch.setenv("LTV_VLLM_API_KEY", "from-env")
        r = CliRunner().invoke(main, ["classify", "--url", srv.url, "--task", "sst2", "nice"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(main, ["classify", "--url", srv.url, "--task", "sst2",
                                      "--api-key", "flag", "nice"])
        assert r.exit_code == 0, r.output
    keys = {a for _, a, _ in srv.seen}
    assert keys == {"Bearer from-env", "Bearer flag"}
