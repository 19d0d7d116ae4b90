"""FV's causal-indirect-effect sweep: the last-token sweep against the naive one.

The naive sweep runs one full patched forward per (layer, head) and trial; ours runs each
trial's prompt minus its last token once and then only the last token once per head: packed
along one sequence after the cached prefix (the default), or as a batch of rows that each
expand the prefix's keys and values (what kernels without a custom mask get). All are timed
on the same trial; the naive one on `--naive-layers` layers only (all heads
of them), then scaled to every layer (its cost is the same per head). Their indirect effects
on the heads both measured are compared.

    python benchmarks/fv_sweep.py --model smollm2-135m --task sst2 --out benchmarks/results/fv_sweep
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ltv_vllm.extraction.capture import Capturer
from ltv_vllm.methods import Context, MethodOptions
from ltv_vllm.methods.fv import indirect_effects, mean_head_activations, shuffled_prompts
from ltv_vllm.models.hardware import hardware, machine_line
from ltv_vllm.models.loading import load_model
from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
from ltv_vllm.tasks.specs import get_task, label_token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="sst2")
    ap.add_argument("--k", type=int, default=30)
    ap.add_argument("--naive-layers", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/fv_sweep"))
    a = ap.parse_args()
    lm = load_model(a.model, dtype=a.dtype)
    task = get_task(a.task)
    ep = plan_episode(task, ExtractOptions(k=a.k, n=64, n_test=8, n_val=0))
    cap = Capturer(lm.model, lm.tokenizer, progress=False)
    ctx = Context(cap, ep, label_token_ids(task, lm.tokenizer),
                  MethodOptions(progress=False, fv_trials=1), identity=lm.identity)
    mean_act = mean_head_activations(ctx)
    trial = shuffled_prompts(ctx)[:1]
    n_layers, n_heads = mean_act.shape[:2]
    some = list(range(a.naive_layers))
    t0 = time.perf_counter()
    fast = indirect_effects(ctx, mean_act, trial, fast=True)
    t_fast = time.perf_counter() - t0
    cap.pack = False
    t0 = time.perf_counter()
    rows = indirect_effects(ctx, mean_act, trial, fast=True)
    t_rows = time.perf_counter() - t0
    cap.pack = True
    t0 = time.perf_counter()
    naive = indirect_effects(ctx, mean_act, trial, fast=False, layers=some)
    t_naive_part = time.perf_counter() - t0
    t_naive = t_naive_part * n_layers / len(some)
    diff = float((fast[some] - naive[some]).abs().max())
    diff_rows = float((fast - rows).abs().max())
    res = {"model": a.model, "task": a.task, "k": a.k, "dtype": str(lm.model.dtype),
           "prompt_tokens": len(cap.encode(trial[0][0])), "layers": n_layers, "heads": n_heads,
           "fast_seconds_per_trial": t_fast, "rows_seconds_per_trial": t_rows,
           "max_abs_diff_packed_vs_rows": diff_rows, "naive_seconds_measured": t_naive_part,
           "naive_layers_measured": len(some), "naive_seconds_per_trial_scaled": t_naive,
           "speedup": t_naive / t_fast, "max_abs_diff_on_measured_heads": diff,
           "machine": hardware()}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    md = (f"# FV indirect-effect sweep: last token vs naive\n\n```\npython benchmarks/fv_sweep.py "
          f"--model {a.model} --task {a.task} --k {a.k} --naive-layers {a.naive_layers} "
          f"--out {a.out}\n```\n\n"
          f"One shuffled-label trial of {res['prompt_tokens']} tokens, {n_layers} layers × "
          f"{n_heads} heads = {n_layers * n_heads} patched runs, {res['dtype']}.\n\n"
          f"| sweep | seconds per trial |\n|---|---|\n"
          f"| last token, packed along one sequence (ours, default) | {t_fast:.1f} |\n"
          f"| last token, one batch row per head | {t_rows:.1f} |\n"
          f"| naive, full forward per head | {t_naive:.1f} (measured {t_naive_part:.1f} s on "
          f"{len(some)} layers, scaled ×{n_layers / len(some):.0f}) |\n\n"
          f"Speed-up {res['speedup']:.0f}× over naive ({t_rows / t_fast:.1f}× over batch rows); "
          f"largest difference of the indirect effects on the heads both measured: {diff:.1e} "
          f"(packed vs batch rows, every head: {diff_rows:.1e}).\n\n"
          f"Machine: {machine_line(res['machine'])}.\n")
    (a.out / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
