"""What an offline engine job costs, forked from the job forkserver with and without its
preload (`serving/preload.py`): engine start, the first `generate` (with logprobs: vLLM's
compiled logprob-rank kernel, whose first compile runs torch inductor's per-process probes),
a second `generate`, the engine's shutdown, and the whole job as its caller sees it.

    python benchmarks/job_start.py --model smollm2-135m --jobs 4 \\
        --out benchmarks/results/job_start

Each setting runs in a fresh process of its own (the forkserver is per process), `--jobs`
jobs one after another; the first job of each also waits for the forkserver to start, so
the report takes the median of the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def job(spec: dict) -> dict:
    """In the forked job: one engine, timed."""
    from vllm import LLM, SamplingParams

    t, t0 = {}, time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=512, enforce_eager=True,
              seed=0, logprobs_mode="processed_logprobs")
    t["engine_start"] = time.perf_counter() - t0
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)
    for name, prompts in (("first_generate", ["Review: dull\nSentiment:"]),
                          ("second_generate", ["Review: great\nSentiment:"])):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        t[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    t["shutdown"] = time.perf_counter() - t0
    return t


def run_setting(a) -> None:
    from ltv_vllm.models.resolve import resolve_model
    from ltv_vllm.serving.offline import jobs

    if a.setting == "bare":  # the forkserver as it was: vLLM's import only
        jobs.PRELOAD = tuple(m for m in jobs.PRELOAD if m != "ltv_vllm.serving.offline.preload")
    spec = {"model": resolve_model(a.model)}
    rows = []
    for i in range(a.jobs):
        t0 = time.perf_counter()
        out = jobs.run_job("job_start", spec, a.out / "work", f"{a.setting}-{i}",
                           env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                "VLLM_CPU_KVCACHE_SPACE": "1"})
        rows.append({**out, "job": time.perf_counter() - t0})
    (a.out / f"{a.setting}.json").write_text(json.dumps(rows, indent=1))


def report(a) -> None:
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.models.hardware import machine_line

    hw = machine()
    res = {s: json.loads((a.out / f"{s}.json").read_text()) for s in ("bare", "preload")}
    keys = ["job", "engine_start", "first_generate", "second_generate", "shutdown"]
    med = {s: {k: statistics.median(r[k] for r in rows[1:]) for k in keys}
           for s, rows in res.items()}
    lines = ["# An offline engine job, with and without the forkserver's preload", "",
             f"Machine: {machine_line(hw)}. Model {a.model}, float32, eager; median of jobs "
             f"2–{a.jobs} of each setting (job 1 also waits for its forkserver).", "",
             f"    python benchmarks/job_start.py --model {a.model} --jobs {a.jobs}", "",
             "| seconds | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for s in ("bare", "preload"):
        lines.append(f"| {s} | " + " | ".join(f"{med[s][k]:.2f}" for k in keys) + " |")
    (a.out / "results.json").write_text(json.dumps(
        {"machine": hw, "model": a.model, "jobs": a.jobs, "median": med, "runs": res},
        indent=1))
    (a.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--setting", choices=["bare", "preload"], help="one setting (here)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/job_start"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.setting is None:
        for s in ("bare", "preload"):
            subprocess.run([sys.executable, __file__, "--model", a.model, "--jobs",
                            str(a.jobs), "--setting", s, "--out", str(a.out)], check=True)
        report(a)
        return
    run_setting(a)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1].endswith(".job.json"):  # a forked job
        from ltv_vllm.serving.offline.jobs import job_main

        job_main(job)
    else:
        main()
