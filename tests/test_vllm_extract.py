"""`extract --engine vllm`: the states vLLM's pooling runner captures give the same vectors,
accuracy and d_NTP as the transformers path (float32, tiny random Llama), at TP 1 and TP 2;
the vector file records the engine; inner-layer methods and impossible plans are refused
before anything loads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from conftest import make_vllm_llama, write_toy_task
from ltv_vllm.cli import main
from ltv_vllm.core.vector import load_task_vector
from ltv_vllm.models.loading import load_model
from ltv_vllm.pipeline.extract import ExtractOptions, extract, plan_episode
from ltv_vllm.serving.offline.capture import CaptureEngine, captured_model
from ltv_vllm.tasks.specs import get_task

pytestmark = pytest.mark.slow(seconds=31)  # see conftest's ordering

WORDS = ["the", "plot", "is", "dull", "and", "acting", "worse", "a", "gorgeous", "witty",
         "seductive", "movie", "team", "wins", "final"]
OPTS = ExtractOptions(k=6, n=24, lam=5.0, seed=3, n_test=20, batch_size=5, progress=False)
METHODS = ("ltv", "kernel", "mean", "mlp")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("vllm-llama")
    make_vllm_llama(tokenizer, seed=11, tie=False).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    return write_toy_task(tmp_path_factory.mktemp("task"), WORDS)


@pytest.fixture(scope="module")
def task(task_file):
    return get_task(str(task_file))


def on_vllm(model_dir, task, work, tp: int = 1):
    engine = CaptureEngine(dtype="float32", tensor_parallel_size=tp, enforce_eager=True,
                           max_model_len=1024)
    return captured_model("m", str(model_dir), [plan_episode(task, OPTS)], engine, work)


@pytest.fixture(scope="module")
def tp1(model_dir, task, tmp_path_factory):
    """The episode captured at TP 1 (one engine job, read by two tests)."""
    return on_vllm(model_dir, task, tmp_path_factory.mktemp("tp1"))


def test_vllm_states_give_the_transformers_vectors_and_scores(model_dir, task, tp1):
    lm_t = load_model(str(model_dir), dtype="float32")
    lm_v, report = tp1
    assert report["icl_prompts"] == 44 and report["shape"] == [88, 128]  # 24 + 20 queries
    for method in METHODS:
        t = extract(lm_t, task, method, OPTS)
        v = extract(lm_v, task, method, OPTS)
        for name, m in t.metrics.items():  # the method and its references (zero-shot, ICL)
            assert v.metrics[name]["accuracy"] == m["accuracy"], (method, name)
            assert v.metrics[name]["d_ntp"] == pytest.approx(m["d_ntp"], abs=1e-5), (method, name)
        # the held-out logits themselves, not only what they sum to
        for name, z in t.label_logits.items():
            torch.testing.assert_close(v.label_logits[name], z, atol=2e-3, rtol=1e-4)
        assert v.artifact.provenance.engine["name"] == "vllm"
        assert t.artifact.provenance.engine["name"] == "transformers"
    # LTV's map itself: the same ridge solution from either engine's states
    a, b = extract(lm_t, task, "ltv", OPTS).artifact, extract(lm_v, task, "ltv", OPTS).artifact
    torch.testing.assert_close(b.U @ b.V.T, a.U @ a.V.T, atol=1e-4, rtol=1e-3)
    assert b.provenance.engine["tensor_parallel_size"] == 1
    assert b.provenance.engine["dtype"] == "float32"
    # a fit cut to a rank reads the whole LM head from the checkpoint (no model to ask)
    cut = replace(OPTS, rank=3)
    torch.testing.assert_close(extract(lm_v, task, "ltv", cut).label_logits["ltv"],
                               extract(lm_t, task, "ltv", cut).label_logits["ltv"],
                               atol=2e-3, rtol=1e-4)


def test_tp2_gives_the_tp1_vector(model_dir, task, tp1, tmp_path):
    """At TP 2 (on this CPU: two ranks, a core each) the states are TP 1's, which are
    transformers' (above), and the vector scores the same. (This is also
    `test_vllm_capture`'s TP-2 case: zero-shot and ICL prompts, prefix caching on.)"""
    lm1, _ = tp1
    lm2, report = on_vllm(model_dir, task, tmp_path / "tp2", tp=2)
    assert report["icl_prompts"] == 44 and report["shape"] == [88, 128]
    torch.testing.assert_close(lm2.states.h, lm1.states.h, atol=1e-5, rtol=1e-5)
    a, b = extract(lm1, task, "ltv", OPTS), extract(lm2, task, "ltv", OPTS)
    assert b.artifact.provenance.engine["tensor_parallel_size"] == 2
    for name, m in a.metrics.items():
        assert b.metrics[name]["accuracy"] == m["accuracy"], name
        assert b.metrics[name]["d_ntp"] == pytest.approx(m["d_ntp"], abs=1e-5), name


def test_cli_extract_on_vllm_writes_a_vector_that_says_so(model_dir, task_file, tmp_path):
    out = tmp_path / "toy.pt"
    r = CliRunner().invoke(main, [
        "extract", "--model", str(model_dir), "--task", str(task_file), "--engine", "vllm",
        "--dtype", "float32", "--k", "6", "--n", "24", "--n-test", "20", "--seed", "3",
        "--engine-arg", "enforce_eager=true", "--engine-arg", "max_model_len=1024",
        "-o", str(out)])
    assert r.exit_code == 0, r.output
    pv = load_task_vector(out).provenance
    assert pv.engine["name"] == "vllm" and pv.engine["dtype"] == "float32"
    assert pv.timings["engine_start_seconds"] > 0 and pv.timings["capture_seconds"] > 0
    assert "vLLM TP 1 × PP 1" in r.output and "the prefix cache held" in r.output


