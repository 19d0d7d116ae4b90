"""Which live statistic tells drifted traffic from the traffic a task was fitted for.

For each task (default trec, sst2, agnews) and each fit (`default`: what `ltv-vllm extract
--task T` writes, its gold labels blended in; `paper`: `--gold-weight 0`, the paper's fit to
the ICL prompt alone), the vector is extracted on the packaged model with the CLI, then
re-asked as live fidelity re-asks a served request (`serving.api_server.fidelity`), here with
transformers (the server's readout gives these very numbers: tests/test_fidelity.py):

  * matched traffic: the task's own test queries (test seed 1: not the extraction's test
    subset), in its zero-shot prompt;
  * drifted traffic: each other task's test queries, in this task's zero-shot prompt (a
    client of this task sending another kind of text).

Per re-ask: the KL(P_icl ‖ P_tv) over the task's labels (the live KL), whether the two
argmax agree, the vector's own label entropy and margin (read without the ICL re-ask), the
ICL prompt's entropy, and two statistics of the zero-shot state alone (what the engine sees
of every row): the shift's relative size ‖Δh‖/‖h‖ (the served
`ltv_vllm:task_shift_relative_size`) and the share of h outside the span of the vector's V
(the directions its map reads). Per (task, fit, traffic): the mean of each with a 95 % bootstrap
interval; per (task, fit, statistic): the AUC of matched against drifted (how often a drifted
re-ask scores higher than a matched one; 0.5: no separation). Per-re-ask values are kept.

    python benchmarks/fidelity_signal.py --out benchmarks/results/fidelity_signal_smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

STATS = ("kl", "disagree", "tv_entropy", "tv_margin", "icl_entropy", "shift_size",
         "off_span")


def extract(task: str, fit: str, out: Path, model: str) -> Path:
    path = out / "vectors" / f"{task}.{fit}.pt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "ltv_vllm.cli", "extract", "--model", model, "--task",
               task, "-o", str(path), "--quiet",
               *(["--gold-weight", "0"] if fit == "paper" else [])]
        subprocess.run(cmd, check=True)
    return path


def per_request(cap, model, task, tv, texts: list[str]) -> dict[str, list[float]]:
    """Each text as a re-ask of `tv`'s task: the statistics above, over its label tokens."""
    import torch

    from ltv_vllm.core.metrics import kl_per_query, restricted_log_probs
    from ltv_vllm.extraction.capture import label_head, zero_shot_states
    from ltv_vllm.serving.api_server.fidelity import teacher_of

    teacher = teacher_of(tv)
    labels = list(tv.label_token_ids)
    w, b = label_head(model, labels)
    w, b = w.double(), b.double()
    h_zs = zero_shot_states(cap, task, texts, desc=f"{task.name} zero-shot").double()
    h_icl = cap.icl(teacher.prefix, [task.query(t) for t in texts],
                    desc=f"{task.name} ICL").double()
    tv64 = tv.to("cpu", torch.float64)
    h_tv = tv64.shift_hidden(h_zs)
    z_tv = h_tv @ w.T + b
    # what the engine sees of a row without an ICL re-ask: the shift's relative size (the
    # served `task_shift_relative_size`), and the share of h outside the span of V (the
    # directions the map reads: the fitted queries' states span them)
    q, _ = torch.linalg.qr(tv64.V)
    norm = torch.linalg.vector_norm(h_zs, dim=1)
    off = torch.linalg.vector_norm(h_zs - (h_zs @ q) @ q.T, dim=1) / norm
    z_icl = h_icl @ w.T + b
    lp_tv, lp_icl = restricted_log_probs(z_tv), restricted_log_probs(z_icl)
    top2 = lp_tv.topk(2, -1).values
    return {"kl": kl_per_query(z_icl, z_tv).tolist(),
            "disagree": (z_icl.argmax(-1) != z_tv.argmax(-1)).double().tolist(),
            "tv_entropy": (-(lp_tv.exp() * lp_tv).sum(-1)).tolist(),
            "tv_margin": (top2[:, 0] - top2[:, 1]).tolist(),
            "icl_entropy": (-(lp_icl.exp() * lp_icl).sum(-1)).tolist(),
            "shift_size": (torch.linalg.vector_norm(h_tv - h_zs, dim=1) / norm).tolist(),
            "off_span": off.tolist()}


