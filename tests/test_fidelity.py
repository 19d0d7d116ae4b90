"""Live fidelity (`serve --fidelity-sample`): a task's answered completion requests re-asked
with the ICL prompt its vector replaces, and the KL between the two next-token
distributions exported per task.

Through a real server in vLLM's default process layout, on a vector compiled from
demonstrations: on the held-out queries it was scored on, the live KL is the extraction's
own d_NTP, and each request's KL and argmax agreement are those of a hand computation with
transformers (the ICL prompt's forward; the zero-shot forward with the shift added by hand);
another task's prompts move it far away. The re-asks are not counted as the task's requests.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from test_server import HTTP, make_assets, start_server, stop
from test_task_metrics import FIDELITY_NAMES, dashboard_names

from ltv_vllm.core.vector import VectorError, load_task_vector
from ltv_vllm.serving.api_server.fidelity import teacher_of
from ltv_vllm.serving.store.compile import compile_task, parse_request
from ltv_vllm.serving.store.taskstore import TaskStore

pytestmark = pytest.mark.slow(seconds=70)  # see conftest's ordering

TASK = {"in_prefix": "Review", "label_prefix": "Sentiment", "labels": ["negative", "positive"],
        "instruction": "Rate the review."}
WORDS = ["the plot is dull", "a warm and funny film", "boring and slow", "great acting",
         "i loved it", "a waste of time", "fresh and bright", "flat and tired", "so good",
         "so bad", "the cast shines", "the script fails", "truly moving", "painfully dull",
         "a fine cast", "an awful mess", "sharp and witty", "a tedious bore", "bright fun",
         "dreary and grey", "the best of the year", "the worst film", "what a joy",
         "never again"]
TEST = [{"text": w, "label": TASK["labels"][i % 2]} for i, w in enumerate(WORDS[16:])]
# another task's prompts: what the vector was not fitted for
OTHER = [f"Question: {w}\nAnswer type:" for w in
         ("who wrote it", "where is the sea", "how far is the moon", "what is a cat",
          "when did it rain", "why is the sky blue", "which road is it", "how many eggs")]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    return make_assets(tmp_path_factory, tokenizer, tie=False)


def compiled(d, tokenizer, root) -> object:
    """The task compiled from demonstrations on the served model (transformers)."""
    req = parse_request({"name": "senti", "task": TASK,
                         "demos": [{"text": w, "label": TASK["labels"][i % 2]}
                                   for i, w in enumerate(WORDS[:4])],
                         "queries": WORDS[4:16], "test": TEST, "lam": 1.0},
                        tokenizer=tokenizer, max_model_len=256)
    compile_task(req, d, root, base_model=str(d))
    return TaskStore(root).get("senti").vector()


def by_hand(model, tokenizer, tv, prompts: list[str]) -> list[tuple[float, bool]]:
    """Each zero-shot prompt's KL(P_icl ‖ P_tv) over the label tokens, and whether the two
    put the same label first: the ICL prompt written out here from the file's demonstrations,
    transformers' forward of it, and its forward of the zero-shot prompt with U Vᵀ h added."""
    demos = "".join(f"Review: {e['text']}\nSentiment: {TASK['labels'][e['label']]}\n"
                    for e in tv.provenance.demonstrations[0])
    lead = TASK["instruction"] + "\n"
    labels = list(tv.label_token_ids)
    U, V = tv.U.double(), tv.V.double()
    out = []
    for p in prompts:
        query = p.removeprefix(lead)
        with torch.no_grad():
            ids = torch.tensor([tokenizer(lead + demos + query)["input_ids"]])
            z_icl = model(input_ids=ids).logits[0, -1, labels].double()
            ids = torch.tensor([tokenizer(p)["input_ids"]])
            h = model.model(input_ids=ids).last_hidden_state[0, -1].double()
            h_tv = h + U @ (V.T @ h)
            z_tv = (model.lm_head.weight.double() @ h_tv)[labels]
        lp, lq = z_icl - torch.logsumexp(z_icl, 0), z_tv - torch.logsumexp(z_tv, 0)
        kl = float(sum(math.exp(a) * (a - b) for a, b in zip(lp.tolist(), lq.tolist(),
                                                              strict=True)))
        out.append((kl, int(z_icl.argmax()) == int(z_tv.argmax())))
    return out


