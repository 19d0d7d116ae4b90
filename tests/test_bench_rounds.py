"""`bench serving`'s interleaved rounds, without engines: the order modes run in, how a
mode's rounds merge, and the paired ratios and noise floor the report prints from them
(`run_engine_job` stubbed with known times)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ltv_vllm.bench import report, serving
from ltv_vllm.bench.modes import Engine


def fake_result(cls_s: float, gen_s: float) -> dict:
    return {"passes": {"main": {
        "requests": 10, "classify_seconds": [cls_s], "generate_seconds": [gen_s],
        "generate_tokens": 40, "predictions": [{"qid": 0, "task": "t", "gold": 0, "pred": 0,
                                                "probs": [1.0]}],
        "prompt_tokens_mean": 5.0, "prefix_cache_hit_rate": 0.0, "peak_kv_usage": 0.1}},
        "kv_blocks": 4, "block_size": 16, "peak_rss_bytes": 1 << 30, "startup_seconds": 1.0}


def test_rounds_interleave_and_pair(monkeypatch, tmp_path):
    ran: list[str] = []
    # seconds per (mode, round): zero-shot drifts slower each round; "ltv-shift" is always
    # 1.25× zero-shot's time in its round, so its paired ratio is exactly 0.8 every round
    times = {"zero-shot": [1.0, 1.2, 1.4], "ltv-shift": [1.25, 1.5, 1.75],
             "zero-shot-again": [1.02, 1.2, 1.33]}

    def fake_engines(mode, *_a, **_k):
        return [Engine(mode, {}, lambda *_a: [], [[{}]])]

    def fake_job(engine, _passes, *, repeats, **_k):
        assert repeats == serving.INNER_PASSES  # back-to-back passes in each engine
        ran.append(engine.label)
        name, rnd = engine.label.split("#")
        t = times[name][int(rnd) - 1]
        res = fake_result(t, 2 * t)
        # slower passes beside the fastest: the round keeps the fastest
        for key in ("classify_seconds", "generate_seconds"):
            best = res["passes"]["main"][key][0]
            res["passes"]["main"][key] = [1.5 * best, best, 1.2 * best][:repeats]
        return res

    monkeypatch.setattr(serving, "engines", fake_engines)
    monkeypatch.setattr(serving, "run_engine_job", fake_job)

    modes = ["zero-shot", "ltv-shift", serving.NOISE_MODE]
    out = serving.run_offline(SimpleNamespace(queries=[]), modes, None, repeats=3,
                              gen_tokens=4, warmup=0, work_dir=tmp_path, log=lambda _m: None)
    assert ran == [f"{m}#{r}" for r in (1, 2, 3)
                   for m in ("zero-shot", "ltv-shift", "zero-shot-again")]
    shift = out["ltv-shift"]
    assert shift["classify_seconds"] == [1.25, 1.5, 1.75] and shift["repeats"] == 3
    assert shift["paired"]["requests_per_s"] == pytest.approx([0.8, 0.8, 0.8])
    assert shift["paired"]["output_tokens_per_s"] == pytest.approx([0.8, 0.8, 0.8])
    # unpaired, the fastest zero-shot (1.0 s) against the fastest shift (1.25 s) says 0.8 too,
    # but the medians of separately run modes would mix rounds; the floor is the worst round
    floor = report.noise_floor(out)
    assert floor["requests_per_s"] == pytest.approx(1.4 / 1.33 - 1)
    md = "\n".join(report.paired_table(out))
    assert "| ltv-shift | 0.80× [0.80–0.80] | 0.80× [0.80–0.80] |" in md
    assert f"at most {100 * (1.4 / 1.33 - 1):.1f}% (classify)" in md
