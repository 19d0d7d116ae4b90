"""The runtime task store through the real server (`serve --task-store`), as a busy operator
and a hostile client use it: uploads, compiles and deletes in cycles beside command-line
tasks, killed workers, restarts, bad and oversized bodies, requests without the key. Three
files, one server test each, so the suite's workers share them out: uploads and restarts
(here, with the helpers the other two import), churn (`test_store_churn.py`) and compiles
(`test_store_compile.py`).

The oracle is always transformers: after every change the bare model and every live task
answer exactly as the tiny model (+ the vector the store holds) does in transformers
(`check_mixed`, logprobs within 1e-4, all names in flight together).
"""

from __future__ import annotations

import json
import pickle
import select
import shutil
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import torch
from click.testing import CliRunner
from test_server import (
    HTTP,
    PROMPTS,
    check_mixed,
    check_policies,
    file_size_limit,
    make_assets,
    start_server,
    stop,
)

from conftest import reference_logprobs, write_model_and_vectors
from ltv_vllm.cli import main
from ltv_vllm.core.vector import TaskVector
from ltv_vllm.core.vector_files import read_safetensors
from ltv_vllm.serving.store.taskstore import TaskStore

pytestmark = pytest.mark.slow(seconds=54)  # see conftest's ordering

KEY = {"Authorization": "Bearer x"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    return make_assets(tmp_path_factory, tokenizer, tie=False)  # answers differ in tokens


# -- files a TaskVector would refuse to build ------------------------------------------------
def doctored(src: TaskVector, path: Path, *, tensors: dict | None = None,
             meta: dict | None = None) -> Path:
    """`src` written as .safetensors with some tensors or header `meta` keys replaced."""
    from safetensors.torch import save_file

    src.save(path)
    header_json, held = read_safetensors(path)
    header = json.loads(header_json)
    header["meta"] = {**header.get("meta", {}), **(meta or {})}
    tensors = {k: t.contiguous() for k, t in {**held, **(tensors or {})}.items()}
    save_file(tensors, str(path), metadata={"ltv_vllm": json.dumps(header)})
    return path


def random_vector(like: TaskVector, rank: int, seed: int, scale: float = 0.5) -> TaskVector:
    g = torch.Generator().manual_seed(seed)
    d = like.model.hidden_size
    return TaskVector("hidden", scale * torch.randn(d, rank, generator=g),
                      torch.randn(d, rank, generator=g) / d ** 0.5, None, like.model,
                      like.label_token_ids, {"task": {"name": f"r{seed}"}})


class Evil:
    def __reduce__(self):
        return (print, ("this pickle ran code",))


# -- HTTP by hand: bodies whose size no header tells, headers that lie -------------------------
def raw_post(url: str, path: str, headers: dict[str, str], chunks, *, chunked: bool = False,
             timeout: float = 60) -> tuple[int, int, float]:
    """POST by hand: (status, body bytes sent before the answer came, seconds to answer).
    Sending stops as soon as the server answers."""
    u = urlsplit(url)
    t0 = time.perf_counter()
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else "\r\n"
        sock.sendall(head.encode())
        sent, answered = 0, False
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                answered = True
                break
            try:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked
                             else chunk)
            except (BrokenPipeError, ConnectionResetError):
                answered = True
                break
            sent += len(chunk)
        if not answered and chunked:
            sock.sendall(b"0\r\n\r\n")
        resp = b""
        while b"\r\n" not in resp:
            part = sock.recv(65536)
            if not part:
                break
            resp += part
    return int(resp.split(b" ", 2)[1]), sent, time.perf_counter() - t0


def multipart_head(boundary: str = "b0undary") -> tuple[dict[str, str], bytes]:
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nbig\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"vector\"; "
            "filename=\"v.safetensors\"\r\nContent-Type: application/octet-stream\r\n\r\n")
    return {"Content-Type": f"multipart/form-data; boundary={boundary}", **KEY}, head.encode()


def no_paths(r: httpx.Response, *paths: Path) -> None:
    """An error answer names none of the server's paths."""
    for p in paths:
        assert str(p) not in r.text, r.text


