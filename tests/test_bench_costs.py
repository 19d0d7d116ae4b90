"""The cost benchmarks (`bench icl-cost`, `bench extraction`, `bench rank`) run end to end on
a tiny model and write well-formed results. A file of their own beside `test_bench.py`'s
serving benchmark, the suite's longest test, so the two run on different workers.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from ltv_vllm.bench.extraction import grid
from ltv_vllm.tasks.specs import get_task

pytestmark = pytest.mark.slow(seconds=12)  # see conftest's ordering


def test_bench_icl_cost_end_to_end(bench_model, tmp_path):
    out = tmp_path / "icl"
    # one task: the cost grows with k per engine; a second task would only add engines
    r = run_cli("bench", "icl-cost", "--model", str(bench_model), "--tasks", "sst2",
                "--ks", "0,4,8",
                "--n-per-task", "4", "--vector-k", "4", "--n", "8", "--repeats", "1",
                "--warmup", "2", "--dtype", "float32", "--max-model-len", "2048",
                "--kv-cache-gib", "1",
                "--out", str(out), cwd=tmp_path)
    doc = json.loads((out / "results.json").read_text())
    ic = doc["icl_cost"]
    assert ic["k"] == [0, 4, 8]
    for mode in ("icl-prefix-cache", "icl-no-cache"):
        toks = [ic[mode][f"k={k}"]["prompt_tokens_mean"] for k in (0, 4, 8)]
        assert toks[0] < toks[1] < toks[2], (mode, toks)  # more demos, longer prompts
        assert all(ic[mode][f"k={k}"]["requests"] == 4 for k in (0, 4, 8))
    assert ic["ltv-fused"]["prompt_tokens_mean"] == ic["icl-no-cache"]["k=0"]["prompt_tokens_mean"]
    assert (out / "icl_cost.png").stat().st_size > 1000
    assert "| 8 |" in r.stdout


def test_bench_extraction_end_to_end(bench_model, tmp_path):
    out = tmp_path / "extraction"
    run_cli("bench", "extraction", "--model", str(bench_model), "--tasks", "sst2", "--ks", "2,4",
            "--ns", "4,8", "--dtype", "float32", "--out", str(out), cwd=tmp_path)
    doc = json.loads((out / "results.json").read_text())
    assert ([(r["k"], r["n"]) for r in doc["rows"]] == grid([2, 4], [4, 8])
            == [(2, 8), (4, 8), (4, 4)])
    for r in doc["rows"]:
        assert r["naive_capture_seconds"] > 0 and r["speedup"] > 0
        # the shared demo cache gives the naive path's hidden states (float32)
        assert r["max_abs_diff_h_icl"] < 1e-4 and r["max_abs_diff_h_zs"] < 1e-4
    assert (out / "extraction_cost.png").stat().st_size > 1000
    assert (out / "results.md").read_text().count("| sst2 |") == 3


def test_bench_rank_end_to_end(bench_model, tmp_path):
    """Every rank row is what `extract --rank` measures on the same episode."""
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, extract

    out = tmp_path / "rank"
    r = run_cli("bench", "rank", "--model", str(bench_model), "--tasks", "sst2",
                "--ranks", "1,2,64",
                "--k", "4", "--n", "10", "--n-test", "12", "--runs", "2", "--dtype", "float32",
                "--out", str(out), cwd=tmp_path)
    doc = json.loads((out / "results.json").read_text())
    rows = doc["rows"]
    assert [(x["run"], x["rank_label"]) for x in rows] == [
        (run, lab) for run in (0, 1) for lab in ("1", "2", "full")]  # 64 ≥ the full rank: once
    assert all(x["full_rank"] == 10 for x in rows)  # rank ≤ N
    lm = load_model(str(bench_model), dtype="float32")
    for x in rows:
        rank = None if x["rank_label"] == "full" else x["rank"]
        res = extract(lm, get_task("sst2"), "ltv", ExtractOptions(
            k=4, n=10, n_test=12, seed=x["seed"], progress=False, rank=rank))
        tv = res.artifact
        assert tv.rank == x["rank"]
        for m in ("accuracy", "d_ntp"):
            assert x["ltv"][m] == pytest.approx(res.metrics["ltv"][m], abs=1e-6), (x, m)
            assert x["zero-shot"][m] == pytest.approx(res.metrics["zero-shot"][m], abs=1e-6)
        assert x["lora_b_bytes_bf16"] == len(lm.tokenizer) * {1: 1, 2: 8, 10: 16}[x["rank"]] * 2
        if x["rank_label"] == "full":  # nothing cut: both cuts are the fit itself
            assert x["ltv_plain"] == x["ltv"]
    s = doc["summary"]
    assert s["LTV r=full"]["sst2"]["accuracy"] == pytest.approx(
        sum(x["ltv"]["accuracy"] for x in rows if x["rank_label"] == "full") / 2)
    assert s["plain SVD r=2"]["sst2"]["d_ntp"] == pytest.approx(
        sum(x["ltv_plain"]["d_ntp"] for x in rows if x["rank_label"] == "2") / 2)
    assert (out / "rank.png").stat().st_size > 1000
    md = (out / "results.md").read_text()
    assert "| LTV r=1 |" in md and "| LTV r=full |" in md and "| plain SVD r=2 |" in md
    assert md in r.stdout
