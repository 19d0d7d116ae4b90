"""Keys with roles and the task store's audit log, through the real server
(`serve --task-store --api-keys FILE --audit-log FILE`): an inference key answers
completions and lists, and is refused (403) every change of the store; an admin key makes
them; every store operation — the refused ones too — is one JSON line with the key's id,
never a key."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_server import HTTP, PROMPTS, make_assets, start_server, stop
from test_store_server import compile_body, wait_status

from ltv_vllm.cli import main
from ltv_vllm.serving.contract.keys import KeysError, add_key, key_hash, may, read_keys

pytestmark = pytest.mark.slow(seconds=45)  # see conftest's ordering


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    return make_assets(tmp_path_factory, tokenizer, tie=False)


def test_keys_file_and_the_rule(tmp_path):
    path = tmp_path / "keys.json"
    r = CliRunner().invoke(main, ["keys", "add", str(path), "--id", "ops", "--role", "admin"])
    assert r.exit_code == 0, r.output
    key = r.output.strip()
    assert key.startswith("ltv-") and key not in path.read_text()  # the hash, not the key
    assert read_keys(path) == [{"id": "ops", "role": "admin", "sha256": key_hash(key)}]
    assert path.stat().st_mode & 0o077 == 0
    add_key(path, "app", "inference")
    assert [k["id"] for k in read_keys(path)] == ["ops", "app"]
    for bad, words in [({"keys": []}, "at least one key"),
                       ({"keys": [{"id": "a", "role": "root", "sha256": "0" * 64}]}, "role"),
                       ({"keys": [{"id": "a", "role": "admin", "sha256": "secret"}]}, "sha256"),
                       ({"keys": [{"id": "a", "role": "admin", "sha256": "0" * 64}] * 2},
                        "taken"),
                       ({"keys": [{"id": "a", "role": "admin"}]}, "give id, role and sha256"),
                       ({"keys": [{"id": "a", "role": "admin", "sha256": "0" * 64,
                                   "owner": "x"}]}, "nothing else")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(KeysError, match=words) as e:
            read_keys(path)
        assert "\n" not in str(e.value)
    r = CliRunner().invoke(main, ["keys", "add", str(path), "--id", "x", "--role", "admin"])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
    assert may("inference", "POST", "/v1/completions") and may("inference", "GET",
                                                               "/v1/ltv/tasks")
    assert not may("inference", "POST", "/v1/ltv/tasks")
    assert not may("inference", "DELETE", "/v1/ltv/tasks/a")
    assert may("admin", "DELETE", "/v1/ltv/tasks/a")
    # vLLM's operator routes are an admin key's; under /inference an inference key generates
    assert may("inference", "POST", "/inference/v1/generate")
    for path in ("/inference/v1/abort_requests", "/inference/v1/abort_requests/", "/pause",
                 "/scale_elastic_ep", "/collective_rpc", "/inference/v2/anything"):
        assert not may("inference", "POST", path) and may("admin", "POST", path), path
    assert not may("inference", "GET", "/server_info")


def test_key_lifecycle_in_the_file(tmp_path):
    """`keys add | rotate | revoke`, expiry and the metrics role, against the file and the
    rule (the server's side: `keys_change_without_a_restart`)."""
    from ltv_vllm.serving.contract.keys import (
        KeyRing,
        parse_expiry,
        revoke_key,
        rotate_key,
    )

    path = tmp_path / "keys.json"
    ops = add_key(path, "ops", "admin")
    prom = add_key(path, "prom", "metrics", expires=1000)
    assert read_keys(path)[1] == {"id": "prom", "role": "metrics", "sha256": key_hash(prom),
                                  "expires": 1000}
    ring = KeyRing(read_keys(path)[:1], str(path), [], poll=0)  # the file changed since
    assert ring.refresh(0) is None  # the first look reads it
    assert [c.key_id for _, c in ring.accepted(999)] == ["ops", "prom"]
    assert [c.key_id for _, c in ring.accepted(1000)] == ["ops"]  # expired from its second on
    new = rotate_key(path, "prom")
    assert new != prom and read_keys(path)[1]["sha256"] == key_hash(new)
    assert read_keys(path)[1]["expires"] == 1000  # kept unless a new one is given
    assert ring.refresh(0) is None and ring.keys[1]["sha256"] == key_hash(new)
    revoke_key(path, "prom")
    ring.refresh(0)
    assert [k["id"] for k in ring.keys] == ["ops"]
    with pytest.raises(KeysError, match="last key"):
        revoke_key(path, "ops")
    with pytest.raises(KeysError, match="no key 'nope'"):
        rotate_key(path, "nope")
    path.write_text("[]")  # broken: reported once, the last good keys kept
    assert "stay in force" in ring.refresh(0) and ring.refresh(0) is None
    assert [k["id"] for k in ring.keys] == ["ops"] and key_hash(ops) == ring.keys[0]["sha256"]
    assert may("metrics", "GET", "/metrics") and not may("metrics", "POST", "/metrics")
    for method, route in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                          ("GET", "/v1/ltv/tasks"), ("GET", "/health/x")):
        assert not may("metrics", method, route), route
    assert not may("nobody", "GET", "/v1/models")  # an unknown role: nothing
    assert parse_expiry("2d", 100) == 100 + 2 * 86400
    assert parse_expiry("2030-01-01", 0) == 1893456000
    for bad in ("soon", "1999-01-01"):
        with pytest.raises(KeysError, match="--expires"):
            parse_expiry(bad, 1e9)