def compile_body(name: str, flip: bool = False, queries: list[str] | None = None) -> dict:
    words = ["the plot is dull", "a warm and funny film", "boring and slow", "great acting",
             "i loved it", "a waste of time", "fresh and bright", "flat and tired", "so good",
             "so bad", "the cast shines", "the script fails"]
    labs = ["negative", "positive"][::-1] if flip else ["negative", "positive"]
    return {"name": name,
            "task": {"in_prefix": "Review", "label_prefix": "Sentiment", "labels": labs},
            "demos": [{"text": w, "label": labs[i % 2]} for i, w in enumerate(words[:4])],
            "queries": queries or words[4:]}


def wait_status(url: str, name: str, want: str, deadline: float, headers=None) -> dict:
    while (got := HTTP.get(f"{url}/v1/ltv/tasks/{name}", headers=headers).json()).get(
            "status") != want:
        assert got.get("status") not in ({"ready", "failed"} - {want}), got
        assert time.time() < deadline, got
        time.sleep(0.3)
    return got


# -- 2. uploads: limits, refusals, what is stored is served, restarts --------------------------
def test_task_store_server(assets, tokenizer, tmp_path):
    """`serve --task-store`: entries already there are served; an uploaded file is checked,
    stored and served at once (= transformers + the vector the store holds); every bad upload
    is a 4xx naming no server path and leaves nothing; a full disk is a 507; an upload of
    higher rank than served is stored cut, so a restart serves it; an entry a restart cannot
    serve is quarantined with a warning, never a failed start."""
    d, model, vecs = assets
    store = TaskStore(tmp_path / "store")
    store.add("alpha", vecs["alpha"][0], d)
    args = ("--task-store", str(store.root), "--max-tasks", "2")
    proc, url, log = start_server(d, [f"beta={vecs['beta'][1]}"], tmp_path, args)
    tasks = f"{url}/v1/ltv/tasks"
    alpha = vecs["alpha"][0]

    def post(name, path=None, data=None, **kw):
        files = {"vector": (Path(path).name, Path(path).read_bytes())} if path else None
        return HTTP.post(tasks, data={"name": name, **(data or {})}, files=files,
                          timeout=60, **kw)

    try:
        listed = HTTP.get(tasks).json()["data"]
        assert [(t["name"], t["served"]) for t in listed] == [("alpha", True)]
        assert listed[0]["model"]["name"] == "<model>"  # the record's model path, hidden
        no_paths(HTTP.get(tasks), store.root, d)
        served = {"alpha": store.get("alpha").vector(), "beta": vecs["beta"][0]}
        check_mixed(url, served, model, tokenizer, True)
        # per-request tasks (the default): a store task's step policy, streamed or not, and
        # the store task named as a field beside the bare model's name
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        check_policies(client, "alpha", served["alpha"], model, tokenizer,
                       [("first", 1, True), (2, 2, False)])
        check_policies(client, str(d), served["alpha"], model, tokenizer, [("all", 3, False)],
                       xargs={"ltv_task": "alpha"})
        g = post("gamma", vecs["beta"][1])  # a .pt file (a zip; loaded with weights_only)
        assert g.status_code == 201, g.text
        assert g.json()["name"] == "gamma" and g.json()["served"]
        assert torch.equal(store.get("gamma").vector().U, vecs["beta"][0].U)
        check_mixed(url, {"gamma": store.get("gamma").vector(), "alpha": served["alpha"]},
                    model, tokenizer, True)
        # full: refused before the file is even parsed
        for r, code, words in [(post("delta", vecs["alpha"][1]), 409, "holds 2 tasks"),
                               (post("gamma", vecs["alpha"][1]), 409, "exists")]:
            assert r.status_code == code and words in r.json()["error"]["message"], r.text
        assert HTTP.delete(f"{tasks}/gamma").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gamma", prompt=PROMPTS[0], max_tokens=1)

        # refusals with a free slot: 4xx, one line, no server path, nothing written
        bad = tmp_path / "junk.safetensors"
        bad.write_bytes(b"\x00garbage")
        (tmp_path / "o").mkdir()
        _, wrong_path = write_model_and_vectors(tmp_path / "o", tokenizer)  # another model
        evil = tmp_path / "evil.pt"
        evil.write_bytes(pickle.dumps({"tensors": Evil()}))
        nan = doctored(alpha, tmp_path / "nan.safetensors",
                       tensors={"V": alpha.V.clone().index_fill_(0, torch.tensor([3]),
                                                                 float("nan"))})
        huge = TaskVector("hidden", alpha.U * 1e30, alpha.V, None, alpha.model,
                          alpha.label_token_ids, alpha.meta).save(tmp_path / "huge.pt")
        task_list = doctored(alpha, tmp_path / "meta.safetensors", meta={"task": ["x"]})
        r600 = random_vector(alpha, 600, 5, scale=0.01).save(tmp_path / "r600.pt")
        cases = [(post("../x", vecs["alpha"][1]), 400, "task name"),
                 (post("delta", bad), 422, "corrupt"),
                 (post("delta", wrong_path), 422, "hidden size"),
                 (post("delta", vecs["alpha"][1], {"extra": "1"}), 400, "unknown field"),
                 (post("delta", evil), 422, "refused: a plain pickle that names Python objects"),
                 (post("delta", nan), 422, "non-finite"),
                 (post("delta", huge), 422, "would move the logits"),
                 (post("delta", task_list), 422, "meta.task"),
                 (post("delta", r600), 422, "rank 600: an upload may have rank 512 at most"),
                 (HTTP.post(tasks, json={"name": "delta"}), 400, "missing field 'task'"),
                 (HTTP.post(tasks, content=b"x", headers={"content-type": "text/plain"}), 415,
                  "multipart"),
                 (HTTP.delete(f"{tasks}/beta"), 409, "command line"),
                 (HTTP.delete(f"{tasks}/nope"), 404, "no task"),
                 (HTTP.get(f"{tasks}/nope"), 404, "no task"),
                 (HTTP.get(f"{tasks}/.hidden"), 400, "task name"),
                 (HTTP.delete(f"{tasks}/a%20b"), 400, "task name")]
        for r, code, words in cases:
            assert r.status_code == code and words in r.json()["error"]["message"], r.text
            assert len(r.json()["error"]["message"].splitlines()) == 1
            no_paths(r, store.root, d)
        assert store.names() == ["alpha"]
        # the server's lock and its pins (the engine loads a task from its pin)
        assert sorted(p.name for p in store.root.iterdir()) == [".jobs", ".lock", ".pins",
                                                                  "alpha"]
        assert not any((store.root / ".jobs").iterdir())

        # NaN metrics in a header: stored as null, served, listed as strict JSON
        nanm = doctored(alpha, tmp_path / "nanm.safetensors",
                        meta={"metrics": {"ltv": {"accuracy": float("nan"), "d_ntp": 0.5}}})
        r = post("nanm", nanm)
        assert r.status_code == 201 and r.json()["metrics"]["ltv"] == {"accuracy": None,
                                                                       "d_ntp": 0.5}, r.text
        assert HTTP.get(tasks).status_code == 200
        check_mixed(url, {"nanm": store.get("nanm").vector()}, model, tokenizer, True)
        assert HTTP.delete(f"{tasks}/nanm").status_code == 200

        # a full disk: 507, nothing left behind, the server stays up
        as_st = alpha.save(tmp_path / "alpha.safetensors")
        limit = as_st.stat().st_size + 512
        assert limit < len(tokenizer) * 8 * 4
        with file_size_limit(proc.pid, limit):
            r = post("delta", as_st)
            assert r.status_code == 507 and "disk is full" in r.json()["error"]["message"], r.text
            no_paths(r, store.root)
            assert HTTP.post(tasks, json=compile_body("c6")).status_code == 202
            got = wait_status(url, "c6", "failed", time.time() + 300)
        assert "disk is full" in got["error"], got
        assert HTTP.delete(f"{tasks}/c6").status_code == 200
        # the server's lock and its pins (the engine loads a task from its pin)
        assert sorted(p.name for p in store.root.iterdir()) == [".jobs", ".lock", ".pins",
                                                                  "alpha"]
        assert not any((store.root / ".jobs").iterdir())

        # rank 300 > the served rank 128 (= d): stored cut, and the cut vector is served
        wide = random_vector(alpha, 300, 6, scale=0.05)
        r = post("wide", wide.save(tmp_path / "wide.pt"))
        assert r.status_code == 201 and (r.json()["rank"], r.json()["full_rank"]) == (128, 300)
        held = store.get("wide").vector()
        assert held.rank == 128
        check_mixed(url, {"wide": held, "alpha": served["alpha"]}, model, tokenizer, True)
    finally:
        stop(proc, log)

    # a restart serves what the store holds; an entry it cannot serve is moved aside
    shutil.copytree(store.root / "alpha", store.root / "broken")
    (store.root / "broken" / "adapter_model.safetensors").write_bytes(b"junk")
    proc, url, log = start_server(d, [], tmp_path, (*args, "--api-key", "x",
                                                    "--max-body-mib", "1"))
    tasks = f"{url}/v1/ltv/tasks"
    try:
        assert "warning: task store entry 'broken' is not served (task store entry broken: " \
               "its LoRA adapter does not read" in Path(log.name).read_text()
        assert [p.name for p in (store.root / ".quarantine").iterdir()][0].startswith("broken-")
        listed = HTTP.get(tasks, headers=KEY).json()["data"]
        assert [(t["name"], t["served"]) for t in listed] == [("alpha", True), ("wide", True)]
        check_mixed(url, {"wide": held, str(d): None}, model, tokenizer, True)
        gate_checks(url, store)
        cli_checks(url, tmp_path, store, model, tokenizer, vecs)
    finally:
        stop(proc, log)


