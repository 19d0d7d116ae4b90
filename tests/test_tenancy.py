"""Many tenants on one server, through real servers (`ltv-vllm serve --task-store --api-keys`):
a scoped key sees and uses only its own tasks, and every attempt at another tenant's is
answered exactly as a name nothing serves (audited with its key id); a scoped admin changes
the store only in its scope; a key's limits answer 429 with Retry-After, counted by key id on
/metrics; keys kept in a shared store reach every replica, and a revocation there is refused
by both replicas within the keys poll."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from click.testing import CliRunner
from test_keys import answered
from test_server import HTTP, make_assets, start_server, stop

from ltv_vllm.cli import main
from ltv_vllm.serving.contract.keys import add_key

pytestmark = pytest.mark.slow(seconds=90)  # see conftest's ordering


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    return make_assets(tmp_path_factory, tokenizer, tie=False)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(url: str, key: str, model: str, **extra) -> httpx.Response:
    return HTTP.post(f"{url}/v1/completions", headers=auth(key), timeout=120, json={
        "model": model, "prompt": "the movie was", "max_tokens": 4, "temperature": 0.0,
        **extra})


def upload(url: str, key: str, name: str, path) -> httpx.Response:
    return HTTP.post(f"{url}/v1/ltv/tasks", headers=auth(key), data={"name": name}, timeout=120,
                     files={"vector": ("v.pt", path.read_bytes())})


def same_but_name(a: httpx.Response, b: httpx.Response, name_a: str, name_b: str) -> None:
    """Two answers identical but for the name each request gave (nothing tells them apart)."""
    assert a.status_code == b.status_code, (a.text, b.text)
    assert a.text.replace(name_a, "NAME") == b.text.replace(name_b, "NAME"), (a.text, b.text)


def test_tenants_on_one_server(assets, tmp_path):
    d, _, vecs = assets
    keys = tmp_path / "keys.json"
    ops = add_key(keys, "ops", "admin")
    a_admin = add_key(keys, "a-admin", "admin", scope={"prefix": "a."})
    a_user = add_key(keys, "a-user", "inference", scope={"prefix": "a."})
    b_user = add_key(keys, "b-user", "inference", scope={"tasks": ["b.one"]})
    burst = add_key(keys, "burst", "inference", limits={"rate": 0.05, "burst": 2})
    one = add_key(keys, "one", "inference", limits={"in_flight": 1})
    audit = tmp_path / "audit.jsonl"
    proc, url, log = start_server(d, [f"alpha={vecs['alpha'][1]}"], tmp_path, (
        "--task-store", str(tmp_path / "store"), "--api-keys", str(keys),
        "--audit-log", str(audit)), layout="default")
    base = str(d)
    try:
        for name, vec in (("a.one", "beta"), ("b.one", "gamma")):
            assert upload(url, ops, name, vecs[vec][1]).status_code == 201
        # what each tenant sees: the base model and its own tasks, nothing else
        for key, mine in ((a_user, {"a.one"}), (b_user, {"b.one"}), (ops, {"a.one", "b.one",
                                                                            "alpha"})):
            listed = {c["id"] for c in HTTP.get(f"{url}/v1/models", headers=auth(key)).json()[
                "data"]}
            assert listed == {base} | mine, listed
            tasks = HTTP.get(f"{url}/v1/ltv/tasks", headers=auth(key)).json()["data"]
            assert {t["name"] for t in tasks} == mine - {"alpha"}
        # its own task answers as the unscoped key's does (the same shift)
        mine, theirs = complete(url, a_user, "a.one"), complete(url, ops, "a.one")
        assert mine.status_code == 200 and mine.json()["choices"][0]["text"] == theirs.json()[
            "choices"][0]["text"]
        assert complete(url, a_user, base).status_code == 200  # the bare model is everyone's
        # another tenant's task, or a command-line one, reads as a name nothing serves
        nothing = complete(url, a_user, "b.nothing")
        assert nothing.status_code == 404 and "b.nothing" in nothing.json()["error"]["message"]
        for name in ("b.one", "alpha"):
            same_but_name(complete(url, a_user, name), nothing, name, "b.nothing")
        same_but_name(complete(url, a_user, "a.nothing"), nothing, "a.nothing", "b.nothing")
        for name in ("b.one", "b.nothing"):
            r = complete(url, a_user, base, vllm_xargs={"ltv_task": name})
            assert r.status_code == 400 and "served tasks: a.one" in r.text, r.text
            assert "b.one" not in r.text.replace(name, "") and "alpha" not in r.text
        for path in ("/v1/ltv/tasks/b.one", "/v1/ltv/tasks/b.nothing"):
            r = HTTP.get(f"{url}{path}", headers=auth(a_user))
            assert r.status_code == 404
        same_but_name(HTTP.get(f"{url}/v1/ltv/tasks/b.one", headers=auth(a_user)),
                      HTTP.get(f"{url}/v1/ltv/tasks/b.nothing", headers=auth(a_user)),
                      "b.one", "b.nothing")
        # a scoped admin: changes in its scope only, no operator route, no scrape
        r = upload(url, a_admin, "b.two", vecs["alpha"][1])
        assert r.status_code == 403 and "under 'a.'" in r.text, r.text
        same_but_name(upload(url, a_admin, "b.one", vecs["alpha"][1]), r, "b.one", "b.two")
        assert upload(url, a_admin, "a.two", vecs["alpha"][1]).status_code == 201
        same_but_name(HTTP.delete(f"{url}/v1/ltv/tasks/b.one", headers=auth(a_admin)),
                      HTTP.delete(f"{url}/v1/ltv/tasks/b.nothing", headers=auth(a_admin)),
                      "b.one", "b.nothing")
        assert HTTP.get(f"{url}/v1/ltv/tasks/b.one", headers=auth(ops)).status_code == 200
        assert HTTP.delete(f"{url}/v1/ltv/tasks/a.two", headers=auth(a_admin)).status_code == 200
        for method, path in (("GET", "/metrics"), ("POST", "/reset_prefix_cache")):
            assert HTTP.request(method, f"{url}{path}", headers=auth(a_admin)).status_code == 403
        # every cross-scope attempt is in the audit log with its key id
        lines = [json.loads(x) for x in audit.read_text().splitlines()]
        crossed = {(x["key"], x["op"], x["name"], x["status"]) for x in lines}
        assert {("a-user", "use", "b.one", 404), ("a-user", "use", "alpha", 404),
                ("a-user", "use", "b.one", 400), ("a-user", "read", "b.one", 404),
                ("a-admin", "delete", "b.one", 404)} <= crossed, crossed
        assert any(x["key"] == "a-admin" and x["status"] == 403 and x["op"] == "upload"
                   for x in lines), lines
        assert a_user not in audit.read_text() and a_admin not in audit.read_text()
        limits_through_the_server(url, ops, burst, one, base)
    finally:
        stop(proc, log)


def key_counts(url: str, ops: str) -> dict[str, float]:
    """The `ltv_vllm:key_requests_total` samples on /metrics, by their labelled name."""
    text = HTTP.get(f"{url}/metrics", headers=auth(ops)).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("ltv_vllm:key_requests_total")}


def limits_through_the_server(url: str, ops: str, burst: str, one: str, base: str) -> None:
    """A token bucket of 2 (0.05/s): two requests, then 429 with Retry-After; one request in
    flight at once: a second is a 429 while one is held (its body half sent), and answered
    once it ends; both counted by key id on /metrics."""
    got = [HTTP.get(f"{url}/v1/models", headers=auth(burst)) for _ in range(3)]
    assert [r.status_code for r in got] == [200, 200, 429], [r.text for r in got]
    assert int(got[2].headers["retry-after"]) >= 1 and "burst" in got[2].text
    release = threading.Event()

    def body():  # a body sent in two parts: the request is in flight until the second
        yield b'{"model": "' + base.encode() + b'", "prompt": "the", '
        release.wait(120)
        yield b'"max_tokens": 1}'

    def hold() -> httpx.Response:
        return HTTP.post(f"{url}/v1/completions", content=body(), timeout=120,
                         headers={**auth(one), "content-type": "application/json"})

    def admitted(key: str) -> float:
        return key_counts(url, ops).get(
            f'ltv_vllm:key_requests_total{{key="{key}",outcome="admitted"}}', 0.0)

    before = admitted("one")
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(hold)
        while admitted("one") == before:  # the held request has its slot
            assert not held.done(), held.result().text
        r = HTTP.get(f"{url}/v1/models", headers=auth(one))
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        release.set()
        assert held.result().status_code == 200, held.result().text
    answered(url, "/v1/models", one, 200, seconds=30)  # the slot freed with the request
    counts = key_counts(url, ops)
    assert counts['ltv_vllm:key_requests_total{key="burst",outcome="rate"}'] == 1
    assert counts['ltv_vllm:key_requests_total{key="burst",outcome="admitted"}'] == 2
    assert counts['ltv_vllm:key_requests_total{key="one",outcome="in_flight"}'] >= 1


def test_keys_in_a_shared_store_reach_every_replica(assets, tmp_path):
    """Two replicas on one shared store that holds the keys (no keys file on either): a key
    added, rotated and revoked with `keys ... --store` is honoured by both within the poll."""
    d, _, _ = assets
    spec = f"file://{tmp_path / 'shared'}"

    def keys(*args: str) -> str:
        r = CliRunner().invoke(main, ["keys", *args, "--store", spec])
        assert r.exit_code == 0, r.output
        return r.output.strip()

    ops = keys("add", "--id", "ops", "--role", "admin")
    app = keys("add", "--id", "app", "--role", "inference")
    for i in range(2):
        (tmp_path / f"r{i}").mkdir()
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda i: start_server(d, [], tmp_path / f"r{i}", (
            "--task-store", spec)), range(2)))
    try:
        for _, url, _ in servers:
            answered(url, "/v1/models", app, 200, seconds=0)
            answered(url, "/v1/models", "ltv-wrong", 401, seconds=0)
        late = keys("add", "--id", "late", "--role", "inference")  # after the start
        new = keys("rotate", "--id", "app")
        for _, url, _ in servers:
            answered(url, "/v1/models", late, 200, seconds=5)
            answered(url, "/v1/models", new, 200, seconds=5)
            answered(url, "/v1/models", app, 401, seconds=0)
        keys("revoke", "--id", "late")
        for _, url, _ in servers:
            # the keys poll (1 s), with room for a slow machine's requests, on both replicas
            answered(url, "/v1/models", late, 401, seconds=5)
        for _, url, _ in servers:
            answered(url, "/v1/models", ops, 200, seconds=0)
        # a replica given its own keys as well is refused: one source
        r = CliRunner().invoke(main, ["serve", "--model", str(d), "--task-store", spec,
                                      "--dry-run", "--", "--api-key", "x"])
        assert r.exit_code != 0 and "holds the API keys" in r.output, r.output
    finally:
        for proc, _, log in servers:
            stop(proc, log)