def test_scopes_and_limits_in_the_keys_file(tmp_path):
    """A key's scope and limits: checked in the file, read back as the gate reads them, the
    rule a scoped key follows, and the token bucket against a hand count."""
    from ltv_vllm.serving.api_server.tenancy import Limiter
    from ltv_vllm.serving.contract.keys import Caller, KeyRing
    from ltv_vllm.serving.contract.tenancy import Limits, Scope

    path = tmp_path / "keys.json"
    add_key(path, "ops", "admin")
    add_key(path, "a", "admin", scope={"prefix": "team-a."}, limits={"in_flight": 2})
    add_key(path, "b", "inference", scope={"tasks": ["sst2", "agnews"]},
            limits={"rate": 2, "burst": 3})
    entries = read_keys(path)
    assert entries[1]["scope"] == {"prefix": "team-a."}
    assert entries[2]["scope"] == {"tasks": ["agnews", "sst2"]}
    ring = KeyRing(entries, str(path), [], poll=0, limits=Limits(in_flight=9))
    callers = {c.key_id: c for _, c in ring.accepted(0)}
    assert callers["ops"] == Caller("ops", "admin", None, Limits(in_flight=9))  # the default
    a, b = callers["a"], callers["b"]
    assert a.scope == Scope(prefix="team-a.") and a.limits == Limits(in_flight=2)
    assert b.scope.covers("sst2") and not b.scope.covers("sst") and not b.scope.covers(None)
    assert a.scope.covers("team-a.x") and not a.scope.covers("team-b.x")
    assert not a.scope.covers("team-a.x@" + "0" * 16)  # an engine key is no task name
    for bad, words in [({"scope": {"prefix": ""}}, "prefix"), ({"scope": {"tasks": []}}, "tasks"),
                       ({"scope": {"prefix": "a", "tasks": ["b"]}}, "scope must be"),
                       ({"limits": {"in_flight": 0}}, "in_flight"),
                       ({"limits": {"rate": -1}}, "rate"), ({"limits": {"burst": 2}}, "give rate"),
                       ({"limits": {"rate": True}}, "rate"), ({"limits": {"cpu": 1}}, "limits"),
                       ({"role": "metrics", "scope": {"prefix": "a"}}, "metrics key")]:
        doc = {"keys": [{"id": "x", "role": "inference", "sha256": "0" * 64, **bad}]}
        path.write_text(json.dumps(doc))
        with pytest.raises(KeysError, match=words) as e:
            read_keys(path)
        assert "\n" not in str(e.value)
    # a scoped key: its own routes, no operator route, no scrape, whatever its role
    assert may("admin", "POST", "/v1/ltv/tasks", scoped=True)
    for method, route in (("GET", "/metrics"), ("POST", "/pause"), ("POST", "/collective_rpc"),
                          ("POST", "/inference/v1/abort_requests")):
        assert not may("admin", method, route, scoped=True), route
        assert may("admin", method, route), route
    assert may("inference", "POST", "/inference/v1/generate", scoped=True)
    # the bucket: 3 at once, then 2 a second; in flight: 2 at once, freed by release
    lim = Limiter()
    took = [lim.take(b, 100.0) for _ in range(4)]
    assert took[:3] == [None] * 3 and took[3] == ("rate", 1)
    for _ in range(3):
        lim.release(b)
    assert lim.take(b, 100.49) == ("rate", 1)  # 0.98 of a token: not yet
    assert lim.take(b, 100.5) is None  # one token back after half a second
    assert lim.take(b, 100.5) == ("rate", 1)
    assert lim.take(b, 110.0) is None  # refilled, never past the burst
    assert [lim.take(b, 110.0) for _ in range(3)] == [None, None, ("rate", 1)]
    assert lim.take(a, 0) is None and lim.take(a, 0) is None
    assert lim.take(a, 0) == ("in_flight", 1)
    lim.release(a)
    assert lim.take(a, 0) is None
    assert lim.take(Caller("free", "admin"), 0) is None  # no limits: nothing counted
    assert "free" not in lim.in_flight


