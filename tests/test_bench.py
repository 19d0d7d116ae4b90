"""The benchmark commands run end to end on a tiny model and write well-formed results.

Timings are not asserted (benchmarks are scripts, not timed tests). What is asserted: every
mode ran every query, the files are there, and each mode's predictions are the ones
transformers gives for the same prompts (zero-shot, ICL, and h + W h for every LTV mode), so
the benchmark measures what it says it measures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from ltv_vllm.bench.workload import build_workload
from ltv_vllm.core.vector import TaskVector, load_task_vector, model_identity
from ltv_vllm.extraction.apply import task_vector_applied
from ltv_vllm.tasks.specs import get_task, label_token_ids

pytestmark = pytest.mark.slow(seconds=76)  # see conftest's ordering

TASKS = "sst2,agnews"


def place_vectors(model_dir: Path, vector_dir: Path, tokenizer) -> None:
    """Random vectors where the workload looks for them, so it uses these instead of fitting
    (a fit on this random model barely moves its saturated label distributions)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ident = model_identity(model, str(model_dir))
    vector_dir.mkdir(parents=True)
    for seed, name in enumerate(TASKS.split(",")):
        task = get_task(name)
        g = torch.Generator().manual_seed(seed)
        V = torch.linalg.qr(torch.randn(128, 8, generator=g))[0]
        tv = TaskVector("hidden", 0.5 * torch.randn(128, 8, generator=g), V, None, ident,
                        tuple(label_token_ids(task, tokenizer)), {"task": task.to_dict()})
        tv.save(vector_dir / f"{name}-k6-n8-lam5-seed0.safetensors")
        # and an RBF kernel vector (`kernel-fused`): 8 support states, γ about 1/‖h − s‖²
        kv = TaskVector("hidden", 2.0 * torch.randn(128, 8, generator=g),
                        torch.randn(128, 8, generator=g), None, ident,
                        tuple(label_token_ids(task, tokenizer)), {"task": task.to_dict()},
                        map="rbf", gamma=1 / 256)
        kv.save(vector_dir / f"{name}-kernel-k6-n8-seed0.safetensors")