def off_span_by_hand(model, tokenizer, tv, prompts: list[str]) -> list[float]:
    """Each zero-shot prompt's ‖h − Q Qᵀ h‖ / ‖h‖ with transformers' final state h, Q an
    orthonormal basis of V's columns from numpy's SVD (not the engine's QR)."""
    import numpy as np

    u, sv, _ = np.linalg.svd(tv.V.double().numpy(), full_matrices=False)
    q = torch.from_numpy(u[:, sv > sv.max() * 1e-10])
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([tokenizer(p)["input_ids"]])
            h = model.model(input_ids=ids).last_hidden_state[0, -1].double()
        out.append(float(torch.linalg.vector_norm(h - q @ (q.T @ h)) / torch.linalg.vector_norm(h)))
    return out


def series(url: str) -> dict[str, float]:
    text = HTTP.get(f"{url}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("ltv_vllm:task_")}


def measured(url: str, task: str) -> float:
    return series(url).get(
        f'ltv_vllm:task_fidelity_samples_total{{outcome="measured",task="{task}"}}', 0.0)


def ask_each(url: str, model: str, prompts: list[str]) -> None:
    """One request at a time, each waiting for its re-ask to be measured (one is in flight
    at most: a request answered meanwhile would be dropped)."""
    for p in prompts:
        before = measured(url, model)
        r = HTTP.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": p, "max_tokens": 2, "temperature": 0.0})
        assert r.status_code == 200, r.text
        deadline = time.time() + 60
        while measured(url, model) == before:
            assert time.time() < deadline, series(url)
            time.sleep(0.05)


@pytest.mark.parametrize("served", ["store", "named", "fused", "fused-v2"])
def test_live_fidelity_through_a_server(served, assets, tokenizer, tmp_path):
    """A task-store task (in vLLM's default process layout), a command-line task by name, and
    one fused vector (on vLLM's V1 runner, and on V2), each with vLLM's default
    --max-logprobs: the label tokens are read through the engine's readout, whatever rank
    they have in the full vocabulary."""
    d, model, _ = assets
    root = tmp_path / "store"
    tv = compiled(d, tokenizer, root)
    path = TaskStore(root).get("senti").vector_path
    d_ntp = tv.provenance.metrics["ltv"]["d_ntp"]
    lead = TASK["instruction"] + "\n"
    matched = [f"{lead}Review: {e['text']}\nSentiment:" for e in TEST]
    want = by_hand(model.float().eval(), tokenizer, tv, matched + OTHER)
    spans = off_span_by_hand(model.float().eval(), tokenizer, tv, matched)
    # the reference the file records: the same share over the held-out queries it was
    # scored on (these very prompts)
    assert tv.provenance.metrics["ltv"]["off_span"] == pytest.approx(sum(spans) / len(spans),
                                                                      rel=1e-4)
    flags = ("--fidelity-sample", "1")  # vLLM's default --max-logprobs (20)
    fast = {"LTV_VLLM_SHIFT_READ": "0.2"}  # the engine's sums read every 0.2 s
    served, _, v2 = served.partition("-")
    if served == "store":
        proc, url, log = start_server(d, [], tmp_path, (
            "--task-store", str(root), "--allow-unauthenticated", *flags), layout="default",
            env_extra=fast)
    else:
        proc, url, log = start_server(d, [f"senti={path}" if served == "named" else str(path)],
                                      tmp_path, flags, runner="1" if v2 else None,
                                      env_extra=fast)
    name = "senti"  # a fused vector's server is named after its task too
    kl_sum = f'ltv_vllm:task_fidelity_kl_sum{{task="{name}"}}'
    kl_count = f'ltv_vllm:task_fidelity_kl_count{{task="{name}"}}'
    agree = f'ltv_vllm:task_fidelity_agreements_total{{task="{name}"}}'
    try:
        ask_each(url, name, matched)
        got = series(url)
        assert got[kl_count] == len(matched)
        live = got[kl_sum] / got[kl_count]
        # the held-out queries it was scored on: the extraction's own d_NTP, and each
        # request's KL (summed) and agreement those of the hand computation
        assert live == pytest.approx(d_ntp, rel=1e-3, abs=1e-6), (live, d_ntp)
        hand = want[:len(matched)]
        assert got[kl_sum] == pytest.approx(sum(k for k, _ in hand), rel=1e-3, abs=1e-6)
        assert got[agree] == sum(a for _, a in hand)
        assert got[f'ltv_vllm:task_extraction_d_ntp{{task="{name}"}}'] == pytest.approx(d_ntp)
        # the drift statistic: each re-ask's off-span share, summed in the engine, equal to
        # the hand computation's; the file's reference beside it
        span_sum = f'ltv_vllm:task_off_span_sum{{task="{name}"}}'
        span_count = f'ltv_vllm:task_off_span_count{{task="{name}"}}'
        deadline = time.time() + 30
        while series(url).get(span_count, 0) < len(matched):
            assert time.time() < deadline, series(url)
            time.sleep(0.1)
        got = series(url)
        assert got[span_count] == len(matched)
        assert got[span_sum] == pytest.approx(sum(spans), rel=1e-4), (got[span_sum], spans)
        assert got[f'ltv_vllm:task_extraction_off_span{{task="{name}"}}'] == pytest.approx(
            tv.provenance.metrics["ltv"]["off_span"])
        # another task's prompts: far from it
        ask_each(url, name, OTHER)
        after = series(url)
        mismatched = (after[kl_sum] - got[kl_sum]) / (after[kl_count] - got[kl_count])
        hand_other = want[len(matched):]
        assert mismatched == pytest.approx(sum(k for k, _ in hand_other) / len(OTHER),
                                           rel=1e-3, abs=1e-6)
        assert mismatched > 4 * d_ntp, (mismatched, d_ntp)  # 0.179 against 0.036 here
        # the re-asks are not the task's traffic
        assert after[f'ltv_vllm:task_requests_total{{policy="first",task="{name}"}}'] == \
            len(matched) + len(OTHER)
        assert not any(k.startswith("ltv_vllm:task_fidelity_samples_total")
                       and 'outcome="measured"' not in k for k in after), after
        # the dashboard's fidelity panels query series this server exports
        exported = {k.partition("{")[0] for k in after}
        assert FIDELITY_NAMES <= exported, sorted(FIDELITY_NAMES - exported)
        assert FIDELITY_NAMES <= dashboard_names()
    finally:
        stop(proc, log)


def test_a_server_that_cannot_read_the_labels_says_why(assets, tokenizer, tmp_path):
    """`--max-logprobs 1` and a two-label task: no readout can return an anchor and another
    label, so every re-ask is `incomplete` (never a guessed value), the log says why once,
    and the task's `/v1/models` card carries the reason."""
    d, _, _ = assets
    tv = compiled(d, tokenizer, tmp_path / "store")
    path = tv.save(tmp_path / "senti.pt")
    # (the start-up self-check reads two log-probabilities per step: skipped at N = 1)
    proc, url, log = start_server(d, [str(path)], tmp_path,
                                  ("--fidelity-sample", "1", "--max-logprobs", "1",
                                   "--skip-selfcheck"))
    key = 'ltv_vllm:task_fidelity_samples_total{outcome="incomplete",task="senti"}'
    try:
        lead = TASK["instruction"] + "\n"
        for e in TEST[:3]:
            before = series(url).get(key, 0.0)
            r = HTTP.post(f"{url}/v1/completions", timeout=120, json={
                "model": "senti", "prompt": f"{lead}Review: {e['text']}\nSentiment:",
                "max_tokens": 2, "temperature": 0.0})
            assert r.status_code == 200, r.text
            deadline = time.time() + 60
            while series(url).get(key, 0.0) == before:
                assert time.time() < deadline, series(url)
                time.sleep(0.05)
        got = series(url)
        assert got[key] == 3 and not any("measured" in k for k in got if "samples" in k)
        cards = {c["id"]: c for c in HTTP.get(f"{url}/v1/models").json()["data"]}
        why = cards["senti"]["ltv"]["fidelity"]["incomplete"]
        assert "2 labels" in why and "--max-logprobs" in why, why
    finally:
        stop(proc, log)
    lines = [ln for ln in open(log.name).read().splitlines()
             if "cannot measure task 'senti'" in ln]
    assert len(lines) == 1 and why in lines[0], lines


def test_the_teacher_a_vector_records(assets, tokenizer, tmp_path):
    """The ICL prompt a server builds around a request's prompt is the extraction's own
    (`Task.icl_prompt` of the file's first demonstration set), with or without the
    instruction line in front; a file without demonstrations has none; a malformed
    demonstration is refused when the file is read."""
    from ltv_vllm.tasks.data import Example
    from ltv_vllm.tasks.specs import task_from_dict

    d, _, vecs = assets
    tv = compiled(d, tokenizer, tmp_path / "store")
    teacher = teacher_of(tv)
    task = task_from_dict(tv.provenance.task)
    demos = [Example(e["text"], e["label"]) for e in tv.provenance.demonstrations[0]]
    assert [e["text"] for e in tv.provenance.demonstrations[0]] == WORDS[:4]
    for text in ("so good", "a dull film"):
        want = task.icl_prompt(task.demos_text(demos), text)
        assert teacher.prompt(task.zero_shot(text)) == want
        assert teacher.prompt(task.query(text)) == want
    assert teacher.labels == tv.label_token_ids
    assert teacher.d_ntp == tv.provenance.metrics["ltv"]["d_ntp"]
    assert teacher_of(vecs["alpha"][0]) is None  # made by hand: no demonstrations
    meta = tv.provenance.to_dict()
    for bad in ([], [[]], [[{"text": 1, "label": 0}]], [[{"text": "a", "label": True}]],
                [[{"text": "a", "label": 0, "x": 1}]]):
        with pytest.raises(VectorError, match="meta.demonstrations"):
            type(tv.provenance).from_dict({**meta, "demonstrations": bad})
    assert load_task_vector(tv.save(tmp_path / "v.pt")).provenance.demonstrations == \
        tv.provenance.demonstrations


def test_the_sampler_keeps_one_re_ask_in_flight(monkeypatch):
    """At most one re-ask in flight: an offer meanwhile is dropped and counted; a share of 0.5
    re-asks about half the offers; a task unserved before its re-ask starts is not re-asked,
    and a re-ask is counted in flight under its task's engine key until it ends."""
    import asyncio
    import random
    from types import SimpleNamespace

    from ltv_vllm.serving.api_server import fidelity as fid
    from ltv_vllm.serving.api_server.registry import TaskRegistry

    counted: list = []
    monkeypatch.setattr(fid.metrics, "fidelity",
                        lambda _name, outcome, *_: counted.append(outcome))
    monkeypatch.setattr(fid.metrics, "fidelity_baseline", lambda *_: None)
    cfg = SimpleNamespace(max_logprobs=20, hf_config=SimpleNamespace(), get_vocab_size=lambda: 9)
    engine = SimpleNamespace(model_config=cfg, vllm_config=SimpleNamespace())
    registry = TaskRegistry()
    registry.serve("t", "t@abc")

    async def run() -> None:
        gate = asyncio.Event()
        sampler = fid.LiveFidelity(engine, registry, 1.0, random.Random(0))
        held: list = []

        async def teacher(key):
            held.append(registry.held(key))
            await gate.wait()
            return None  # no demonstrations: counted as unsupported

        sampler._teacher = teacher
        probe = fid.Probe("t@abc", "t", "p", {})
        sampler.offer(probe)
        await asyncio.sleep(0)
        sampler.offer(probe)  # one in flight: dropped
        gate.set()
        await sampler.busy
        assert counted == ["dropped", "unsupported"] and held == [1]
        assert registry.held("t@abc") == 0
        registry.unserve("t")
        sampler.offer(probe)  # unserved: not re-asked
        assert sampler.busy.done() and counted == ["dropped", "unsupported"]
        sampler.rate = 0.5
        registry.serve("t", "t@abc")
        n = 0
        for _ in range(400):
            sampler.offer(probe)
            n += not sampler.busy.done()
            await sampler.busy
        assert 160 < n < 240, n

    asyncio.run(run())


@pytest.mark.parametrize("flags,words", [
    (("--fidelity-sample", "1.5"), "0..1"),
    (("--fidelity-sample", "0.1", "--no-task-metrics"), "without --no-task-metrics"),
    (("--fidelity-sample", "0.1", "--fold"), "not with --fold"),
    # not fidelity's: the start-up self-check reads two log-probabilities a step
    (("--max-logprobs", "1"), "--max-logprobs 1: the start-up self-check"),
    (("--max-logprobs=0", "--fidelity-sample", "1"), "or --skip-selfcheck"),
])
def test_fidelity_sample_refused_where_it_cannot_work(flags, words, tmp_path):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    r = CliRunner().invoke(main, ["serve", "--task-vector", str(tmp_path / "v.pt"), *flags,
                                  "--dry-run"])
    assert r.exit_code != 0 and words in r.output, r.output


def test_the_engine_readout_is_the_restricted_distribution():
    """`restrict` (the engine's readout, after the shift): every token but the kept ones at
    −inf, so the row's log-softmax is the softmax over the kept tokens alone, as d_NTP reads
    it; other rows untouched; ids outside the vocabulary dropped."""
    from ltv_vllm.core.metrics import restricted_log_probs
    from ltv_vllm.serving.engine.steps import restrict

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 4
    before = logits.clone()
    labels = (7, 31, 2)
    out = restrict(logits, {1: labels, 2: (9, 10_000)})
    lp = torch.log_softmax(out[1].double(), -1)
    torch.testing.assert_close(lp[list(labels)],
                               restricted_log_probs(before[1, list(labels)].double()))
    assert torch.isinf(lp).sum() == 50 - len(labels)
    torch.testing.assert_close(out[0], before[0])
    assert out[2, 9] == before[2, 9] and torch.isinf(out[2]).sum() == 49


@pytest.mark.parametrize("top,asks", [(20, 1), (4, 3), (2, 9), (9, 2), (1, 0), (0, 0)])
def test_more_labels_than_max_logprobs_are_read_in_chunks(top, asks, monkeypatch, caplog):
    """Ten labels on a server returning `top` log-probabilities per token: read in chunks
    sharing one anchor label, each side's label distribution is the exact restricted one
    (against a direct log-softmax); below 2 nothing can be read: every re-ask is
    `incomplete`, said once in the log and kept with its reason."""
    import asyncio
    import random
    from types import SimpleNamespace

    from ltv_vllm.core.metrics import kl_per_query
    from ltv_vllm.serving.api_server import fidelity as fid
    from ltv_vllm.serving.api_server.registry import TaskRegistry
    from ltv_vllm.serving.contract.wire import READOUT_KEY

    counted: list = []
    monkeypatch.setattr(fid.metrics, "fidelity",
                        lambda _name, outcome, kl=None, agree=None: counted.append(
                            (outcome, kl, agree)))
    monkeypatch.setattr(fid.metrics, "fidelity_baseline", lambda *_: None)
    cfg = SimpleNamespace(max_logprobs=top, hf_config=SimpleNamespace(),
                          get_vocab_size=lambda: 64)
    engine = SimpleNamespace(model_config=cfg, vllm_config=SimpleNamespace())
    labels = (40, 3, 17, 8, 61, 22, 5, 33, 12, 50)
    g = torch.Generator().manual_seed(1)
    # the vector's side answers the client's prompt "tv"; the ICL side, "icl" + "tv"
    z = {"tv": torch.randn(64, generator=g) * 3, "icltv": torch.randn(64, generator=g) * 3}
    asked: list = []

    async def ask(prompt, xargs, top=None):
        # the engine: logits of that side, restricted to the readout, top-`top` returned
        ids = xargs[READOUT_KEY]
        asked.append((prompt, tuple(ids), top))
        assert top is not None and len(ids) <= top <= cfg.max_logprobs
        lp = torch.log_softmax(fid_restrict(z[prompt], ids), -1)
        best = torch.topk(lp, top).indices.tolist()
        return {t: float(lp[t]) for t in best}

    def fid_restrict(row, ids):
        out = torch.full_like(row, float("-inf"))
        out[list(ids)] = row[list(ids)]
        return out

    teacher = fid.Teacher(lead="", prefix="icl", labels=labels, d_ntp=None)

    async def run():
        sampler = fid.LiveFidelity(engine, TaskRegistry(), 1.0, random.Random(0))
        sampler._ask = ask

        async def teach(_key):
            return teacher

        sampler._teacher = teach
        for _ in range(2):
            sampler.offer(fid.Probe("", "t", "tv", {}))
            await sampler.busy
        return sampler

    sampler = asyncio.run(run())
    if asks == 0:
        assert [c[0] for c in counted] == ["incomplete", "incomplete"] and not asked
        assert "max-logprobs" in sampler.incomplete["t"]
        assert sum("cannot measure task 't'" in r.message for r in caplog.records) == 1
        return
    # per side and re-ask, `asks` chunks, each label read, the anchor in every chunk
    per = [a for a in asked if a[0] == "tv"][:asks]
    assert len(asked) == 4 * asks
    assert {t for _, c, _ in per for t in c} == set(labels)
    assert all(c[0] == labels[0] for _, c, _ in per)
    want = float(kl_per_query(z["icltv"][list(labels)][None].double(),
                              z["tv"][list(labels)][None].double())[0])
    agree = int(z["icltv"][list(labels)].argmax()) == int(z["tv"][list(labels)].argmax())
    assert [c[0] for c in counted] == ["measured", "measured"]
    assert counted[0][1] == pytest.approx(want, rel=1e-5) and counted[0][2] == agree


def test_the_drift_alert_replayed_on_recorded_re_asks():
    """docs/operating.md's drift rule (its threshold and minimum count read from the page)
    replayed on the committed re-asks of benchmarks/fidelity_signal.py (SmolLM2-135M; trec,
    sst2, agnews; two fits): in consecutive windows of the minimum count, each window's mean
    off-span share over the vector file's own reference. Quiet on every window of a task's
    own queries, firing on every window of another task's texts. A threshold of 1.2 or 1.45
    in the page fails it."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    page = (root / "docs" / "operating.md").read_text()
    rule = re.search(r"increase\(ltv_vllm:task_off_span_sum\[30m\]\)\)[\s\S]*?> ([0-9.]+) \* "
                     r"max by \(task\) \(ltv_vllm:task_extraction_off_span\)[\s\S]*?"
                     r"task_off_span_count\[30m\]\)\) >= (\d+)", page)
    assert rule, "the drift rule is not in docs/operating.md"
    ratio, window = float(rule.group(1)), int(rule.group(2))
    folder = root / "benchmarks" / "results" / "fidelity_signal_smollm2-135m"
    doc = json.loads((folder / "results.json").read_text())
    refs = {(r["task"], r["fit"]): r["extraction_off_span"] for r in doc["rows"]}
    seen = {True: 0, False: 0}
    for rec in json.loads((folder / "records.json").read_text()):
        ref = refs[(rec["task"], rec["fit"])]
        for src, per in rec["per_request"].items():
            xs = per["off_span"]
            for i in range(0, len(xs) - window + 1, window):
                fires = sum(xs[i:i + window]) / window > ratio * ref
                matched = src == rec["task"]
                assert fires != matched, (rec["task"], rec["fit"], src, i)
                seen[matched] += 1
    assert seen[True] >= 60 and seen[False] >= 120, seen