def test_keys_in_a_shared_store(tmp_path):
    """`keys ... --store`: one source every replica's ring follows, changed by compare-and-
    swap (two writers lose nothing), its broken generation keeping the keys read before."""
    from ltv_vllm.serving.contract.keys import KeyRing
    from ltv_vllm.serving.store.shared_keys import StoreKeys

    spec = f"file://{tmp_path / 'shared'}"
    r = CliRunner().invoke(main, ["keys", "add", "--store", spec, "--id", "ops",
                                  "--role", "admin"])
    assert r.exit_code == 0, r.output
    ops = r.output.strip()
    store = StoreKeys(spec)
    assert [k["id"] for k in store.read()] == ["ops"] and ops not in str(store.read())
    ring = KeyRing([], store, [], poll=0)
    assert ring.refresh(0) is None and [c.key_id for _, c in ring.accepted(0)] == ["ops"]
    # two writers at once (the second read the same generation): both changes land
    from ltv_vllm.serving.contract.keys import added

    first = store._newest()
    calls = []

    def change(keys):
        calls.append(len(keys))
        if len(calls) == 1:  # another writer publishes meanwhile
            store.store.backend.create(f"keys/{first[0] + 1:012d}.json", json.dumps(
                {"generation": first[0] + 1, "keys": added(keys, "other", "inference")[0]})
                .encode())
        return added(keys, "mine", "inference")[0]
    store.update(change)
    assert calls == [1, 2] and [k["id"] for k in store.read()] == ["ops", "other", "mine"]
    assert ring.refresh(1) is None and len(ring.accepted(1)) == 3
    r = CliRunner().invoke(main, ["keys", "revoke", "--store", spec, "--id", "other"])
    assert r.exit_code == 0, r.output
    ring.refresh(2)
    assert [c.key_id for _, c in ring.accepted(2)] == ["ops", "mine"]
    g = store.stamp()
    (tmp_path / "shared" / "keys" / f"{g + 1:012d}.json").write_text("{")  # broken
    assert "stay in force" in ring.refresh(3)
    assert [c.key_id for _, c in ring.accepted(3)] == ["ops", "mine"]
    r = CliRunner().invoke(main, ["keys", "list", str(tmp_path / "k.json"), "--store", spec])
    assert r.exit_code != 0 and "one of them" in r.output


