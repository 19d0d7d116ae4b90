"""Capture on vLLM against capture in transformers: the train states of one episode (N
zero-shot and N ICL prompts at k demonstrations) through each engine, side by side in one
run, each in a process of its own (its own peak RSS), from the same job forkserver.

  transformers  load the model, `Capturer.hidden` + `Capturer.icl` (the demos' KV cache
                shared by packed queries: the default path of `extract`)
  vllm-eager    `offline.capture` with enforce_eager (no compilation at start-up)
  vllm          the same with vLLM's default compilation

Each row: engine start (model load, plus compilation for vLLM), capture, the share of the
ICL prompts' demonstration tokens vLLM's prefix cache held, peak RSS, and how far its h is
from transformers' (same dtype).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.models.hardware import machine_line
from ltv_vllm.serving.offline.jobs import job_main, run_job

VARIANTS = ("transformers", "vllm-eager", "vllm")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run_transformers_job(job: dict[str, Any]) -> dict[str, Any]:
    """JOB {"model_dir", "dtype", "prefix", "queries", "batch_size", "out"} → h of the
    zero-shot then the ICL prompts in `out`; OUT: seconds and peak RSS."""
    from safetensors.torch import save_file

    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.models.loading import load_model

    t0 = time.perf_counter()
    lm = load_model(job["model_dir"], dtype=job["dtype"])
    cap = Capturer(lm.model, lm.tokenizer, batch_size=job["batch_size"], progress=False)
    t1 = time.perf_counter()
    h = torch.cat([cap.hidden(job["queries"]), cap.icl(job["prefix"], job["queries"])])
    t2 = time.perf_counter()
    save_file({"h": h.contiguous()}, job["out"])
    return {"startup_seconds": t1 - t0, "capture_seconds": t2 - t1,
            "peak_rss_bytes": _peak_rss()}


def compare(model_spec: str, task_name: str, *, k: int, n: int, seed: int, dtype: str,
            batch_size: int, work: Path, variants: tuple[str, ...] = VARIANTS,
            log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per variant on one episode of `task_name` (see the module docstring)."""
    from safetensors.torch import load_file

    from ltv_vllm.models.hardware import resolve_for_model
    from ltv_vllm.models.loading import load_tokenizer, local_model_dir
    from ltv_vllm.serving.offline.capture import CaptureEngine, capture_states
    from ltv_vllm.tasks.data import load_dataset, sample_episode
    from ltv_vllm.tasks.specs import get_task

    path = local_model_dir(model_spec)
    dtype = resolve_for_model(dtype, path)
    task = get_task(task_name)
    ep = sample_episode(load_dataset(task), k=k, n=n, n_test=1, seed=seed)
    prefix = ep.demo_prefix()
    queries = [task.query(e.text) for e in ep.queries]
    tok = load_tokenizer(path)
    prefix_tokens = len(tok(prefix)["input_ids"])
    zs_tokens = sum(len(tok(q)["input_ids"]) for q in queries)
    icl_tokens = [len(tok(prefix + q)["input_ids"]) for q in queries]
    rows: list[dict[str, Any]] = []
    ref: torch.Tensor | None = None
    for variant in variants:
        out = work / f"{variant}.safetensors"
        if variant == "transformers":
            rep = run_job("ltv_vllm.bench.capture_engines",
                          {"model_dir": path, "dtype": dtype, "prefix": prefix,
                           "queries": queries, "batch_size": batch_size, "out": str(out)},
                          work, variant, what="transformers capture job")
            h = load_file(str(out))["h"]
            cached = None
            # the prefix once, then each query's own tokens after it (`Capturer.icl`)
            computed = zs_tokens + prefix_tokens + sum(t - prefix_tokens for t in icl_tokens)
        else:
            engine = CaptureEngine(dtype=dtype, enforce_eager=variant == "vllm-eager",
                                   max_model_len=prefix_tokens + 512)
            h, rep = capture_states(path, [*queries, *(prefix + q for q in queries)],
                                    replace(engine), work / variant)
            cached = sum(rep["cached_tokens"][n:]) / (n * prefix_tokens)
            computed = zs_tokens + sum(icl_tokens) - sum(rep["cached_tokens"])
        row = {"model": model_spec, "task": task_name, "k": k, "k_used": len(ep.demos),
               "n": n, "dtype": dtype, "prefix_tokens": prefix_tokens, "engine": variant,
               "startup_seconds": rep["startup_seconds"],
               "capture_seconds": rep["capture_seconds"],
               "peak_rss_bytes": rep["peak_rss_bytes"], "prefix_cache_share": cached,
               "tokens_computed": computed}
        if ref is None:
            ref = h
        else:
            row["max_abs_diff_h"] = float((h - ref).abs().max())
            row["rel_diff_h"] = float((h - ref).norm() / ref.norm())
        rows.append(row)
        log(f"{model_spec} {variant}: start {row['startup_seconds']:.1f} s, capture "
            f"{row['capture_seconds']:.1f} s, peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB")
    return rows


def bench_capture_engines(models: list[str], task_name: str, *, k: int, n: int, seed: int,
                          dtype: str, batch_size: int, out_dir: Path, command: str,
                          log: Callable[[str], None] = print) -> dict[str, Any]:
    import tempfile

    from ltv_vllm.bench import report
    from ltv_vllm.bench.workload import machine

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ltv-vllm-bench-capture-") as work:
        for m in models:
            rows += compare(m, task_name, k=k, n=n, seed=seed, dtype=dtype,
                            batch_size=batch_size, work=Path(work) / m, log=log)
    doc = {"command": command, "machine": machine(), "started": started,
           "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows}
    report.write(doc, out_dir, markdown(doc))
    return doc


def markdown(doc: dict[str, Any]) -> str:
    r0 = doc["rows"][0]
    lines = [
        "# Capture on vLLM against transformers", "", "```", doc["command"], "```", "",
        (f"{machine_line(doc['machine'])}, torch {doc['machine']['torch']}. One episode of "
         f"{r0['task']} (k={r0['k']}, N={r0['n']}): the N zero-shot and N ICL train prompts. "
         "Each engine in a process of its own; start = model load (+ vLLM's compilation); "
         "prefix cache = share of the ICL prompts' demonstration tokens vLLM found cached "
         "(it caches whole KV blocks only); tokens computed = prompt tokens run through the "
         "model (transformers: the prefix once, then each query); "
         "diff = h against transformers' h, same dtype."), "",
        "| model | dtype | prefix tokens | engine | start (s) | capture (s) | start + capture "
        "(s) | prefix cache | tokens computed | ms / token | peak RSS (GiB) | max abs diff h | "
        "rel. diff h |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        share = "—" if r["prefix_cache_share"] is None else f"{100 * r['prefix_cache_share']:.0f} %"
        diff = (f"{r['max_abs_diff_h']:.2e} | {r['rel_diff_h']:.2e}" if "max_abs_diff_h" in r
                else "(reference) | —")
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['prefix_tokens']} | {r['engine']} | "
            f"{r['startup_seconds']:.1f} | {r['capture_seconds']:.1f} | "
            f"{r['startup_seconds'] + r['capture_seconds']:.1f} | {share} | "
            f"{r['tokens_computed']} | {1e3 * r['capture_seconds'] / r['tokens_computed']:.2f} | "
            f"{r['peak_rss_bytes'] / 2**30:.2f} | {diff} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    job_main(run_transformers_job)
