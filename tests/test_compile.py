"""Compiling demonstrations into a task-store entry: checks first, then the same ridge fit as
`extract`, checked against a direct solve on hand-computed states; the worker process."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import make_llama
from ltv_vllm.errors import UserError
from ltv_vllm.serving.store.compile import CompileError, compile_task, parse_request
from ltv_vllm.serving.store.taskstore import EntryExists, TaskStore

pytestmark = pytest.mark.slow(seconds=13)  # see conftest's ordering

TASK = {"in_prefix": "Review", "label_prefix": "Sentiment", "labels": ["negative", "positive"]}
WORDS = ["the plot is dull", "a warm and funny film", "boring and slow", "great acting",
         "i loved it", "a waste of time", "fresh and bright", "flat and tired", "so good",
         "so bad", "the cast shines", "the script fails", "truly moving", "painfully dull"]


def body(**over):
    b = {"name": "senti", "task": TASK,
         "demos": [{"text": WORDS[0], "label": "negative"},
                   {"text": WORDS[1], "label": "positive"},
                   {"text": WORDS[2], "label": "negative"},
                   {"text": WORDS[3], "label": "positive"}],
         "queries": WORDS[4:12], "test": [{"text": WORDS[12], "label": "positive"},
                                          {"text": WORDS[13], "label": "negative"}]}
    return {**b, **over}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("cm")
    make_llama(len(tokenizer), seed=21).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def test_compile_equals_a_direct_ridge_solve(model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    req = parse_request(body(lam=3.0), tokenizer=tokenizer, max_model_len=512)
    states = []
    rec = compile_task(req, model_dir, tmp_path / "store", base_model=str(model_dir),
                       status=lambda s, **_: states.append(s))
    assert states == ["loading model", "extracting", "writing"]
    assert rec["source"] == "compiled" and rec["k"] == 4 and rec["n"] == 8 and rec["lam"] == 3.0
    assert set(rec["metrics"]) == {"zero-shot", "icl", "ltv", "mean"}
    tv = TaskStore(tmp_path / "store").get("senti").vector()
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    prefix = "".join(f"Review: {d['text']}\nSentiment: {d['label']}\n" for d in body()["demos"])

    def h(p):
        with torch.no_grad():
            return model.model(input_ids=torch.tensor([tokenizer(p)["input_ids"]])
                               ).last_hidden_state[0, -1].double()

    h_zs = torch.stack([h(f"Review: {q}\nSentiment:") for q in WORDS[4:12]])
    h_icl = torch.stack([h(prefix + f"Review: {q}\nSentiment:") for q in WORDS[4:12]])
    d = h_zs.shape[1]
    w = torch.linalg.solve(h_zs.T @ h_zs + 3.0 * torch.eye(d, dtype=torch.float64),
                           h_zs.T @ (h_icl - h_zs)).T
    torch.testing.assert_close((tv.U @ tv.V.T).double(), w, atol=1e-4, rtol=1e-3)
    assert tv.provenance.task["labels"] == ["negative", "positive"]
    # without labelled test examples: an entry all the same, with nothing measured
    req = parse_request(body(name="quiet", test=[]), tokenizer=tokenizer, max_model_len=512)
    rec = compile_task(req, model_dir, tmp_path / "store", base_model=str(model_dir))
    assert rec["metrics"] in (None, {}) and rec["n_test"] == 0


def test_compile_with_a_teacher_fits_its_target(model_dir, tokenizer, tmp_path):
    """A compile body's teacher (batch calibration blended with the queries' gold labels):
    the entry's map is the ridge solve on the target made by hand (the calibrated, blended
    distribution from its formula; the least state change through the pseudo-inverse, the
    free constant in closed form), and the served file records the teacher."""
    from transformers import AutoModelForCausalLM

    from ltv_vllm.tasks.specs import label_token_ids

    gold = ["positive", "negative", "positive", "negative", "positive", "negative",
            "positive", "negative"]
    qs = [{"text": q, "label": y} for q, y in zip(WORDS[4:12], gold, strict=True)]
    req = parse_request(body(lam=3.0, queries=qs, teacher={"calibration": "batch",
                                                            "gold_weight": 0.5}),
                        tokenizer=tokenizer, max_model_len=512)
    assert req.to_dict()["queries"] == qs and req.to_dict()["teacher"]["gold_weight"] == 0.5
    compile_task(req, model_dir, tmp_path / "store", base_model=str(model_dir))
    entry = TaskStore(tmp_path / "store").get("senti")
    tv = entry.vector()
    assert tv.provenance.teacher["calibration"] == "batch"
    assert tv.provenance.teacher["gold_weight"] == 0.5
    # the entry (what a task's GET and `compile --wait` show) says what the vector imitates
    assert entry.record["teacher"] == tv.provenance.teacher
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    prefix = "".join(f"Review: {d['text']}\nSentiment: {d['label']}\n" for d in body()["demos"])

    def h(p):
        with torch.no_grad():
            return model.model(input_ids=torch.tensor([tokenizer(p)["input_ids"]])
                               ).last_hidden_state[0, -1].double()

    h_zs = torch.stack([h(f"Review: {q}\nSentiment:") for q in WORDS[4:12]])
    h_icl = torch.stack([h(prefix + f"Review: {q}\nSentiment:") for q in WORDS[4:12]])
    w_c = model.lm_head.weight[label_token_ids(req.task, tokenizer)].double()
    p = torch.softmax(h_icl @ w_c.T, -1)
    q = p / torch.exp(torch.log(p).mean(0))
    q = q / q.sum(1, keepdim=True)
    onehot = torch.nn.functional.one_hot(torch.tensor([("negative", "positive").index(y)
                                                       for y in gold]), 2).double()
    q = 0.5 * q + 0.5 * onehot
    pinv = torch.linalg.pinv(w_c)
    a = (torch.log(q) - torch.log(p)) @ pinv.T  # pinv δ per query
    one = pinv @ torch.ones(2, dtype=torch.float64)
    c = -(a @ one) / (one @ one)
    target = h_icl + a + c[:, None] * one
    d = h_zs.shape[1]
    w = torch.linalg.solve(h_zs.T @ h_zs + 3.0 * torch.eye(d, dtype=torch.float64),
                           h_zs.T @ (target - h_zs)).T
    torch.testing.assert_close((tv.U @ tv.V.T).double(), w, atol=1e-4, rtol=1e-3)
    plain = torch.linalg.solve(h_zs.T @ h_zs + 3.0 * torch.eye(d, dtype=torch.float64),
                               h_zs.T @ (h_icl - h_zs)).T
    assert ((tv.U @ tv.V.T).double() - plain).abs().max() > 1e-3


@pytest.mark.parametrize("over,words", [
    ({"name": "../x"}, "task name"),
    ({"colour": 1}, "unknown field 'colour'"),
    ({"demos": [{"text": "a", "label": "negative"}]}, "no demonstration of 'positive'"),
    ({"demos": [{"text": "a", "label": "meh"}]}, "label 'meh' is not one of"),
    ({"demos": [{"text": "", "label": "negative"}]}, "demos[0].text: a non-empty string"),
    ({"demos": "abc"}, "demos: a list"),
    ({"queries": []}, "queries: a non-empty list"),
    ({"queries": [3]}, "queries[0]: a non-empty string"),
    ({"task": {**TASK, "labels": ["zq1", "zq2"]}}, "share their first token"),
    ({"task": {**TASK, "labels": ["negative"]}}, "at least two labels"),
    ({"task": {**TASK, "extra": 1}}, "in_prefix, label_prefix and labels, and optionally"),
    ({"lam": -1}, "lam: a positive finite number or \"auto\", got -1"),
    ({"lam": True}, "lam: a positive finite number or \"auto\", got true"),
    ({"lam": float("inf")}, "got Infinity"),
    ({"lam": 10**400}, "got 1000000000000000000000000000000000000..."),
    ({"test": [{"text": "x"}]}, "test[0]: an object with exactly"),
    ({"queries": ["word " * 400]}, "served context is 512 tokens"),
    ({"teacher": ["batch"]}, "teacher: an object with calibration"),
    ({"teacher": {"calibration": "loud"}}, "teacher: calibration must be one of icl, batch"),
    ({"teacher": {"gold_weight": 1}}, "teacher: gold_weight must be in [0, 1)"),
    ({"teacher": {"gold_weight": 0.5, "gold_share": "all"}}, "teacher: gold_share must be in"),
    ({"teacher": {"gold_weight": 0.5}}, "queries[0]: an object with exactly \"text\" and"),
])
def test_bad_requests_are_refused_in_one_line(tokenizer, over, words):
    b = body(**over)
    with pytest.raises(UserError) as e:
        parse_request(b, tokenizer=tokenizer, max_model_len=512)
    assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CompileError, match="missing field 'queries'"):
        parse_request({k: v for k, v in body().items() if k != "queries"}, tokenizer=tokenizer,
                      max_model_len=512)


def _job(tmp_path, model_dir, request, name="job"):
    job = tmp_path / name
    job.mkdir()
    (job / "job.json").write_text(json.dumps({
        "request": request, "model_dir": str(model_dir), "store": str(tmp_path / "store"),
        "base_model": str(model_dir), "max_model_len": 512, "threads": 1}))
    return job


def test_worker_process_reports_done_or_failed_and_a_killed_one_leaves_no_entry(
        model_dir, tmp_path):
    job = _job(tmp_path, model_dir, body())
    r = subprocess.run([sys.executable, "-m", "ltv_vllm.serving.store.compile", str(job)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    st = json.loads((job / "status.json").read_text())
    assert st["state"] == "done" and st["record"]["name"] == "senti"
    # the worker only stages: the entry appears when the server publishes it
    store = TaskStore(tmp_path / "store")
    assert store.names() == [] and (job / "entry" / "entry.json").is_file()
    assert store.publish(job / "entry", "senti").record == st["record"]
    assert store.names() == ["senti"]
    # the name is taken now: the second worker's entry is refused at publication
    again = _job(tmp_path, model_dir, body(), "again")
    r = subprocess.run([sys.executable, "-m", "ltv_vllm.serving.store.compile", str(again)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with pytest.raises(EntryExists, match="already exists"):
        store.publish(again / "entry", "senti")
    assert not (again / "entry").exists() and store.names() == ["senti"]
    # killed while extracting: no entry, nothing in the store at all
    # (2400 queries: seconds of extraction, so the kill lands inside it)
    killed = _job(tmp_path, model_dir, body(name="other", queries=WORDS * 200), "killed")
    p = subprocess.Popen([sys.executable, "-m", "ltv_vllm.serving.store.compile", str(killed)])
    state = None
    deadline = time.time() + 120
    while state != "extracting":  # the kill must land inside the extraction, nowhere else
        assert state not in ("writing", "done", "failed") and time.time() < deadline, state
        assert p.poll() is None
        time.sleep(0.02)
        if (killed / "status.json").exists():
            state = json.loads((killed / "status.json").read_text())["state"]
    p.kill()
    assert p.wait() == -9  # killed, not finished
    assert not (killed / "entry" / "entry.json").exists()
    assert store.names() == ["senti"]
    assert sorted(x.name for x in store.root.iterdir()) == ["senti"]


def test_data_episode_files_are_the_episode_extract_fits_on(tmp_path, tokenizer):
    """`data episode` writes what `compile` sends; read back (as the CLI and the server do),
    they are the demos and queries of `extract`'s episode for the same k, N and seed."""
    from click.testing import CliRunner

    from ltv_vllm.cli import compile_request, main
    from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
    from ltv_vllm.tasks.specs import get_task

    r = CliRunner().invoke(main, ["data", "episode", "sst2", "--k", "4", "--n", "8",
                                  "--n-test", "2", "--seed", "3", "-o", str(tmp_path / "ep")])
    assert r.exit_code == 0, r.output
    files = {p: str(tmp_path / "ep" / f"{p}.jsonl") for p in ("demos", "queries", "test")}
    req = parse_request(compile_request("s", "sst2", files["demos"], files["queries"],
                                        files["test"], 5.0),
                        tokenizer=tokenizer, max_model_len=100_000)
    ep = plan_episode(get_task("sst2"), ExtractOptions(k=4, n=8, n_test=2, seed=3))
    assert req.demos == ep.demos and req.test == ep.test
    assert req.queries == tuple(e.text for e in ep.queries)
    assert req.episode().demo_prefix() == ep.demo_prefix()
    assert req.teacher.is_default  # a teacher only where it is asked for or defaulted
    # `compile` without --gold-weight: the files' labels blended in, as `extract` does
    auto = compile_request("s", "sst2", files["demos"], files["queries"], None, 5.0,
                           auto_gold=True)
    assert auto["teacher"] == {"calibration": "icl", "gold_weight": 0.8, "gold_share": 1.0}
    req = parse_request(auto, tokenizer=tokenizer, max_model_len=100_000)
    assert req.query_labels == tuple(e.label for e in ep.queries)
    # queries without labels: the prompt itself
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"text": e.text}) + "\n" for e in ep.queries))
    assert "teacher" not in compile_request("s", "sst2", files["demos"], str(bare), None, 5.0,
                                            auto_gold=True)
    r = CliRunner().invoke(main, ["data", "episode", "sst2", "-o", str(tmp_path / "none")])
    assert r.exit_code == 0 and not (tmp_path / "none" / "test.jsonl").exists()
