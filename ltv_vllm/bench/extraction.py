"""Extraction cost: the shared demo KV cache (ours) against the reference code's naive path.

Naive = what the paper's reference code does: for each of the N train queries, one full
forward of the zero-shot prompt and one of demos + query, batch 1. Ours = `Capturer`:
zero-shot prompts batched, the demos encoded once per episode and their KV cache shared by
packed batches of queries. Both run side by side in one process on the same episode, over a
grid of k (at the largest N) and N (at the middle k); the ridge fit is timed separately.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import save_figure
from ltv_vllm.extraction.capture import Capturer
from ltv_vllm.models.hardware import machine_line


def time_paths(cap: Capturer, task_name: str, k: int, n: int, seed: int, *,
               naive: bool = True) -> dict[str, Any]:
    from ltv_vllm.core.ridge import ridge_fit
    from ltv_vllm.tasks.data import load_dataset, sample_episode
    from ltv_vllm.tasks.specs import get_task

    task = get_task(task_name)
    ep = sample_episode(load_dataset(task), k=k, n=n, n_test=1, seed=seed)
    prefix = ep.demo_prefix()
    queries = [task.query(e.text) for e in ep.queries]

    t0 = time.perf_counter()
    h_zs = cap.hidden(queries, desc=f"ours zero-shot k={k} N={n}")
    h_icl = cap.icl(prefix, queries, desc=f"ours icl k={k} N={n}")
    t1 = time.perf_counter()
    factors = ridge_fit(h_zs, h_icl - h_zs, 5.0)
    t2 = time.perf_counter()
    row: dict[str, Any] = {
        "task": task_name, "k": k, "k_used": len(ep.demos), "n": n,
        "prefix_tokens": len(cap.encode(prefix)),
        "ours_capture_seconds": t1 - t0, "fit_seconds": t2 - t1, "rank": factors.U.shape[1],
        "naive_capture_seconds": None, "speedup": None,
    }
    if naive:
        nz = cap.naive(queries, desc=f"naive zero-shot k={k} N={n}")
        ni = cap.naive([prefix + q for q in queries], desc=f"naive icl k={k} N={n}")
        t3 = time.perf_counter()
        row.update({
            "naive_capture_seconds": t3 - t2,
            "speedup": (t3 - t2 + (t2 - t1)) / (t1 - t0 + (t2 - t1)),
            "max_abs_diff_h_zs": float((h_zs - nz).abs().max()),
            "max_abs_diff_h_icl": float((h_icl - ni).abs().max()),
            "rel_diff_h_icl": float((h_icl - ni).norm() / ni.norm()),
        })
    return row


def grid(ks: Sequence[int], ns: Sequence[int]) -> list[tuple[int, int]]:
    """k sweep at the largest N, then N sweep at the middle k (30 when given)."""
    k_mid = 30 if 30 in ks else sorted(ks)[len(ks) // 2]
    pts = [(k, max(ns)) for k in ks] + [(k_mid, n) for n in ns]
    return list(dict.fromkeys(pts))


def bench_extraction(model_spec: str, task_names: list[str], *, ks: Sequence[int],
                     ns: Sequence[int], seed: int, batch_size: int, dtype: str, naive: bool,
                     out_dir: Path, command: str, log: Callable[[str], None] = print
                     ) -> dict[str, Any]:
    import torch

    from ltv_vllm.bench import report
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.models.loading import load_model

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    lm = load_model(model_spec, dtype=dtype)
    cap = Capturer(lm.model, lm.tokenizer, batch_size=batch_size, progress=True)
    rows = []
    for task in task_names:
        for k, n in grid(ks, ns):
            rows.append(time_paths(cap, task, k, n, seed, naive=naive))
            r = rows[-1]
            log(f"{task} k={k} N={n}: ours {r['ours_capture_seconds']:.1f} s"
                + (f", naive {r['naive_capture_seconds']:.1f} s ({r['speedup']:.1f}×)"
                   if naive else ""))
    doc = {"command": command, "model": model_spec, "dtype": str(lm.model.dtype),
           "batch_size": batch_size, "threads": torch.get_num_threads(), "machine": machine(),
           "started": started,
           "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows}
    report.write(doc, out_dir, extraction_markdown(doc))
    doc["plots"] = [str(extraction_plot(doc, out_dir))]
    return doc


def extraction_markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Extraction time: shared demo cache vs naive (batch 1, full prompt per query)", "",
        "```", doc["command"], "```", "",
        (f"Model `{doc['model']}` ({doc['dtype']}), batch {doc['batch_size']}, "
        f"{machine_line(doc['machine'])}, torch {doc['machine']['torch']}. "
        "Capture = zero-shot and ICL hidden states of the N train queries; fit = ridge."), "",
        ("| task | k | demos | prefix tokens | N | ours (s) | naive (s) | speed-up | "
        "max abs diff h_icl |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        fit = r["fit_seconds"]
        naive = (f"{r['naive_capture_seconds'] + fit:.1f} | {r['speedup']:.1f}× | "
                 f"{r['max_abs_diff_h_icl']:.2e}" if r["naive_capture_seconds"] is not None
                 else "— | — | —")
        lines.append(f"| {r['task']} | {r['k']} | {r['k_used']} | {r['prefix_tokens']} "
                     f"| {r['n']} | {r['ours_capture_seconds'] + fit:.1f} | {naive} |")
    return "\n".join(lines) + "\n"


def extraction_plot(doc: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    n_max = max(r["n"] for r in rows)
    ks = sorted({r["k"] for r in rows})
    k_mid = 30 if 30 in ks else ks[len(ks) // 2]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, fixed, sel in ((axes[0], "k", f"N={n_max}", lambda r: r["n"] == n_max),
                                (axes[1], "n", f"k={k_mid}", lambda r: r["k"] == k_mid)):
        for task in dict.fromkeys(r["task"] for r in rows):
            pts = sorted((r[key], r) for r in rows if r["task"] == task and sel(r))
            xs = [x for x, _ in pts]
            line, = ax.plot(xs, [r["ours_capture_seconds"] + r["fit_seconds"] for _, r in pts],
                            "o-", label=f"{task} ours (shared demo cache)")
            if all(r["naive_capture_seconds"] is not None for _, r in pts):
                ax.plot(xs, [r["naive_capture_seconds"] + r["fit_seconds"] for _, r in pts], "s--",
                        color=line.get_color(), label=f"{task} naive (batch 1)")
        ax.set_xlabel("k demonstrations" if key == "k" else "N train queries")
        ax.set_ylabel("extraction seconds (capture + fit)")
        ax.set_yscale("log")
        ax.set_title(fixed)
        ax.legend(fontsize=8)
    fig.suptitle(f"{doc['model']}: extraction cost")
    fig.tight_layout()
    return save_figure(fig, out_dir / "extraction_cost.png")