def reference_probs(
    model_dir: Path, wl, prompts: list[str], vectors: dict | None
) -> list[torch.Tensor]:
    """transformers (+ the reference hook): label-restricted probabilities per query."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    preds = []
    for q, prompt in zip(wl.queries, prompts, strict=True):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            if vectors:
                with task_vector_applied(model, vectors[q.task]):
                    logits = model(ids).logits[0, -1]
            else:
                logits = model(ids).logits[0, -1]
        preds.append(torch.softmax(logits[wl.label_ids[q.task]].double(), -1))
    return preds


def test_bench_serving_end_to_end(bench_model, tmp_path, tokenizer):
    out = tmp_path / "serving"
    place_vectors(bench_model, out / "work" / "vectors", tokenizer)
    run_cli("bench", "serving", "--model", str(bench_model), "--tasks", TASKS, "--n-per-task", "6",
            "--k", "6", "--n", "8", "--concurrency", "1,4", "--online-requests", "8",
            "--modes", "zero-shot,icl-prefix-cache,icl-no-cache,ltv-fused,ltv-folded,ltv-shift,"
            "ltv-lora,ltv-lora-r4,ltv-fused-first,kernel-fused",
            # one round (each round starts every engine afresh; the rounds' interleaving and
            # pairing are checked in test_bench_report)
            "--online-modes", "ltv-shift", "--repeats", "1", "--gen-tokens", "3",
            "--warmup", "2", "--dtype", "float32", "--max-model-len", "2048",
            "--kv-cache-gib", "1", "--out", str(out), cwd=tmp_path)
    doc = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    for f in ("throughput_ratio.png", "accuracy_vs_throughput.png", "latency.png"):
        assert (out / f).stat().st_size > 1000, f
    modes = ["zero-shot", "icl-prefix-cache", "icl-no-cache", "ltv-fused", "ltv-folded",
             "ltv-shift", "ltv-lora", "ltv-lora-r4", "ltv-fused-first", "kernel-fused",
             "zero-shot (again)"]
    assert list(doc["offline"]) == modes
    for m in modes:
        r = doc["offline"][m]
        slow = m == "icl-no-cache"  # one timed pass, no generation pass
        assert r["requests"] == 12 and len(r["classify_seconds"]) == 1, m
        assert r["generate_tokens"] == (0 if slow else 12 * 3), m  # ignore_eos: exactly 3 each
        assert r["requests_per_s"] > 0 and 0 <= r["accuracy"] <= 1
        assert 0 < r["peak_rss_bytes"] and 0 <= r["peak_kv_usage"] <= 1
        assert f"| {m} |" in md
    assert doc["offline"]["ltv-fused"]["engines"] == 2  # one fused engine per task
    # ICL prompts are longer; with the prefix cache on, their demos are found in the cache
    assert (doc["offline"]["icl-no-cache"]["prompt_tokens_mean"]
            > 3 * doc["offline"]["zero-shot"]["prompt_tokens_mean"])
    assert doc["offline"]["icl-prefix-cache"]["prefix_cache_hit_rate"] > 0.3
    assert doc["offline"]["icl-no-cache"]["prefix_cache_hit_rate"] == 0
    assert {t["target"] for t in doc["targets"]} >= {
        "LTV fused ≥ 0.97× zero-shot", "LTV multi-task LoRA ≥ 0.85× zero-shot",
        "LTV multi-task LoRA, rank 4, ≥ 0.85× zero-shot",
        "LTV multi-task, per-request shift, ≥ 0.85× zero-shot",
        "LTV multi-task, per-request shift, generation ≥ 0.85× zero-shot"}
    assert "fastest of 1 interleaved rounds" in md
    for m in modes:  # the headline rate is the fastest pass, the median is kept beside it
        r = doc["offline"][m]
        assert r["requests_per_s"] == pytest.approx(12 / min(r["classify_seconds"]))
        assert r["requests_per_s_median"] <= r["requests_per_s"]
    (out / "results.md").unlink()
    rerendered = run_cli("bench", "report", str(out), cwd=tmp_path).stdout
    assert (out / "results.md").read_text() == md and "| ltv-lora |" in rerendered
    assert list(doc["online"]) == ["ltv-shift"]
    for m, levels in doc["online"].items():
        for c in ("1", "4"):
            x = levels[c]
            assert x["requests"] == 8 and x["latency_p99_ms"] >= x["latency_p50_ms"] > 0, (m, c)
    # the same queries through transformers: every mode predicts what the method predicts
    wl = build_workload(str(bench_model), TASKS.split(","), n_per_task=6, k=6, n=8,
                        vector_dir=out / "work" / "vectors", with_vectors=True, with_kernel=True)
    vectors = {t: load_task_vector(p) for t, p in wl.vectors.items()}
    kernels = {t: load_task_vector(p) for t, p in wl.kernel_vectors.items()}
    assert all(tv.map == "rbf" for tv in kernels.values())
    ltv = reference_probs(bench_model, wl, [q.zs for q in wl.queries], vectors)
    kern = reference_probs(bench_model, wl, [q.zs for q in wl.queries], kernels)
    # the kernel map moves the distributions and is not the linear one, so matching it below
    # tells the three apart
    assert max(float((a - b).abs().max()) for a, b in zip(kern, ltv, strict=True)) > 1e-2
    zs = reference_probs(bench_model, wl, [q.zs for q in wl.queries], None)
    icl = reference_probs(bench_model, wl, [q.icl for q in wl.queries], None)
    # rank 4 of the rank-8 vectors (placed without training states): the rank-4 map closest to
    # W in what it does to the logits, min ‖W_lm (W − W_4)‖_F, by the reduced-rank formula
    # W_4 = R⁻¹ P_4 P_4ᵀ R W (W_lm = Q R, P_4: top left singular vectors of R W)
    from transformers import AutoModelForCausalLM

    w_lm = AutoModelForCausalLM.from_pretrained(bench_model, dtype=torch.float32).lm_head.weight
    R = torch.linalg.qr(w_lm.detach().double())[1]
    cut = {}
    for t, tv in vectors.items():
        W = (tv.U @ tv.V.T).double()
        P = torch.linalg.svd(R @ W)[0]
        P2, sv, Qt = torch.linalg.svd(torch.linalg.solve(R, P[:, :4] @ P[:, :4].T @ R @ W))
        cut[t] = TaskVector("hidden", (P2[:, :4] * sv[:4]).float(), Qt[:4].T.float(), None,
                            tv.model, tv.label_token_ids, tv.meta)
    ltv4 = reference_probs(bench_model, wl, [q.zs for q in wl.queries], cut)
    assert max(float((a - b).abs().max())
               for a, b in zip(ltv, ltv4, strict=True)) > 1e-3  # a real cut
    for mode, ref in (("zero-shot", zs), ("icl-prefix-cache", icl), ("icl-no-cache", icl),
                      ("ltv-fused", ltv), ("ltv-folded", ltv), ("ltv-shift", ltv),
                      ("ltv-lora", ltv), ("ltv-lora-r4", ltv4), ("ltv-fused-first", ltv),
                      ("kernel-fused", kern)):
        got = doc["offline"][mode]
        for i, p in enumerate(ref):
            assert torch.allclose(torch.tensor(got["probs"][i], dtype=torch.float64), p,
                                  atol=1e-4), (mode, i)
        assert got["predictions"] == [int(p.argmax()) for p in ref], mode
        # and the report's transformers row for the mode is the same method's answers
        assert doc["transformers"][mode]["predictions"] == got["predictions"], mode
        assert f"| {mode} | " in md.split("transformers in float32")[1]
    # the online server answered what the method answers, at every concurrency level (its
    # queries are the workload's first `--online-requests`)
    for c in ("1", "4"):
        got = doc["online"]["ltv-shift"][c]
        assert len(got["probs"]) == 8
        for i, p in enumerate(ltv[:8]):
            assert torch.allclose(torch.tensor(got["probs"][i], dtype=torch.float64), p,
                                  atol=1e-4), ("online", c, i)
        assert got["predictions"] == [int(p.argmax()) for p in ltv[:8]], ("online", c)
    assert max(float((a - b).abs().max()) for a, b in zip(ltv[:8], zs[:8], strict=True)) > 1e-2
    online_md = md.split("## Online")[1]
    assert online_md.count("| 0 of 8 |") == 2  # both levels answered as transformers did
    # the vectors move the distributions, so the comparison above tells the methods apart
    assert max(float((a - b).abs().max()) for a, b in zip(ltv, zs, strict=True)) > 1e-2
    assert max(float((a - b).abs().max()) for a, b in zip(kern, zs, strict=True)) > 1e-2