def test_roles_and_the_audit_log_through_the_server(assets, tmp_path):
    d, _, vecs = assets
    keys = tmp_path / "keys.json"
    admin = add_key(keys, "ops", "admin")
    user = add_key(keys, "app-1", "inference")
    audit = tmp_path / "audit.jsonl"
    proc, url, log = start_server(d, [], tmp_path, (
        "--task-store", str(tmp_path / "store"), "--api-keys", str(keys),
        "--audit-log", str(audit), "--enable-scale-out"))
    tasks = f"{url}/v1/ltv/tasks"

    def auth(key):
        return {"Authorization": f"Bearer {key}"}

    def upload(key, name):
        return HTTP.post(tasks, headers=auth(key), data={"name": name}, timeout=60,
                         files={"vector": ("a.pt", vecs["alpha"][1].read_bytes())})

    def lines():
        return [json.loads(x) for x in audit.read_text().splitlines()]

    def unauthorized() -> float:
        text = HTTP.get(f"{url}/metrics", headers=auth(admin), timeout=60).text
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                   if x.startswith('ltv_vllm:refusals_total{reason="unauthorized"}'))

    try:
        # the inference key: model routes and listing, no store change
        r = upload(user, "alpha")
        assert r.status_code == 403 and "admin" in r.json()["error"]["message"], r.text
        assert upload("ltv-wrong", "alpha").status_code == 401
        assert HTTP.post(tasks, json=compile_body("c"), headers=auth(user)).status_code == 403
        assert HTTP.get(tasks, headers=auth(user)).status_code == 200
        assert HTTP.get(f"{url}/v1/models", headers=auth(user)).status_code == 200
        # the admin key: changes
        r = upload(admin, "alpha")
        assert r.status_code == 201, r.text
        # two Authorization headers (an inference key's, then an admin key's, was admin: the
        # gate read the last, vLLM the first): refused whatever their order, one line,
        # counted, not audited; alpha stays
        before = unauthorized()
        for pair in ((user, admin), (admin, user), (admin, admin)):
            r = HTTP.delete(f"{tasks}/alpha", headers=[("Authorization", f"Bearer {k}")
                                                       for k in pair])
            assert r.status_code == 400, r.text
            assert "2 Authorization headers" in r.json()["error"]["message"], r.text
            assert "\n" not in r.json()["error"]["message"]
        assert unauthorized() == before + 3
        assert HTTP.get(f"{tasks}/alpha", headers=auth(user)).status_code == 200
        # vLLM's operator routes: an admin key's only (aborting others' requests by id,
        # scaling, vLLM's dev and RL routes...); refused, not audited as store changes
        for path, body in [("/inference/v1/abort_requests", {"request_ids": ["cmpl-x"]}),
                           ("/abort_requests", {}), ("/scale_elastic_ep",
                                                     {"new_data_parallel_size": 2}),
                           ("/inference/v1/other", {}), ("/pause", {}), ("/sleep", {}),
                           ("/collective_rpc", {"method": "x"}), ("/reset_prefix_cache", {}),
                           ("/v1/unload_lora_adapter", {"lora_name": "alpha"}),
                           ("/v1/ltv/tasksXYZ", {}), ("/v1/ltv/tasks/a/b", {})]:
            r = HTTP.post(f"{url}{path}", json=body, headers=auth(user), timeout=60)
            assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], \
                (path, r.text)
        r = HTTP.post(f"{url}/inference/v1/abort_requests", json={"request_ids": ["cmpl-x"]},
                      headers=auth(admin), timeout=60)
        assert r.status_code == 200, r.text
        assert HTTP.delete(f"{tasks}/alpha", headers=auth(user)).status_code == 403
        import openai  # the task answers the inference key (its exactness: test_store_server)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=user, max_retries=0)
        r = client.completions.create(model="alpha", prompt=PROMPTS[0], max_tokens=2)
        assert r.model == "alpha" and r.choices[0].text
        r = HTTP.post(tasks, json=compile_body("comp"), headers=auth(admin))
        assert r.status_code == 202, r.text
        wait_status(url, "comp", "ready", time.time() + 300, headers=auth(admin))
        assert HTTP.delete(f"{tasks}/alpha", headers=auth(admin)).status_code == 200
        assert HTTP.delete(f"{tasks}/nope", headers=auth(admin)).status_code == 404
        got = lines()
        # in order, but a compile's end may land beside the next request's line
        seen = [(x["op"], x.get("status", x.get("result")), x["key"], x["name"]) for x in got]
        assert sorted(map(str, seen)) == sorted(map(str, [
            ("add", 403, "app-1", None), ("add", 403, "app-1", None),
            ("upload", 201, "ops", "alpha"), ("delete", 403, "app-1", "alpha"),
            ("compile", 202, "ops", "comp"), ("compiled", "served", "ops", "comp"),
            ("delete", 200, "ops", "alpha"), ("delete", 404, "ops", "nope")])), seen
        assert [x for x in seen if x[0] != "compiled"][:5] == [
            ("add", 403, "app-1", None), ("add", 403, "app-1", None),
            ("upload", 201, "ops", "alpha"), ("delete", 403, "app-1", "alpha"),
            ("compile", 202, "ops", "comp")]
        upload_line = got[2]
        assert len(upload_line["digest"]) == 16 and upload_line["bytes"] > 1000
        # every line has the same fields; a DELETE names the vector it deleted, whether it
        # was refused (by the gate, before the handler) or done
        assert len({tuple(sorted(set(x) - {"error"})) for x in got
                    if x["op"] != "compiled"}) == 1, got  # (a compile's end: its own)
        deletes = [x for x in got if x["op"] == "delete" and x["name"] == "alpha"]
        assert [x["digest"] for x in deletes] == [upload_line["digest"]] * 2, deletes
        assert upload_line["client"] == "127.0.0.1"
        text = audit.read_text()
        assert admin not in text and user not in text  # no secret in it
        assert "\n" not in got[-1]["error"] and "no task" in got[-1]["error"]
        keys_change_without_a_restart(url, keys, admin, user, log)
    finally:
        stop(proc, log)


