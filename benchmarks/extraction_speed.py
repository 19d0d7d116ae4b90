"""Extraction time: shared demo KV cache + batching against the naive reference path.

Naive = what the paper's reference code does: for each of the N train queries, one full
forward of the zero-shot prompt and one of demos+query, batch 1. Ours = `Capturer`:
zero-shot prompts batched, demos encoded once and their KV cache reused by batched queries.
Both paths run side by side in one process on the same episode; the ridge fit (milliseconds)
is the same for both and is timed separately. Results go to benchmarks/results/.

    python benchmarks/extraction_speed.py --model smollm2-135m --tasks sst2,agnews --k 30 --n 256
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import click
import torch

from ltv_vllm.capture import Capturer
from ltv_vllm.data import load_dataset, sample_episode
from ltv_vllm.extract import load_model
from ltv_vllm.ridge import ridge_fit
from ltv_vllm.tasks import get_task


def time_paths(cap: Capturer, task_name: str, k: int, n: int, seed: int) -> dict:
    task = get_task(task_name)
    ep = sample_episode(load_dataset(task), k=k, n=n, n_test=1, seed=seed)
    prefix = ep.demo_prefix()
    queries = [task.query(e.text) for e in ep.queries]
    n_prefix = len(cap.encode(prefix))

    t0 = time.perf_counter()
    h_zs = cap.hidden(queries, desc="ours zero-shot")
    h_icl = cap.icl(prefix, queries, desc="ours icl")
    t1 = time.perf_counter()
    factors = ridge_fit(h_zs, h_icl - h_zs, 5.0)
    t2 = time.perf_counter()
    nz = cap.naive(queries, desc="naive zero-shot")
    ni = cap.naive([prefix + q for q in queries], desc="naive icl")
    t3 = time.perf_counter()
    return {
        "task": task_name,
        "k_used": len(ep.demos),
        "n": n,
        "prefix_tokens": n_prefix,
        "ours_capture_seconds": t1 - t0,
        "fit_seconds": t2 - t1,
        "naive_capture_seconds": t3 - t2,
        "speedup": (t3 - t2 + (t2 - t1)) / (t1 - t0 + (t2 - t1)),
        "max_abs_diff_h_zs": float((h_zs - nz).abs().max()),
        "max_abs_diff_h_icl": float((h_icl - ni).abs().max()),
        "rel_diff_h_icl": float((h_icl - ni).norm() / ni.norm()),
        "rank": factors.U.shape[1],
    }


@click.command()
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--tasks", default="sst2,agnews", show_default=True)
@click.option("--k", default=30, show_default=True)
@click.option("--n", default=256, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--batch-size", default=16, show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--out", default="benchmarks/results/extraction_speed", show_default=True)
def main(model_spec: str, tasks: str, k: int, n: int, seed: int, batch_size: int, dtype: str,
         out: str) -> None:
    lm = load_model(model_spec, dtype=dtype)
    cap = Capturer(lm.model, lm.tokenizer, batch_size=batch_size, progress=True)
    rows = [time_paths(cap, t.strip(), k, n, seed) for t in tasks.split(",") if t.strip()]
    doc = {
        "command": "python " + " ".join(sys.argv),
        "model": model_spec,
        "dtype": str(lm.model.dtype),
        "batch_size": batch_size,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "rows": rows,
    }
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    lines = [
        "# Extraction time: shared demo cache vs naive (batch 1, full prompt per query)",
        "", f"```\n{doc['command']}\n```", "",
        (f"Model `{model_spec}` ({doc['dtype']}), k={k}, N={n}, batch {batch_size}, "
         f"{doc['machine']['cpus']} CPUs, torch {torch.__version__}."), "",
        "| task | demos | prefix tokens | ours (s) | naive (s) | speed-up | max abs diff h_icl |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['k_used']} | {r['prefix_tokens']} | "
            f"{r['ours_capture_seconds'] + r['fit_seconds']:.1f} | "
            f"{r['naive_capture_seconds'] + r['fit_seconds']:.1f} | {r['speedup']:.1f}× | "
            f"{r['max_abs_diff_h_icl']:.2e} |"
        )
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
