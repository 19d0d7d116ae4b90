"""What serving an LTV at a lower rank costs in quality.

A fitted LTV has rank up to N (256); its factors are SVD-ordered, so its best rank-R
approximation is its first R columns (`ridge.truncate`). vLLM's CPU LoRA kernel gathers a
vocab × rank matrix per sampled row, so multi-task serving gets cheaper as R drops; this
measures what R does to accuracy and d_NTP. Per task and run: one episode's captures and one
fit, then every rank scored on the same held-out states (the full rank is the last row), so
differences between ranks are the truncation's alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..fileio import save_figure

FULL = "full"


def bench_rank(model_spec: str, task_names: list[str], *, ranks: Sequence[int], runs: int, k: int,
               n: int, lam: float, n_test: int, seed: int, batch_size: int, dtype: str,
               out_dir: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    from ..capture import Capturer, label_head
    from ..data import load_dataset, sample_episode
    from ..extract import (
        capture_episode,
        capture_test_zero_shot,
        episode_labels,
        load_model,
        score_episode,
    )
    from ..tasks import get_task, label_token_ids
    from ..vllm_ext.lora import VLLM_LORA_RANKS, lora_rank
    from . import report
    from .workload import machine

    lm = load_model(model_spec, dtype=dtype)
    cap = Capturer(lm.model, lm.tokenizer, batch_size=batch_size, progress=True)
    vocab = lm.identity.vocab_size
    rows: list[dict[str, Any]] = []
    for name in task_names:
        task = get_task(name)
        label_ids = label_token_ids(task, lm.tokenizer)
        w_c, b_c = label_head(lm.model, label_ids)
        dataset = load_dataset(task)
        h_zs_test = None
        for run in range(runs):
            ep = sample_episode(dataset, k=k, n=n, n_test=n_test, seed=seed + run)
            if h_zs_test is None:  # the test subset is the same for every run
                h_zs_test = capture_test_zero_shot(cap, task, ep)
            c = capture_episode(cap, ep, h_zs_test=h_zs_test)
            labels = episode_labels(ep)
            full = score_episode(c, lam, w_c, b_c, labels, ("zero-shot", "icl", "ltv"))
            r_full = int(full.factors.U.shape[1])
            base = {"task": name, "run": run, "seed": seed + run, "full_rank": r_full,
                    "zero-shot": full.metrics["zero-shot"], "icl": full.metrics["icl"]}
            for r in [*[x for x in ranks if x < r_full], r_full]:
                res = full if r == r_full else score_episode(c, lam, w_c, b_c, labels,
                                                             ("icl", "ltv"), rank=r)
                lr = lora_rank(r) if r <= VLLM_LORA_RANKS[-1] else None
                rows.append({**base, "rank": r, "ltv": res.metrics["ltv"],
                             "rank_label": FULL if r == r_full else str(r), "lora_rank": lr,
                             "lora_b_bytes_bf16": vocab * lr * 2 if lr else None})
            log(f"{name} run {run}: full rank {r_full}, LTV "
                f"{100 * full.metrics['ltv']['accuracy']:.1f}% at full rank")
    doc = {"command": command, "model": model_spec, "dtype": str(lm.model.dtype),
           "k": k, "n": n, "lam": lam, "n_test": n_test, "runs": runs, "vocab_size": vocab,
           "threads": torch.get_num_threads(), "machine": machine(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows,
           "summary": summarise(rows)}
    report.write(doc, out_dir, rank_markdown(doc))
    doc["plots"] = [str(rank_plot(doc, out_dir))]
    return doc


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{rank_label: {task and "avg": {accuracy, d_ntp, ...}}} as means over runs."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    labels = list(dict.fromkeys(r["rank_label"] for r in sorted(rows, key=lambda r: r["rank"])))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    for lab in [*labels, "zero-shot", "icl"]:
        per: dict[str, dict[str, float]] = {}
        for t in tasks:
            if lab in ("zero-shot", "icl"):
                sel = [r[lab] for r in rows if r["task"] == t and r["rank_label"] == FULL]
            else:
                sel = [r["ltv"] for r in rows if r["task"] == t and r["rank_label"] == lab]
            if sel:
                per[t] = {m: statistics.fmean(x[m] for x in sel) for m in ("accuracy", "d_ntp")}
        if per:
            per["avg"] = {m: statistics.fmean(v[m] for v in per.values()) for m in ("accuracy", "d_ntp")}
            out[lab] = per
    return out


def rank_markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    tasks = [t for t in next(iter(s.values())) if t != "avg"]
    lora_mib = {r["rank_label"]: r["lora_b_bytes_bf16"] / 2**20 for r in doc["rows"]
                if r["lora_b_bytes_bf16"]}
    lines = [
        "# LTV at a lower rank: accuracy and d_NTP", "", "```", doc["command"], "```", "",
        (f"Model `{doc['model']}` ({doc['dtype']}), k={doc['k']}, N={doc['n']}, "
         f"λ={doc['lam']}, {doc['n_test']} test queries, {doc['runs']} run(s) (means over runs). "
         "Each rank is the best rank-R approximation of the same fit, scored on the same test "
         "states; `full` is the fit's own rank. LoRA B = vocab × (rank padded to one vLLM "
         "accepts) in bf16: what vLLM's CPU LoRA kernel gathers per sampled row."), "",
    ]
    for metric, title, fmt in (("accuracy", "Accuracy (%)", lambda x: f"{100 * x:.1f}"),
                               ("d_ntp", "d_NTP (vs ICL)", lambda x: f"{x:.3f}")):
        lines += [f"**{title}**", "",
                  "| LTV rank | LoRA B (MiB) | " + " | ".join(tasks) + " | Avg. |",
                  "|---|---|" + "---|" * (len(tasks) + 1)]
        for lab, per in s.items():
            if metric == "d_ntp" and lab == "icl":
                continue  # 0 by definition
            name = lab if lab in ("zero-shot", "icl") else f"LTV r={lab}"
            mib = f"{lora_mib[lab]:.1f}" if lab in lora_mib else "—"
            lines.append(f"| {name} | {mib} | "
                         + " | ".join(fmt(per[t][metric]) for t in tasks)
                         + f" | {fmt(per['avg'][metric])} |")
        lines.append("")
    return "\n".join(lines)


def rank_plot(doc: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in ((axes[0], "accuracy", "accuracy"), (axes[1], "d_ntp", "d_NTP vs ICL")):
        for t in tasks:
            pts: dict[int, list[float]] = {}
            for r in rows:
                if r["task"] == t:
                    pts.setdefault(r["rank"], []).append(r["ltv"][metric])
            xs = sorted(pts)
            line, = ax.plot(xs, [statistics.fmean(pts[x]) for x in xs], "o-", label=f"{t} LTV")
            ref = "icl" if metric == "accuracy" else "zero-shot"
            vals = [r[ref][metric] for r in rows if r["task"] == t and r["rank_label"] == FULL]
            ax.axhline(statistics.fmean(vals), color=line.get_color(), ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("LTV rank R (best rank-R approximation)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} (dotted: {'ICL' if metric == 'accuracy' else 'zero-shot'})")
        ax.legend(fontsize=8)
    fig.suptitle(f"{doc['model']}: LTV quality against rank")
    fig.tight_layout()
    return save_figure(fig, out_dir / "rank.png")