def gate_checks(url: str, store: TaskStore) -> None:
    """Authentication before anything is read, on every route; limits on the bytes that
    arrive (a server started with --api-key x --max-body-mib 1)."""
    tasks = f"{url}/v1/ltv/tasks"
    # the key guards every route but the liveness probes, vLLM's own routes included
    assert HTTP.get(f"{url}/health").status_code == 200
    for method, path, body in [("GET", "/v1/ltv/tasks", None), ("GET", "/v1/models", None),
                               ("POST", "/invocations", {"prompt": "x", "max_tokens": 1}),
                               ("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [1]}),
                               ("GET", "/metrics", None), ("GET", "/openapi.json", None),
                               ("POST", "/v1/completions", {"model": "wide", "prompt": "x",
                                                            "prompt_logprobs": 1})]:
        r = httpx.request(method, url + path, json=body)
        assert r.status_code == 401, (path, r.status_code, r.text)
        r = httpx.request(method, url + path, json=body,
                          headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, (path, r.status_code, r.text)
    assert HTTP.post(f"{url}/tokenize", json={"prompt": "x"}, headers=KEY).status_code == 200
    # nothing is read before the key: a 200 MB body announced, 1 KB sent, 401 at once
    status, _, secs = raw_post(url, "/v1/completions",
                               {"Content-Type": "application/json",
                                "Content-Length": str(200 << 20)}, [b"{" * 1024])
    assert status == 401 and secs < 10
    # with the key: a declared size over the limit is a 413 before the body...
    status, _, secs = raw_post(url, "/v1/completions",
                               {"Content-Type": "application/json", **KEY,
                                "Content-Length": str(200 << 20)}, [b"{" * 1024])
    assert status == 413 and secs < 10
    # ... and so is a chunked body (no Content-Length) once it passes the limit: here 1 MiB
    big = [b" " * (64 << 10)] * 800  # 50 MiB offered
    status, sent, _ = raw_post(url, "/v1/completions",
                               {"Content-Type": "application/json", **KEY}, big, chunked=True)
    assert status == 413 and sent < 25 << 20, sent
    # an upload's limit follows from the model (rank 512 float32 factors): chunked past it
    headers, head = multipart_head()
    status, sent, _ = raw_post(url, "/v1/ltv/tasks", headers, [head, *big], chunked=True)
    assert status == 413 and sent < 25 << 20, sent
    # a compile request may be 64 MiB: chunked past it
    status, sent, _ = raw_post(url, "/v1/ltv/tasks", {"Content-Type": "application/json", **KEY},
                               [b" " * (1 << 20)] * 200, chunked=True)
    assert status == 413 and sent < 120 << 20, sent
    # JSON nested too deeply is a 400 (it was a 500), wherever it goes
    for path in ("/v1/completions", "/v1/ltv/tasks"):
        r = HTTP.post(url + path, content=b"[" * 200_000, timeout=60,
                       headers={"Content-Type": "application/json", **KEY})
        assert r.status_code == 400 and "nested too deeply" in r.text, (path, r.text)
    r = HTTP.post(f"{url}/v1/completions", headers=KEY, json={
        "model": "wide", "prompt": "x", "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 400 and "prompt_logprobs" in r.text
    assert store.names() == ["alpha", "wide"]  # nothing above reached the store
    assert HTTP.get(tasks, headers=KEY).status_code == 200  # and the server is up


def cli_checks(url, tmp_path, store, model, tokenizer, vecs) -> None:
    """The command-line client: list, delete, a name that is not one, compile, classify."""
    def cli(*a, key=True):
        r = CliRunner().invoke(main, [*a, "--url", url, *(["--api-key", "x"] if key else [])])
        return r.exit_code, r.output

    code, out = cli("tasks", "remote", "list")
    assert code == 0 and out.split("\n")[0].split()[:2] == ["alpha", "ready"], out
    assert cli("tasks", "remote", "delete", "wide") == (0, "deleted wide\n")
    code, out = cli("tasks", "remote", "delete", "wide")
    assert code == 1 and "server refused (404)" in out and len(out.splitlines()) == 1
    # a name that is not one is refused by the client; it never becomes another path
    for name in ("x/../alpha", "alpha?x=1", "alpha#frag"):
        code, out = cli("tasks", "remote", "delete", name)
        assert code == 1 and "task name" in out, out
    assert store.names() == ["alpha"]
    files = {}
    body = compile_body("c5")
    for key in ("demos", "queries"):
        files[key] = tmp_path / f"{key}.jsonl"
        files[key].write_text("".join(json.dumps(x) + "\n" for x in body[key]))
    code, out = cli("compile", "--name", "c5", "--task", "sst2", "--demos",
                    str(files["demos"]), "--queries", str(files["queries"]), "--wait")
    assert code == 0, out
    assert json.loads(out[out.index("{"):])["status"] == "ready"
    c5 = store.get("c5").vector()
    assert c5.provenance.task["labels"] == ["negative", "positive"]  # sst2's template
    check_mixed(url, {"c5": c5, "alpha": store.get("alpha").vector()}, model, tokenizer, True)
    code, out = cli("tasks", "remote", "add", "c5", str(vecs["beta"][1]))
    assert code == 1 and "(409)" in out, out
    # classify authenticates with --api-key (it sent a fixed key before)
    from ltv_vllm.tasks.specs import BUILTIN_TASKS, label_token_ids

    # (the printed probabilities have 3 decimals: this checks the command's output, and that
    # it authenticates; that the compiled task is what is served, ≥ 10× the tolerance from
    # alpha and the bare model, is check_mixed's above)
    code, out = cli("classify", "the plot is dull", "--task", "sst2", "--model", "c5")
    assert code == 0, out
    ids = label_token_ids(BUILTIN_TASKS["sst2"], tokenizer)
    ref = torch.softmax(reference_logprobs(model, tokenizer, BUILTIN_TASKS["sst2"].query(
        "the plot is dull"), [], c5)[-1, ids], -1)
    label, probs, _ = out.strip().split("\t")
    assert label == ["negative", "positive"][int(ref.argmax())]
    for part, p in zip(probs.split(), ref.tolist(), strict=True):
        assert abs(float(part.split("=")[1]) - p) < 2e-3
    code, out = cli("classify", "the plot is dull", "--task", "sst2", "--model", "c5",
                    key=False)
    assert code == 1 and "401" in out, out
