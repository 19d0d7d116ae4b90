"""An evaluation's result document read back: the summary over runs, correlations, the
markdown table with its cost and chosen-parameter lines, the plots, and results.json /
results.md written. Pure reading and rendering of what `evaluate` recorded (no model).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import atomic_write, save_figure
from ltv_vllm.core.metrics import pearson, spearman
from ltv_vllm.evaluation import ensemble as ens
from ltv_vllm.methods import METHODS as TASK_VECTOR_METHODS
from ltv_vllm.models.hardware import machine_line
from ltv_vllm.pipeline.transfer import TRANSFER_METHOD

TEACHER = "teacher"  # with --teacher: the teacher's own test accuracy (a reference row)
FIXED_LABELS = {"zero-shot": "Zero-shot", "icl": "ICL", TRANSFER_METHOD: "Transferred LTV",
                TEACHER: "Teacher", **ens.LABELS}
SOURCE = "source-"  # prefix of the source model's own methods in a transfer evaluation


def all_methods(demo_sets: int = 1) -> tuple[str, ...]:
    """Every method of a plain evaluation: the two references, then the registered ones; over
    M > 1 demonstration sets, then the multi-prompt references and LTV (`ensemble`)."""
    return ("zero-shot", "icl", *TASK_VECTOR_METHODS, *(ens.METHODS if demo_sets > 1 else ()))


def _label(m: str) -> str:
    return FIXED_LABELS.get(m) or (TASK_VECTOR_METHODS[m].label if m in TASK_VECTOR_METHODS
                                   else m)


def method_label(m: str) -> str:
    if m.startswith(SOURCE):
        return "Source " + _label(m.removeprefix(SOURCE))
    return _label(m)



def correlations(records: list[dict[str, Any]], tasks: list[str]) -> dict[str, Any]:
    """Pearson and Spearman between d_NTP and accuracy over (method, task, run) points, every
    method but ICL (its d_NTP is 0 by definition): pooled and per task (the paper's panels).

    `icl_gap`: d_NTP against |accuracy − ICL's accuracy| on the same task and run, pooled.
    d_NTP measures closeness to ICL, so it predicts accuracy only where ICL is the accurate
    one; against the gap it is meaningful whether ICL helps the model or not."""

    def corr(rs: list[dict[str, Any]], y=lambda r: r["accuracy"]) -> dict[str, Any]:
        xs, ys = [r["d_ntp"] for r in rs], [y(r) for r in rs]
        return {"pearson": pearson(xs, ys), "spearman": spearman(xs, ys), "points": len(rs)}

    pts = [r for r in records if not is_icl(r["method"])
           and not r["method"].startswith(SOURCE)]
    icl = {(r["task"], r["run"]): r["accuracy"] for r in records if r["method"] == "icl"}
    with_icl = [r for r in pts if (r["task"], r["run"]) in icl]
    return {"pooled": corr(pts),
            "per_task": {t: corr([r for r in pts if r["task"] == t]) for t in tasks},
            "icl_gap": corr(with_icl, lambda r: abs(r["accuracy"] - icl[r["task"], r["run"]]))}


def is_icl(m: str) -> bool:
    """An ICL reference (one prompt, a source's, the M-prompt ensemble or mean state): not a
    method fitted to ICL, so not a point of the d_NTP correlations."""
    return m.endswith("icl") or m in (ens.ENSEMBLE, ens.STATES)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(records: list[dict[str, Any]], tasks: list[str], methods: list[str]) -> dict:
    out: dict[str, Any] = {"per_task": {}, "average": {}}
    for t in tasks:
        out["per_task"][t] = {}
        for m in methods:
            rs = [r for r in records if r["task"] == t and r["method"] == m]
            acc, acc_std = _mean_std([r["accuracy"] for r in rs])
            d, d_std = _mean_std([r["d_ntp"] for r in rs])
            ext = [r["extraction_seconds"] for r in rs if r["extraction_seconds"] is not None]
            out["per_task"][t][m] = {
                "accuracy": acc,
                "accuracy_std": acc_std,
                "d_ntp": d,
                "d_ntp_std": d_std,
                "extraction_seconds": statistics.fmean(ext) if ext else None,
                "runs": len(rs),
            }
            if rs and all("d_ntp_ensemble" in r for r in rs):  # M > 1 demonstration sets
                e, e_std = _mean_std([r["d_ntp_ensemble"] for r in rs])
                out["per_task"][t][m] |= {"d_ntp_ensemble": e, "d_ntp_ensemble_std": e_std}
    for m in methods:
        cells = [out["per_task"][t][m] for t in tasks]
        out["average"][m] = {
            "accuracy": statistics.fmean(c["accuracy"] for c in cells),
            "d_ntp": statistics.fmean(c["d_ntp"] for c in cells),
            **({"d_ntp_ensemble": statistics.fmean(c["d_ntp_ensemble"] for c in cells)}
               if all("d_ntp_ensemble" in c for c in cells) else {}),
        }
    return out


def per_query_intervals(records: list[dict[str, Any]], tasks: list[str],
                        methods: list[str], ref: str = "icl") -> dict[str, Any]:
    """Each method against `ref` on the same test queries (`core.stats`): per task, the
    paired bootstrap interval of the accuracy difference over the task's test queries, each
    query's correctness averaged over the runs (which share the test subset); over tasks, the
    stratified one. {} where the records hold no per-query correctness (older results)."""
    from ltv_vllm.core.stats import paired_bootstrap, stratified_bootstrap

    def per_query(t: str, m: str) -> list[float] | None:
        rs = [r["correct"] for r in records if r["task"] == t and r["method"] == m
              and "correct" in r]
        if not rs or len(rs) != sum(r["task"] == t and r["method"] == m for r in records) \
                or len({len(c) for c in rs}) != 1:
            return None
        return [sum(col) / len(rs) for col in zip(*rs, strict=True)]

    out: dict[str, Any] = {}
    if ref not in methods:
        return out
    for m in methods:
        if m == ref:
            continue
        pairs = {t: (per_query(t, m), per_query(t, ref)) for t in tasks}
        if not pairs or any(a is None or b is None or len(a) != len(b)
                            for a, b in pairs.values()):
            continue
        out[m] = {t: paired_bootstrap(a, b).record() for t, (a, b) in pairs.items()}
        out[m]["average"] = stratified_bootstrap(list(pairs.values())).record()
    return out


def interval_lines(doc: dict[str, Any]) -> list[str]:
    """The per-query comparison against ICL (`per_query_intervals`), as a table."""
    got = (doc.get("intervals") or {}).get("methods") or {}
    if not got:
        return []
    cfg = doc["config"]
    tasks = cfg["tasks"]
    mark = {"above": "▲", "below": "▼", "tie": "="}

    def cell(r: dict[str, Any]) -> str:
        return (f"{100 * r['diff']:+.1f} [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] "
                f"{mark[r['verdict']]}")

    lines = ["", f"**Against {method_label(doc['intervals']['vs'])} on the same test queries** "
             "(accuracy difference in points; paired bootstrap 95 % interval over the test "
             "queries, each query's correctness averaged over the runs; Avg.: stratified over "
             "the tasks; ▲ above, ▼ below, = tie)", "",
             "| Method | " + " | ".join(tasks) + " | Avg. |", "|---|" + "---|" * (len(tasks) + 1)]
    for m, per in got.items():
        lines.append(f"| {_row_label(m, cfg)} | " + " | ".join(cell(per[t]) for t in tasks)
                     + f" | {cell(per['average'])} |")
    return lines


def markdown_table(doc: dict[str, Any]) -> str:
    cfg, summ = doc["config"], doc["summary"]
    tasks, methods = cfg["tasks"], cfg["methods"]
    transfer = TRANSFER_METHOD in methods
    k = cfg.get("k_per_task") or {t: cfg["k"] for t in tasks}
    ks = sorted(set(k.values()))
    k_text = f"k={ks[0]}" if len(ks) == 1 else "k=" + ", ".join(f"{t} {k[t]}" for t in tasks)
    model = f"Model `{cfg['model']}`"
    if transfer:
        model = f"Target (small) `{cfg['model']}`, source (large) `{cfg['source_model']}`"
    head = "| Method | " + " | ".join(tasks) + " | Avg. |"
    sep = "|---|" + "---|" * (len(tasks) + 1)
    sets = cfg.get("demo_sets", 1)
    sets_text = (f", {sets} demonstration sets per run (ICL: one prompt, its accuracy the mean "
                 f"over the {sets} prompts)" if sets > 1 else "")
    lines = [
        (f"{model} ({cfg['dtype']}), {k_text}, N={cfg['n']}, λ={cfg['lam']}, "
         f"{cfg['n_test']} test queries, {cfg['runs']} runs (mean ± std over runs){sets_text}."),
        "",
        "**Accuracy (%)**",
        "",
        head,
        sep,
    ]
    for m in methods:
        cells = []
        for t in tasks:
            c = summ["per_task"][t][m]
            std = f" ± {100 * c['accuracy_std']:.1f}" if not m.endswith("zero-shot") else ""
            cells.append(f"{100 * c['accuracy']:.1f}{std}")
        lines.append(
            f"| {_row_label(m, cfg)} | " + " | ".join(cells)
            + f" | {100 * summ['average'][m]['accuracy']:.1f} |"
        )
    if transfer and "ltv" in methods:  # the paper's "(+4.76)": against the target's own LTV
        deltas = [100 * (summ["per_task"][t][TRANSFER_METHOD]["accuracy"]
                         - summ["per_task"][t]["ltv"]["accuracy"]) for t in tasks]
        avg = 100 * (summ["average"][TRANSFER_METHOD]["accuracy"]
                     - summ["average"]["ltv"]["accuracy"])
        lines.append("| Δ transferred − target LTV | " + " | ".join(f"{d:+.1f}" for d in deltas)
                     + f" | {avg:+.1f} |")
    ref = ("; for transferred LTV, against the source's ICL, which it is fitted to" if transfer
           else f" (one prompt: the mean over the {sets} prompts)" if sets > 1 else "")
    title = (f"**d_NTP = KL(P_icl ‖ P_method) against the same model's ICL{ref}; "
             "label-restricted (lower is closer to ICL)**")
    lines += ["", title, "", head, sep]
    for m in methods:
        if m.endswith("icl"):
            continue
        cells = [f"{summ['per_task'][t][m]['d_ntp']:.3f}" for t in tasks]
        lines.append(
            f"| {_row_label(m, cfg)} | " + " | ".join(cells)
            + f" | {summ['average'][m]['d_ntp']:.3f} |"
        )
    lines += interval_lines(doc)
    lines += ensemble_lines(doc)
    lines += chosen_lines(doc)
    corr = doc.get("correlation")
    if corr and not transfer and corr["pooled"]["pearson"] is not None:
        p = corr["pooled"]
        per = ", ".join(f"{t} {_r(c['pearson'])} / {_r(c['spearman'])}"
                        for t, c in corr["per_task"].items())
        lines += ["", f"**d_NTP vs accuracy** over {p['points']} (method, task, run) points, "
                  f"every method but ICL: Pearson r = {_r(p['pearson'])}, Spearman ρ = "
                  f"{_r(p['spearman'])} (negative: lower d_NTP, higher accuracy). "
                  f"Per task (r / ρ): {per}."]
        gap = corr.get("icl_gap") or {}
        if gap.get("pearson") is not None:
            lines += ["", f"**d_NTP vs the gap to ICL's accuracy** |acc − acc_ICL| (same task "
                      f"and run) over {gap['points']} points: Pearson r = {_r(gap['pearson'])}, "
                      f"Spearman ρ = {_r(gap['spearman'])} (positive: closer to ICL's "
                      "distribution, closer to its accuracy, whether ICL helps or not)."]
    if "inference_cost" in doc:
        lines += ["", *cost_table(doc)]
    else:
        for m in ("ltv", SOURCE + "ltv", TRANSFER_METHOD):
            ext = [summ["per_task"][t].get(m, {}).get("extraction_seconds") for t in tasks]
            if any(e is not None for e in ext):
                lines += ["", f"**{_row_label(m, cfg).strip('*')} extraction time per run (s)**: "
                          + ", ".join(f"{t} {e:.1f}"
                                      for t, e in zip(tasks, ext, strict=True) if e is not None)]
    return "\n".join(lines) + "\n"


def ensemble_lines(doc: dict[str, Any]) -> list[str]:
    """Over M > 1 demonstration sets: d_NTP against the ICL ensemble, and how multi-prompt LTV
    compares with single-prompt ICL and with the ensemble's gain over zero-shot."""
    cfg, summ = doc["config"], doc["summary"]
    tasks, methods = cfg["tasks"], cfg["methods"]
    if cfg.get("demo_sets", 1) < 2:
        return []
    head = "| Method | " + " | ".join(tasks) + " | Avg. |"
    sep = "|---|" + "---|" * (len(tasks) + 1)
    lines = ["", f"**d_NTP = KL(P_ensemble ‖ P_method) against the {cfg['demo_sets']}-prompt ICL "
             "ensemble (their label distributions averaged); label-restricted**", "", head, sep]
    for m in methods:
        if m == ens.ENSEMBLE:
            continue
        cells = [f"{summ['per_task'][t][m]['d_ntp_ensemble']:.3f}" for t in tasks]
        lines.append(f"| {method_label(m)} | " + " | ".join(cells)
                     + f" | {summ['average'][m]['d_ntp_ensemble']:.3f} |")
    if not {ens.MULTI, ens.ENSEMBLE, "zero-shot"} <= set(methods):
        return lines
    acc = {t: {m: summ["per_task"][t][m]["accuracy"] for m in methods} for t in tasks}
    above = [t for t in tasks if acc[t][ens.MULTI] >= acc[t]["icl"]]
    shares = []
    for t in tasks:
        gain = acc[t][ens.ENSEMBLE] - acc[t]["zero-shot"]
        shares.append(f"{t} {100 * (acc[t][ens.MULTI] - acc[t]['zero-shot']) / gain:.0f} %"
                      if gain > 0 else f"{t} – (the ensemble does not beat zero-shot)")
    lines += ["", f"**{method_label(ens.MULTI)} at or above one-prompt ICL's accuracy** on "
              f"{len(above)} of {len(tasks)} tasks" + (f" ({', '.join(above)})" if above else "")
              + ". **Share of the ensemble's gain over zero-shot** it recovers: "
              + "; ".join(shares) + "."]
    return lines


def chosen_lines(doc: dict[str, Any]) -> list[str]:
    """What the self-tuning maps chose per task (median over runs): ltv-auto's λ, the
    kernel's γ and λ, both by leave-one-out error."""
    out = []
    tasks = doc["config"]["tasks"]
    for m in ("ltv-auto", "kernel"):
        if m not in doc["config"]["methods"]:
            continue
        cells = []
        for t in tasks:
            ps = [r["params"] for r in doc["records"]
                  if r["task"] == t and r["method"] == m and "params" in r]
            if ps:
                cells.append(f"{t} " + ", ".join(
                    f"{k} {statistics.median(p[k] for p in ps):.3g}" for k in ("lam", "gamma")
                    if k in ps[0]))
        if cells:
            out += ["", f"**{method_label(m)}: chosen by leave-one-out error** (median over "
                    "runs): " + "; ".join(cells) + "."]
    return out


def _r(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2f}"


def _cell(xs: list[float], fmt: str) -> str:
    return fmt.format(statistics.fmean(xs)) if xs else "–"


def cost_table(doc: dict[str, Any]) -> list[str]:
    """Extraction seconds per run and inference seconds per sample (paper Table 5), averaged
    over tasks; inference measured side by side in each task's first run."""
    cfg, summ, cost = doc["config"], doc["summary"], doc["inference_cost"]
    tasks = list(cost)
    n = cfg.get("cost_samples")
    lines = [f"**Cost** (extraction: s per run, mean over tasks and runs; inference: s per test "
             f"sample of a forward with the method applied, {n} samples per task, batch 1 and "
             f"batch {cfg['batch_size']}; ICL runs its whole prompt)", "",
             "| Method | Extraction (s) | Inference, batch 1 (s) | Inference, batched (s) |",
             "|---|---|---|---|"]
    for m in cfg["methods"]:
        ext = [summ["per_task"][t][m]["extraction_seconds"] for t in cfg["tasks"]]
        ext = [e for e in ext if e is not None]
        b1 = [cost[t][m]["batch1"] for t in tasks if m in cost[t]]
        bb = [cost[t][m]["batched"] for t in tasks if m in cost[t]]
        lines.append(f"| {method_label(m)} | {_cell(ext, '{:.1f}')} | {_cell(b1, '{:.4f}')} | "
                     f"{_cell(bb, '{:.4f}')} |")
    return lines


def _row_label(m: str, cfg: dict[str, Any]) -> str:
    if TRANSFER_METHOD not in cfg["methods"]:
        return method_label(m)
    if m == TRANSFER_METHOD:
        return "**Transferred LTV (source → target)**"
    side = "Source" if m.startswith(SOURCE) else "Target"
    return f"{side}: {_label(m.removeprefix(SOURCE))}"


def plot(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, records = doc["config"], doc["records"]
    tasks = cfg["tasks"]
    methods = [m for m in cfg["methods"] if not m.endswith("icl")]
    colors = method_colors()
    paths = []

    # d_NTP against accuracy, one point per run and method, one panel per task (paper Fig. 3).
    cols = min(4, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    for ax, t in zip(axes.flat, tasks, strict=False):
        for m in methods:
            rs = [r for r in records if r["task"] == t and r["method"] == m]
            ax.scatter([r["d_ntp"] for r in rs], [100 * r["accuracy"] for r in rs],
                       label=method_label(m), color=colors.get(m), alpha=0.8, s=22)
        icl = [100 * r["accuracy"] for r in records if r["task"] == t and r["method"] == "icl"]
        if icl:
            ax.axhline(statistics.fmean(icl), color=colors["icl"], ls="--", lw=1,
                       label="ICL (mean)")
        c = (doc.get("correlation") or {}).get("per_task", {}).get(t)
        ax.set_title(t if not c or c["pearson"] is None
                     else f"{t} (r = {c['pearson']:.2f}, ρ = {c['spearman']:.2f})", fontsize=9)
        ax.set_xlabel("d_NTP")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    k = cfg["k"] if cfg["k"] is not None else "/".join(
        str(v) for v in sorted(set((cfg.get("k_per_task") or {}).values())))
    pooled = (doc.get("correlation") or {}).get("pooled") or {}
    r = (f"; all points r = {pooled['pearson']:.2f}, ρ = {pooled['spearman']:.2f}"
         if pooled.get("pearson") is not None else "")
    fig.suptitle(f"{cfg['model']}: d_NTP vs accuracy (k={k}, N={cfg['n']}{r})")
    fig.tight_layout()
    p = out_dir / "dntp_vs_accuracy.png"
    save_figure(fig, p)
    paths.append(p)

    # Per-task accuracy bars with the std over runs.
    summ = doc["summary"]["per_task"]
    paths.append(bars_per_task(
        tasks, {m: [100 * summ[t][m]["accuracy"] for t in tasks] for m in cfg["methods"]},
        {m: [100 * summ[t][m]["accuracy_std"] for t in tasks] for m in cfg["methods"]},
        method_label, "accuracy (%)", f"{cfg['model']}: accuracy per task ({cfg['runs']} runs)",
        out_dir / "accuracy_per_task.png"))
    return paths


# the references' colours; each method declares its own (`Method.color`)
FIXED_COLORS = {"zero-shot": "tab:gray", "icl": "tab:green", "ltv-first": "lightsteelblue",
                SOURCE + "zero-shot": "silver", SOURCE + "ltv": "lightskyblue",
                SOURCE + "mean": "navajowhite", SOURCE + "icl": "yellowgreen",
                TRANSFER_METHOD: "tab:red", TEACHER: "darkgreen"}


def method_colors() -> dict[str, str]:
    """Every plotted series' colour: the references', then each registered method's."""
    return {**FIXED_COLORS, **ens.COLORS,
            **{name: m.color for name, m in TASK_VECTOR_METHODS.items()}}


def bars_per_task(tasks: list[str], values: dict[str, list[float]], errors: dict[str, list[float]],
                  label: Any, ylabel: str, title: str, path: Path) -> Path:
    """One group of bars per task, one bar per method (with its error bar), saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(values)
    fig, ax = plt.subplots(figsize=((0.25 * len(methods) + 0.6) * len(tasks) + 3, 3.6))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(tasks))]
        ax.bar(xs, values[m], width, yerr=errors[m], capsize=2, label=label(m),
               color=method_colors().get(m))
    ax.set_xticks(range(len(tasks)), tasks)
    positive = [v for vs in values.values() for v in vs if v > 0]
    if positive and max(positive) > 1000 * min(positive):
        # one degenerate method (an MSE of 1e20) would flatten every other bar to zero
        ax.set_yscale("log")
        ylabel += " (log scale)"
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, ncols=min(5, len(methods)))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def write_report(doc: dict[str, Any], out_dir: str | Path, command: str) -> list[Path]:
    """results.json, results.md (with the command that produced it) and the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {**doc, "command": command}
    j, md = out / "results.json", out / "results.md"
    atomic_write(j, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1)))
    table = markdown_table(doc)
    ext = doc.get("extends")
    while ext:  # earlier evaluations' episodes are part of this table: say where they ran
        command += (f"\n```\n\nextending an earlier evaluation (tasks {', '.join(ext['tasks'])}; "
                    f"{ext['runs']} runs) on {machine_line(ext['machine'] or {})}:\n\n```\n"
                    f"{ext['command']}")
        ext = ext.get("extends")
    text = f"# ltv-vllm evaluate\n\n```\n{command}\n```\n\n{table}\n" \
           f"Machine: {machine_line(doc['machine'])}, torch {doc['machine']['torch']}, " \
           f"{doc['config']['dtype']}; wall time {doc['wall_seconds'] / 60:.1f} min.\n"
    atomic_write(md, lambda tmp: Path(tmp).write_text(text))
    return [j, md, *plot(doc, out)]
