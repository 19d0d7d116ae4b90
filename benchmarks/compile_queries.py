"""Which unlabeled queries a compile needs: real held-out inputs, or the demos' own inputs.

A compile request brings k labelled demos and N unlabeled queries. Could the demos alone do
(no queries)? Per task, on one episode, this fits LTV three ways and scores each on the same
test subset (accuracy, d_NTP against ICL):

  queries      N real unlabeled inputs, each after all k demos (what `extract` does)
  loo          the k demos' inputs, each after the other k − 1 demos (leave-one-out)
  self         the k demos' inputs, each after all k demos (itself included: a leak)

    python benchmarks/compile_queries.py --model smollm2-135m --tasks sst2,trec \
        --out benchmarks/results/compile_queries_smollm2-135m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ltv_vllm.extraction.capture import Capturer
from ltv_vllm.methods import score_methods
from ltv_vllm.models.hardware import hardware, machine_line
from ltv_vllm.models.loading import load_model
from ltv_vllm.pipeline.extract import (
    Captures,
    ExtractOptions,
    capture_episode,
    method_context,
    plan_episode,
)
from ltv_vllm.tasks.specs import get_task, label_token_ids

WAYS = ("queries", "loo", "self")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="sst2,trec")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compile_queries"))
    a = ap.parse_args()
    lm = load_model(a.model, dtype=a.dtype)
    cap = Capturer(lm.model, lm.tokenizer)
    res: dict = {"model": a.model, "dtype": str(lm.model.dtype), "n": a.n, "n_test": a.n_test,
                 "machine": hardware(), "tasks": {}}
    for name in a.tasks.split(","):
        task = get_task(name)
        opts = ExtractOptions(n=a.n, n_test=a.n_test, seed=a.seed, n_val=0, progress=False)
        ep = plan_episode(task, opts)
        label_ids = label_token_ids(task, lm.tokenizer)
        labels = torch.tensor([e.label for e in ep.test])
        full = capture_episode(cap, ep)  # real queries, and the test states all share
        demos = [task.query(e.text) for e in ep.demos]
        h_zs = cap.hidden(demos, desc=f"{name} demos zero-shot")
        prefix = ep.demo_prefix()
        loo = [("".join(task.demo(e.text, e.label) for j, e in enumerate(ep.demos) if j != i)
                + demos[i]) for i in range(len(demos))]
        fits = {"queries": full,
                "loo": Captures(h_zs, cap.hidden(loo, desc=f"{name} leave-one-out"),
                                full.h_zs_test, full.h_icl_test, 0.0, 0.0),
                "self": Captures(h_zs, cap.icl(prefix, demos, desc=f"{name} demos after all"),
                                 full.h_zs_test, full.h_icl_test, 0.0, 0.0)}
        per = {}
        for way, c in fits.items():
            ctx = method_context(lm, cap, ep, label_ids, opts, c)  # λ = 5, the default
            m = score_methods(ctx, ["ltv"], c.h_zs_test, c.h_icl_test, labels).metrics
            per[way] = {"rows": int(c.h_zs.shape[0]), **{k: m[k] for k in
                                                         ("zero-shot", "icl", "ltv")}}
        res["tasks"][name] = per
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    cmd = (f"python benchmarks/compile_queries.py --model {a.model} --tasks {a.tasks} "
           f"--n {a.n} --n-test {a.n_test} --out {a.out}")
    md = ["# Unlabeled queries for a compile: real inputs or the demos' own\n",
          f"```\n{cmd}\n```\n", f"{machine_line(res['machine'])}; {res['dtype']}; k = 30, "
          f"λ = 5, {a.n_test} test queries, seed {a.seed}.\n",
          "| task | fit on | rows | LTV accuracy | LTV d_NTP | ICL accuracy | zero-shot accuracy |",
          "|---|---|---|---|---|---|---|"]
    for name, per in res["tasks"].items():
        for way in WAYS:
            s = per[way]
            md.append(f"| {name} | {way} | {s['rows']} | {100 * s['ltv']['accuracy']:.1f} | "
                      f"{s['ltv']['d_ntp']:.3f} | {100 * s['icl']['accuracy']:.1f} | "
                      f"{100 * s['zero-shot']['accuracy']:.1f} |")
    (a.out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
