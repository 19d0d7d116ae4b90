"""Per-task metrics through the real server (`serve --task-store file://DIR`): a known mix of
requests (two tasks, every step-policy label, a stream, n = 2, bare-model requests), refused
shapes and store operations is sent, then vLLM's `/metrics` is scraped. Every counter equals
what was sent (generated tokens from `max_tokens` with `ignore_eos`; shifted ones from each
request's policy, counted by hand); each histogram counted each request once; the residency
names the one task left with its rank and size; the audit log has one line per store
operation; the Grafana dashboard queries only metrics this server exports. In vLLM's default
process layout (the worker in a process of its own, as users run it) and in-process."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
import torch
from test_replicas import metric
from test_server import HTTP, PROMPTS, make_assets, start_server, stop
from test_store_server import random_vector

from ltv_vllm.serving.contract.keys import SINGLE_KEY_ID

pytestmark = pytest.mark.slow(seconds=170)  # see conftest's ordering

KEY = {"Authorization": "Bearer x"}
DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "ltv-vllm-dashboard.json"
# the dashboard's live fidelity series: exported by a server that samples (`test_fidelity`)
FIDELITY_NAMES = frozenset({"ltv_vllm:task_fidelity_kl_sum", "ltv_vllm:task_fidelity_kl_count",
                            "ltv_vllm:task_fidelity_agreements_total",
                            "ltv_vllm:task_fidelity_samples_total",
                            "ltv_vllm:task_extraction_d_ntp",
                            "ltv_vllm:task_off_span_sum", "ltv_vllm:task_off_span_count",
                            "ltv_vllm:task_extraction_off_span"})


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def dashboard_names() -> set[str]:
    """Every metric name the Grafana dashboard queries."""
    return set(re.findall(r"\b((?:ltv_vllm|vllm):[a-z_:]+)", " ".join(dashboard_exprs())))


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    return make_assets(tmp_path_factory, tokenizer, tie=False)


def samples(url: str, headers=KEY) -> dict[str, list]:
    """Every sample of `/metrics`: name → [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list] = {}
    for family in text_string_to_metric_families(HTTP.get(f"{url}/metrics",
                                                          headers=headers).text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(got: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples with these labels (0 when none)."""
    return sum(v for lab, v in got.get(name, []) if all(lab.get(k) == w
                                                        for k, w in labels.items()))


def wait_for(url: str, name: str, task: str, want: float, headers=KEY) -> dict[str, list]:
    """`/metrics` once `name{task}` reads `want` (the engine's sums are read every 0.2 s)."""
    deadline = time.time() + 20
    while True:
        got = samples(url, headers)
        if value(got, name, task=task) == want or time.time() > deadline:
            assert value(got, name, task=task) == want, (name, task, got.get(name))
            return got
        time.sleep(0.1)


def shift_size_sum(model, tokenizer, tv, prompts: list[str]) -> float:
    """The oracle of a one-token request per prompt's shift sizes: Σ ‖U Vᵀ h‖ / ‖h‖ over
    transformers' final hidden states at the prompts' last tokens."""
    want = 0.0
    for p in prompts:
        with torch.no_grad():
            ids = tokenizer(p, return_tensors="pt")
            h = model(**ids, output_hidden_states=True).hidden_states[-1][0, -1].float()
        want += float(torch.linalg.vector_norm(tv.delta(h[None])) / torch.linalg.vector_norm(h))
    return want


def assert_quiet(log) -> None:
    """The server's log so far (read before `stop`, whose shutdown logs errors of its own):
    no traceback and no error line, from the shift reader (its warning; vLLM's worker and
    engine core failing its call) or anything else."""
    text = Path(log.name).read_text(errors="replace")
    bad = [line for line in text.splitlines() if "Traceback" in line or " ERROR " in line
           or "shift sizes could not be read" in line]
    assert not bad, bad[:20]


# (runner, layout): vLLM's default layout on both runners (the worker in a process of its
# own, as users run it), and in-process (the executor the other server tests use)
LAYOUTS = [("0", "default"), ("1", "default"), ("0", "inproc")]


@pytest.mark.parametrize(("runner", "layout"), LAYOUTS, ids=["v1", "v2", "v1-inproc"])
def test_every_counter_is_what_was_sent(assets, tokenizer, tmp_path, runner, layout):
    """On both of vLLM's runners (V2 shifts by a row mask: the engine's sums count its
    shifted rows only), in vLLM's default process layout and in-process."""
    d, model, vecs = assets
    alpha_tv = random_vector(vecs["alpha"][0], 8, 21)
    alpha = alpha_tv.save(tmp_path / "alpha.pt")
    beta = random_vector(vecs["alpha"][0], 8, 22).save(tmp_path / "beta.pt")
    audit = tmp_path / "audit.jsonl"
    proc, url, log = start_server(d, [], tmp_path, (
        "--task-store", f"file://{tmp_path / 'shared'}", "--api-key", "x", "--max-body-mib", "1",
        "--audit-log", str(audit)), env_extra={"LTV_VLLM_SHIFT_READ": "0.2"}, runner=runner,
        layout=layout)
    try:
        def upload(name: str, path: Path) -> int:
            return HTTP.post(f"{url}/v1/ltv/tasks", data={"name": name}, headers=KEY,
                             files={"vector": (path.name, path.read_bytes())}).status_code

        def complete(model: str, n_tokens: int, steps=None, **extra) -> httpx.Response:
            xargs = {"ltv_steps": steps} if steps is not None else {}
            return HTTP.post(f"{url}/v1/completions", headers=KEY, timeout=120, json={
                "model": model, "prompt": PROMPTS[0], "max_tokens": n_tokens,
                "ignore_eos": True, "temperature": 0.0, **extra,
                **({"vllm_xargs": xargs} if xargs else {})})

        assert [upload("alpha", alpha), upload("beta", beta), upload("beta", alpha)] == [
            201, 201, 409]
        # alpha at its vector's policy (these vectors record none: every step), 3 × 4 tokens
        for _ in range(3):
            assert complete("alpha", 4).status_code == 200
        # alpha, the first token only: 2 × 4 tokens, one request with 2 choices of 3
        for _ in range(2):
            assert complete("alpha", 4, "first").status_code == 200
        r = complete("alpha", 3, 1, n=2, temperature=1.0, seed=1)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        # a stream (the engine sends deltas): 6 tokens, the first shifted
        with HTTP.stream("POST", f"{url}/v1/completions", headers=KEY, timeout=120, json={
                "model": "alpha", "prompt": PROMPTS[1], "max_tokens": 6, "ignore_eos": True,
                "stream": True, "vllm_xargs": {"ltv_steps": "first"}}) as s:
            assert s.status_code == 200
            events = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert len(events) >= 1
        # beta, the first 2 tokens of 5, twice
        for _ in range(2):
            assert complete("beta", 5, 2).status_code == 200
        for _ in range(2):  # the bare model: not a task's
            assert complete(str(d), 2).status_code == 200
        # refused: beam search (2), an unknown task, no key, a chat to a completion-fitted
        # vector, a body over the limit
        for _ in range(2):
            assert complete("alpha", 2, use_beam_search=True, n=2).status_code == 400
        assert complete(str(d), 2, vllm_xargs={"ltv_task": "nope"}).status_code == 400
        assert httpx.post(f"{url}/v1/completions", json={"model": "alpha"}).status_code == 401
        assert HTTP.post(f"{url}/v1/chat/completions", headers=KEY, json={
            "model": "alpha", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}).status_code == 400
        assert HTTP.post(f"{url}/v1/completions", headers=KEY,
                         content=b"x" * (2 << 20)).status_code == 413
        assert HTTP.delete(f"{url}/v1/ltv/tasks/beta", headers=KEY).status_code == 200
        assert HTTP.delete(f"{url}/v1/ltv/tasks/nope", headers=KEY).status_code == 404

        got = samples(url)
        want_requests = {("alpha", "all"): 3, ("alpha", "first"): 4, ("beta", "k"): 2}
        want_generated = {("alpha", "all"): 12, ("alpha", "first"): 8 + 6 + 6,
                          ("beta", "k"): 10}
        want_shifted = {("alpha", "all"): 12, ("alpha", "first"): 2 + 2 + 1,
                        ("beta", "k"): 4}
        for name, want in [("ltv_vllm:task_requests_total", want_requests),
                           ("ltv_vllm:task_generation_tokens_total", want_generated),
                           ("ltv_vllm:task_shifted_tokens_total", want_shifted)]:
            seen = {(lab["task"], lab["policy"]): v for lab, v in got.get(name, []) if v}
            assert seen == want, (name, seen)
        for hist in ("ltv_vllm:task_request_seconds", "ltv_vllm:task_time_to_first_token_seconds"):
            assert value(got, f"{hist}_count", task="alpha") == 7
            assert value(got, f"{hist}_count", task="beta") == 2
            assert value(got, f"{hist}_bucket", task="alpha", le="+Inf") == 7
        assert 0 < value(got, "ltv_vllm:task_time_to_first_token_seconds_sum") <= value(
            got, "ltv_vllm:task_request_seconds_sum")
        refusals = {lab["reason"]: v for lab, v in got["ltv_vllm:refusals_total"] if v}
        assert refusals == {"beam_search": 2, "unknown_task": 1, "unauthorized": 1,
                            "rendering": 1, "too_large": 1}, refusals
        ops = {(lab["op"], lab["result"]): v
               for lab, v in got["ltv_vllm:store_operation_seconds_count"] if v}
        # (the unknown task was looked up in the shared store's index once: not there)
        assert ops == {("upload", "ok"): 2, ("upload", "refused"): 1, ("delete", "ok"): 1,
                       ("delete", "refused"): 1, ("resolve", "ok"): 1}, ops
        # what the replica holds: alpha alone, with its rank and file size
        assert {lab["task"]: v for lab, v in got["ltv_vllm:task_rank"]} == {"alpha": 8.0}
        digest = json.loads(HTTP.get(f"{url}/v1/models", headers=KEY).text)["data"]
        digest = next(c["ltv"]["digest"] for c in digest if c["id"] == "alpha")
        [obj] = (tmp_path / "shared" / "objects").glob(f"{digest}*.safetensors")
        size = obj.stat().st_size
        assert {lab["task"]: v for lab, v in got["ltv_vllm:task_bytes"]} == {"alpha": size}
        assert metric(url, "ltv_vllm:task_loaded", task="alpha") == 1.0
        # the shift's relative size, summed in the engine: one row per shifted token; its
        # sum, for a one-token request per prompt, is ‖U Vᵀ h‖ / ‖h‖ of transformers' final
        # hidden states at the prompts' last tokens
        size = "ltv_vllm:task_shift_relative_size"
        got = wait_for(url, f"{size}_count", "alpha", want_shifted[("alpha", "all")]
                       + want_shifted[("alpha", "first")])
        assert value(got, f"{size}_count", task="beta") == 0  # deleted: gone
        before = value(got, f"{size}_sum", task="alpha")
        for p in PROMPTS:
            assert HTTP.post(f"{url}/v1/completions", headers=KEY, timeout=60, json={
                "model": "alpha", "prompt": p, "max_tokens": 1}).status_code == 200
        got = wait_for(url, f"{size}_count", "alpha", want_shifted[("alpha", "all")]
                       + want_shifted[("alpha", "first")] + len(PROMPTS))
        want = shift_size_sum(model, tokenizer, alpha_tv, PROMPTS)
        assert value(got, f"{size}_sum", task="alpha") - before == pytest.approx(want, rel=1e-4)
        # the audit log: one line per store operation the server handled
        lines = [json.loads(line) for line in audit.read_text().splitlines()]
        assert [(x["op"], x["status"]) for x in lines] == [
            ("upload", 201), ("upload", 201), ("upload", 409), ("delete", 200),
            ("delete", 404)]
        assert {x["key"] for x in lines} == {SINGLE_KEY_ID}  # vLLM's --api-key: its id

        # the dashboard: valid JSON whose every query names metrics this server exports
        assert len(dashboard_exprs()) >= 8
        names = dashboard_names() - FIDELITY_NAMES  # those: `test_fidelity`'s server's
        assert names and names <= set(got), sorted(names - set(got))
        assert proc.poll() is None
        assert_quiet(log)  # in steady state: every read of the shift sizes answered
    finally:
        stop(proc, log)