def test_evaluate_on_vllm_gives_the_transformers_records(model_dir, task, tmp_path):
    """Two runs of three methods: every episode's states from one vLLM job, each record's
    accuracy and d_NTP the transformers evaluation's."""
    from ltv_vllm.evaluation.evaluate import EvalConfig, evaluate, plan_episodes

    cfg = EvalConfig(k=6, n=24, lam=5.0, n_test=20, runs=2, seed=3, batch_size=5,
                     cost_samples=0)
    methods = ["ltv", "kernel", "mean"]
    episodes = plan_episodes([task], cfg, transfer=False)
    lm_v, report = captured_model("m", str(model_dir), episodes[task.name],
                                  CaptureEngine(dtype="float32", enforce_eager=True,
                                                max_model_len=1024), tmp_path)
    # two episodes share the test subset's zero-shot prompts: each prompt captured once
    assert report["shape"][0] == len(lm_v.states.row) < 2 * 88
    v = evaluate(lm_v, [task], methods, cfg, progress=False, episodes=episodes)
    t = evaluate(load_model(str(model_dir), dtype="float32"), [task], methods, cfg,
                 progress=False, episodes=episodes)
    assert v["config"]["engine"]["name"] == "vllm" and "engine" not in t["config"]
    key = lambda r: (r["task"], r["run"], r["method"])  # noqa: E731
    assert sorted(map(key, v["records"])) == sorted(map(key, t["records"]))
    want = {key(r): r for r in t["records"]}
    for r in v["records"]:
        assert r["accuracy"] == want[key(r)]["accuracy"], key(r)
        assert r["d_ntp"] == pytest.approx(want[key(r)]["d_ntp"], abs=1e-5), key(r)


def test_evaluate_over_demo_sets_on_vllm(model_dir, task, tmp_path):
    """`evaluate --engine vllm --demo-sets 2`: every set's train and test prompts in the one
    vLLM job, the multi-prompt records the
    transformers evaluation's."""
    from ltv_vllm.evaluation.evaluate import EvalConfig, evaluate, plan_episodes

    cfg = EvalConfig(k=6, n=24, lam=5.0, n_test=20, runs=1, seed=3, batch_size=5,
                     cost_samples=0, demo_sets=2)
    methods = ["ltv", "ltv-multi", "icl-ensemble", "icl-states"]
    episodes = plan_episodes([task], cfg, transfer=False)
    lm_v, report = captured_model("m", str(model_dir), episodes[task.name],
                                  CaptureEngine(dtype="float32", enforce_eager=True), tmp_path)
    assert report["shape"][0] == 24 + 2 * 24 + 20 + 2 * 20  # zero-shot and each set, once
    v = evaluate(lm_v, [task], methods, cfg, progress=False, episodes=episodes)
    t = evaluate(load_model(str(model_dir), dtype="float32"), [task], methods, cfg,
                 progress=False, episodes=episodes)
    want = {r["method"]: r for r in t["records"]}
    assert {r["method"] for r in v["records"]} == set(want)
    for r in v["records"]:
        assert r["accuracy"] == want[r["method"]]["accuracy"], r["method"]
        assert r["d_ntp"] == pytest.approx(want[r["method"]]["d_ntp"], abs=1e-5), r["method"]
        assert r["d_ntp_ensemble"] == pytest.approx(want[r["method"]]["d_ntp_ensemble"],
                                                    abs=1e-5), r["method"]


def test_transfer_source_on_vllm_gives_the_transformers_vector(tokenizer, task_file, tmp_path):
    """`--source-engine vllm`: the source's missing capture chunks filled by one vLLM run,
    then the same transfer fit as with the source in transformers (float32); a rerun finds
    every chunk and runs no engine; the store's key keeps the two engines' chunks apart."""
    from conftest import make_llama

    make_vllm_llama(tokenizer, seed=13, tie=False).save_pretrained(tmp_path / "source")
    tokenizer.save_pretrained(tmp_path / "source")
    make_llama(len(tokenizer), hidden=64, layers=2, seed=12).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")

    def run(engine: str) -> tuple:
        out = tmp_path / f"{engine}.pt"
        r = CliRunner().invoke(main, [
            "extract", "--model", str(tmp_path / "target"), "--source-model",
            str(tmp_path / "source"), "--task", str(task_file), "--n", "24", "--n-test", "20",
            "--dtype", "float32", "--source-dtype", "float32", "--source-engine", engine,
            "--work-dir", str(tmp_path / "work"), "--chunk-size", "8", "-o", str(out),
            *(["--engine-arg", "enforce_eager=true", "--engine-arg", "max_model_len=1024"]
              if engine == "vllm" else [])])
        assert r.exit_code == 0, r.output
        return load_task_vector(out), r.output

    t, _ = run("transformers")
    v, out = run("vllm")
    # every prompt of the passes (24 + 20 queries, zero-shot and ICL) came from vLLM, into
    # chunks of its own (none of transformers' reused)
    assert "vLLM captured 88 source prompts" in out and "0 chunks reused" in out
    assert v.provenance.source_load["engine"] == "vllm"
    torch.testing.assert_close(v.U @ v.V.T, t.U @ t.V.T, atol=1e-3, rtol=1e-3)
    for name, m in t.provenance.metrics.items():
        assert v.provenance.metrics[name]["accuracy"] == m["accuracy"], name
        assert v.provenance.metrics[name]["d_ntp"] == pytest.approx(m["d_ntp"], abs=1e-4), name
    _, again = run("vllm")
    assert "vLLM captured 0 source prompts" in again and "0 computed" in again