def interval(xs: list[float], reps: int = 2000, seed: int = 0) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(seed)
    t = torch.tensor(xs, dtype=torch.float64)
    idx = torch.randint(len(xs), (reps, len(xs)), generator=g)
    means = t[idx].mean(1)
    return [float(t.mean()), float(means.quantile(0.025)), float(means.quantile(0.975))]


def auc(matched: list[float], drifted: list[float]) -> float:
    """P(a drifted value > a matched one) + ½ P(tie): the Mann-Whitney statistic."""
    import torch

    a = torch.tensor(matched, dtype=torch.float64)[:, None]
    d = torch.tensor(drifted, dtype=torch.float64)[None, :]
    return float(((d > a).double() + 0.5 * (d == a).double()).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="trec,sst2,agnews")
    ap.add_argument("--fits", default="default,paper")
    ap.add_argument("--n", type=int, default=200, help="re-asks per traffic kind")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--references", action="store_true",
                    help="only record each vector's extraction-time off-span share (what a "
                    "server exports as ltv_vllm:task_extraction_off_span) into an earlier "
                    "run's results.json, and the alert replay")
    args = ap.parse_args()
    if args.references:
        return references(args)
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.tasks.data import load_dataset, sample_test
    from ltv_vllm.tasks.specs import get_task

    t0 = time.time()
    names = args.tasks.split(",")
    fits = args.fits.split(",")
    tasks = {t: get_task(t) for t in names}
    texts = {t: [e.text for e in sample_test(load_dataset(tasks[t]), args.n, 1)]
             for t in names}
    vectors = {(t, f): extract(t, f, args.out, args.model) for t in names for f in fits}
    lm = load_model(args.model, dtype="float32")
    rows, records = [], []
    for (t, f), path in vectors.items():
        tv = load_task_vector(path)
        task = tasks[t]
        cap = Capturer(lm.model, lm.tokenizer, batch_size=16, progress=True,
                       special_tokens=task.special_tokens)
        per = {src: per_request(cap, lm.model, task, tv, texts[src]) for src in names}
        d = (tv.provenance.metrics or {}).get("ltv", {}).get("d_ntp")
        drifted = {s: [x for src in names if src != t for x in per[src][s]] for s in STATS}
        rows.append({"task": t, "fit": f, "extraction_d_ntp": d,
                     "matched": {s: interval(per[t][s]) for s in STATS},
                     "drifted": {src: {s: interval(per[src][s]) for s in STATS}
                                 for src in names if src != t},
                     "auc": {s: auc(per[t][s], drifted[s]) for s in STATS}})
        records.append({"task": t, "fit": f, "per_request": per})
        print(t, f, {s: round(rows[-1]["auc"][s], 3) for s in STATS}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/fidelity_signal.py " + " ".join(sys.argv[1:])
    doc = {"command": command, "model": args.model, "n": args.n, "machine": machine(),
           "wall_seconds": time.time() - t0, "rows": rows}
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    (args.out / "records.json").write_text(json.dumps(records))
    (args.out / "README.md").write_text(markdown(doc))
    print(markdown(doc))


WINDOW = 20  # re-asks per alert window: the rule's minimum count (docs/operating.md)
RATIO = 1.3  # the rule's threshold: live mean off-span share over the extraction's


def references(args: argparse.Namespace) -> None:
    """Each (task, fit)'s extraction-time off-span share from its vector file (extracted
    again where missing: the same command, the same seeds), then the alert replayed on the
    recorded re-asks: consecutive windows of WINDOW, each window's mean over the reference."""
    from ltv_vllm.core.vector import load_task_vector

    doc = json.loads((args.out / "results.json").read_text())
    records = json.loads((args.out / "records.json").read_text())
    for row in doc["rows"]:
        tv = load_task_vector(extract(row["task"], row["fit"], args.out, doc["model"]))
        row["extraction_off_span"] = tv.provenance.metrics["ltv"]["off_span"]
    doc["references_command"] = "python benchmarks/fidelity_signal.py " + " ".join(sys.argv[1:])
    doc["replay"] = replay(doc, records)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    (args.out / "README.md").write_text(markdown(doc))
    print(markdown(doc))


def replay(doc: dict, records: list[dict]) -> list[dict]:
    """Per (task, fit, traffic): the windows' mean off-span share over the extraction's,
    smallest and largest, and how many windows the rule (> RATIO) fires on."""
    refs = {(r["task"], r["fit"]): r["extraction_off_span"] for r in doc["rows"]}
    out = []
    for rec in records:
        ref = refs[(rec["task"], rec["fit"])]
        for src, per in rec["per_request"].items():
            xs = per["off_span"]
            ratios = [sum(xs[i:i + WINDOW]) / WINDOW / ref
                      for i in range(0, len(xs) - WINDOW + 1, WINDOW)]
            out.append({"task": rec["task"], "fit": rec["fit"], "traffic": src,
                        "matched": src == rec["task"], "windows": len(ratios),
                        "min": min(ratios), "max": max(ratios),
                        "fired": sum(r > RATIO for r in ratios)})
    return out


def markdown(doc: dict) -> str:
    from ltv_vllm.models.hardware import machine_line

    lines = ["# Live fidelity: which statistic separates drifted traffic", "", "```",
             doc["command"], "```", "",
             f"`{doc['model']}` float32, {doc['n']} re-asks per traffic kind; "
             f"{machine_line(doc['machine'])}; {doc['wall_seconds'] / 60:.1f} min.", "",
             "Means with 95 % bootstrap intervals; AUC: P(drifted > matched).", "",
             "| task | fit | d_NTP (file) | traffic | KL | disagree | tv entropy | shift size "
             "| off span |", "|---|---|---|---|---|---|---|---|---|"]

    def cell(v: list[float]) -> str:
        return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"

    for r in doc["rows"]:
        d = r["extraction_d_ntp"]
        for src, st in [("matched", r["matched"]), *r["drifted"].items()]:
            lines.append(f"| {r['task']} | {r['fit']} | "
                         f"{'–' if d is None else f'{d:.3f}'} | {src} | {cell(st['kl'])} | "
                         f"{cell(st['disagree'])} | {cell(st['tv_entropy'])} | "
                         f"{cell(st['shift_size'])} | {cell(st['off_span'])} |")
    lines += ["", "| task | fit | " + " | ".join(f"AUC {s}" for s in STATS) + " |",
              "|---|---|" + "---|" * len(STATS)]
    for r in doc["rows"]:
        lines.append(f"| {r['task']} | {r['fit']} | "
                     + " | ".join(f"{r['auc'][s]:.3f}" for s in STATS) + " |")
    if doc.get("replay"):
        lines += ["", "## The drift alert, replayed", "", "```", doc["references_command"],
                  "```", "",
                  f"docs/operating.md's rule: the mean off-span share of a task's last "
                  f"{WINDOW}+ re-asks above {RATIO} × the extraction's (the vector file's "
                  "`off_span`, on its own held-out queries; test seed 0, while the re-asks "
                  f"above are test seed 1). The recorded re-asks in consecutive windows of "
                  f"{WINDOW}:", "",
                  "| task | fit | reference (file) | traffic | windows | mean / reference, "
                  "min – max | fired |", "|---|---|---|---|---|---|---|"]
        refs = {(r["task"], r["fit"]): r["extraction_off_span"] for r in doc["rows"]}
        for x in doc["replay"]:
            lines.append(f"| {x['task']} | {x['fit']} | {refs[(x['task'], x['fit'])]:.4f} | "
                         f"{x['traffic']}{' (matched)' if x['matched'] else ''} | "
                         f"{x['windows']} | {x['min']:.2f} – {x['max']:.2f} | "
                         f"{x['fired']} of {x['windows']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