def answered(url: str, path: str, key: str, want: int, method: str = "GET",
             seconds: float = 10.0) -> None:
    """`method path` with `key` answers `want` within `seconds` (the server reads its keys
    file again at most every LTV_VLLM_KEYS_POLL = 1 s); each try is a real request."""
    end = time.time() + seconds
    while True:
        r = HTTP.request(method, f"{url}{path}", headers={"Authorization": f"Bearer {key}"},
                         timeout=60)
        if r.status_code == want or time.time() > end:
            assert r.status_code == want, (path, r.status_code, r.text)
            return
        time.sleep(0.1)


def keys_change_without_a_restart(url, keys, admin, user, log):
    """`keys add | rotate | revoke` and an expiry reach the running server within its poll;
    a metrics key only scrapes; a keys file that stops reading keeps the keys read before."""
    from ltv_vllm.serving.contract.keys import revoke_key, rotate_key

    prom = add_key(keys, "prom", "metrics")  # added after the start
    answered(url, "/metrics", prom, 200)
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("GET", "/v1/ltv/tasks"), ("POST", "/tokenize")):
        answered(url, path, prom, 403, method, seconds=0)
    new = rotate_key(keys, "app-1")  # the old key goes, the new one answers
    answered(url, "/v1/models", user, 401)
    answered(url, "/v1/models", new, 200, seconds=0)
    revoke_key(keys, "app-1")
    answered(url, "/v1/models", new, 401)
    ends = int(time.time()) + 6
    soon = add_key(keys, "brief", "inference", expires=ends)
    answered(url, "/v1/models", soon, 200, seconds=ends - time.time() - 1)
    answered(url, "/v1/models", soon, 401, seconds=ends - time.time() + 10)  # once it expires
    keys.write_text("{not json")  # a broken file: the keys read before stay in force
    end = time.time() + 15
    while "the keys read before stay in force" not in Path(log.name).read_text():
        # each request makes the gate look (at most once a poll); the log line says it read
        # the broken file (it arrives through a pipe, so after the answer)
        answered(url, "/v1/models", admin, 200, seconds=0)
        assert time.time() < end, "the broken keys file was never reported"
    answered(url, "/v1/models", admin, 200, seconds=0)
    answered(url, "/metrics", prom, 200, seconds=0)
    answered(url, "/v1/models", new, 401, seconds=0)
