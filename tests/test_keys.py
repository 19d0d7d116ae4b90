"""Keys with roles and the task store's audit log, through the real server
(`serve --task-store --api-keys FILE --audit-log FILE`): an inference key answers
completions and lists, and is refused (403) every change of the store; an admin key makes
them; every store operation — the refused ones too — is one JSON line with the key's id,
never a key."""

from __future__ import annotations

import json
import time

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
                       ({"keys": [{"id": "a", "role": "admin"}]}, "exactly")]:
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
        assert upload_line["client"] == "127.0.0.1"
        text = audit.read_text()
        assert admin not in text and user not in text  # no secret in it
        assert "\n" not in got[-1]["error"] and "no task" in got[-1]["error"]
    finally:
        stop(proc, log)
