"""What serving an LTV at a lower rank costs in quality.

A fitted LTV has rank up to N (256). vLLM's CPU LoRA kernel gathers a vocab × rank matrix per
sampled row, so multi-task serving gets cheaper as the rank drops; this measures what a cut to
rank R does to accuracy and d_NTP, for the cut we ship (`ridge.truncate` weighted by the
train states and the LM head) and for a plain SVD of W. Per task and run: one episode's
captures and one fit, then every cut scored on the same held-out states (`full` is the fit
itself), so differences between rows are the cut's alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import save_figure
from ltv_vllm.models.hardware import machine_line

FULL = "full"


@dataclass(frozen=True)
class RankSpec:
    """What every process's rank runner shares, picklable (`evaluation.executor`)."""

    ranks: tuple[int, ...]
    k: int
    n: int
    lam: float
    n_test: int
    seed: int
    batch_size: int

    def runner(self, lm: Any, *, progress: bool = False) -> RankRunner:
        return RankRunner(self, lm, progress)


class RankRunner:
    """One process's rank episodes (the driver's, or a Ray worker's): per task its label
    rows, data and test states, kept while that task's runs go on."""

    def __init__(self, spec: RankSpec, lm: Any, progress: bool) -> None:
        from ltv_vllm.extraction.capture import Capturer

        self.spec, self.lm = spec, lm
        self.cap = Capturer(lm.model, lm.tokenizer, batch_size=spec.batch_size,
                            progress=progress)
        self.vocab = lm.identity.vocab_size
        self.task_name: str | None = None
        self.held: dict[str, Any] = {}

    def _task(self, name: str) -> dict[str, Any]:
        from ltv_vllm.core.ridge import head_gram
        from ltv_vllm.extraction.capture import full_head, label_head
        from ltv_vllm.tasks.data import load_dataset
        from ltv_vllm.tasks.specs import get_task, label_token_ids

        if name != self.task_name:
            task = get_task(name)
            label_ids = label_token_ids(task, self.lm.tokenizer)
            self.task_name = name
            self.held = {"task": task, "label_ids": label_ids,
                         "head": label_head(self.lm.model, label_ids),
                         "hg": head_gram(full_head(self.lm.model)[0]),
                         "dataset": load_dataset(task), "h_zs_test": None}
        return self.held

    def run(self, name: str, run: int) -> Any:
        """Episode (`name`, `run`): one record per rank (the full one last)."""
        from ltv_vllm.core.ridge import Factors, truncate
        from ltv_vllm.evaluation.episodes import EpisodeResult
        from ltv_vllm.methods import Context, MethodOptions, score_methods
        from ltv_vllm.pipeline.extract import (
            capture_episode,
            capture_test_zero_shot,
            episode_labels,
        )
        from ltv_vllm.serving.store.lora import VLLM_LORA_RANKS, lora_rank
        from ltv_vllm.tasks.data import sample_episode

        sp, held = self.spec, self._task(name)
        w_c, b_c = held["head"]
        ep = sample_episode(held["dataset"], k=sp.k, n=sp.n, n_test=sp.n_test,
                            seed=sp.seed + run)
        if held["h_zs_test"] is None:  # the test subset is the same for every run
            held["h_zs_test"] = capture_test_zero_shot(self.cap, held["task"], ep)
        c = capture_episode(self.cap, ep, h_zs_test=held["h_zs_test"])
        labels = episode_labels(ep)
        # the full-rank LTV, fitted by the registry's method like every extraction
        ctx = Context(self.cap, ep, held["label_ids"],
                      MethodOptions(lam=sp.lam, batch_size=sp.batch_size),
                      identity=self.lm.identity, h_zs=c.h_zs, h_icl=c.h_icl)
        full = score_methods(ctx, ["ltv"], c.h_zs_test, c.h_icl_test, labels, head=(w_c, b_c))
        tv = full.artifacts["ltv"]
        f = Factors(tv.U, tv.V, str(tv.provenance.ridge_form), gram=tv.gram)
        r_full = int(f.U.shape[1])
        scored = partial(_score, h=c.h_zs_test, w_c=w_c, b_c=b_c, labels=labels,
                         z_icl=full.logits["icl"])
        base = {"task": name, "run": run, "seed": sp.seed + run, "full_rank": r_full,
                "zero-shot": full.metrics["zero-shot"], "icl": full.metrics["icl"]}
        recs = []
        for r in [*[x for x in sp.ranks if x < r_full], r_full]:
            lr = lora_rank(r) if r <= VLLM_LORA_RANKS[-1] else None
            recs.append({
                **base, "rank": r, "rank_label": FULL if r == r_full else str(r),
                # what ships: weighted by the train states and the LM head
                "ltv": scored(truncate(f, r, head_gram=held["hg"])),
                # a plain SVD of W, for comparison
                "ltv_plain": scored(truncate(Factors(f.U, f.V, f.form), r)),
                "lora_rank": lr, "lora_b_bytes_bf16": self.vocab * lr * 2 if lr else None})
        return EpisodeResult(name, run, recs, note=(
            f"{name} run {run}: full rank {r_full}, LTV "
            f"{100 * full.metrics['ltv']['accuracy']:.1f}% at full rank"))


def bench_rank(model_spec: str, task_names: list[str], *, ranks: Sequence[int], runs: int, k: int,
               n: int, lam: float, n_test: int, seed: int, batch_size: int, dtype: str,
               out_dir: Path, command: str, executor: Any = None,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every (task, run) through `executor` (`evaluation.executor`; None: here, in order),
    `dtype` concrete (every episode's); then results.json / .md and the plot."""
    import torch

    from ltv_vllm.bench import report
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.evaluation.executor import failed_list, run_sweep
    from ltv_vllm.evaluation.sweep import Sweep
    from ltv_vllm.models.checkpoint import identity_from_dir
    from ltv_vllm.models.loading import load_model, local_model_dir

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    spec = RankSpec(tuple(ranks), k, n, lam, n_test, seed, batch_size)
    sweep = Sweep({"ranks": list(ranks)}, task_names, runs, desc="rank runs")
    failed = run_sweep(sweep, executor, spec,
                       lambda: spec.runner(load_model(model_spec, dtype=dtype), progress=True),
                       keep=lambda res: log(res.note))
    rows = sweep.records
    doc = {"command": command, "model": model_spec, "dtype": f"torch.{dtype}",
           "k": k, "n": n, "lam": lam, "n_test": n_test, "runs": runs,
           "vocab_size": identity_from_dir(local_model_dir(model_spec)).vocab_size,
           "threads": torch.get_num_threads(), "machine": machine(),
           "started": started,
           "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows,
           "summary": summarise(rows),
           **({"failed": failed_list(failed)} if failed else {})}
    if rows:  # (none where every episode raised: the caller lists why, `failed`)
        report.write(doc, out_dir, rank_markdown(doc))
        doc["plots"] = [str(rank_plot(doc, out_dir))]
    return doc


def _score(cut: Any, *, h: Any, w_c: Any, b_c: Any, labels: Any, z_icl: Any) -> dict[str, float]:
    """Accuracy and d_NTP of h + W_R h on the test states (label-restricted logits)."""
    from ltv_vllm.core.metrics import accuracy, d_ntp

    z = (h + cut.apply(h)) @ w_c.T + b_c
    return {"accuracy": accuracy(z, labels), "d_ntp": d_ntp(z_icl, z)}


def _rows_in_order(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(row name, rank label, key in a result row) for the tables, in display order."""
    labels = list(dict.fromkeys(r["rank_label"] for r in sorted(rows, key=lambda r: r["rank"])))
    cut = [x for x in labels if x != FULL]
    return ([(f"LTV r={x}", x, "ltv") for x in cut] + [(f"LTV r={FULL}", FULL, "ltv")]
            + [(f"plain SVD r={x}", x, "ltv_plain") for x in cut]
            + [("zero-shot", FULL, "zero-shot"), ("icl", FULL, "icl")])


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{row name: {task and "avg": {accuracy, d_ntp}}}, means over runs."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    for name, lab, key in _rows_in_order(rows):
        per = {}
        for t in tasks:
            sel = [r[key] for r in rows if r["task"] == t and r["rank_label"] == lab]
            per[t] = {m: statistics.fmean(x[m] for x in sel) for m in ("accuracy", "d_ntp")}
        per["avg"] = {m: statistics.fmean(v[m] for v in per.values())
                      for m in ("accuracy", "d_ntp")}
        out[name] = per
    return out


def rank_markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    tasks = [t for t in next(iter(s.values())) if t != "avg"]
    lora_mib = {name: r["lora_b_bytes_bf16"] / 2**20 for name, lab, _ in _rows_in_order(doc["rows"])
                for r in doc["rows"] if r["rank_label"] == lab and r["lora_b_bytes_bf16"]
                and name.startswith(("LTV", "plain"))}
    lines = [
        "# LTV at a lower rank: accuracy and d_NTP", "", "```", doc["command"], "```", "",
        (f"Model `{doc['model']}` ({doc['dtype']}), k={doc['k']}, N={doc['n']}, "
         f"λ={doc['lam']}, {doc['n_test']} test queries, {doc['runs']} run(s) (means over runs); "
         f"{machine_line(doc['machine'])}. "
         "`LTV r=R`: the fit cut to rank R as ltv-vllm does (`extract --rank`, `export-lora "
         "--rank`, `serve --lora-rank`): min ‖W_lm (W − W_R) H‖ over the train states H; "
         "`plain SVD r=R`: W's own top-R singular directions; `full`: the fit itself. All "
         "scored on the same test states. LoRA B = vocab × (rank padded to one vLLM accepts) "
         "in bf16: what vLLM's CPU LoRA kernel gathers per sampled row."), "",
    ]
    for metric, title, fmt in (("d_ntp", "d_NTP (vs ICL; lower is closer)", lambda x: f"{x:.3f}"),
                               ("accuracy", "Accuracy (%)", lambda x: f"{100 * x:.1f}")):
        lines += [f"**{title}**", "",
                  "| Method | LoRA B (MiB) | " + " | ".join(tasks) + " | Avg. |",
                  "|---|---|" + "---|" * (len(tasks) + 1)]
        for name, per in s.items():
            if metric == "d_ntp" and name == "icl":
                continue  # 0 by definition
            mib = f"{lora_mib[name]:.1f}" if name in lora_mib else "—"
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
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in ((axes[0], "d_ntp", "d_NTP vs ICL"),
                              (axes[1], "accuracy", "accuracy")):
        for t in tasks:
            color = None
            for key, style, what in (("ltv", "o-", "ltv-vllm cut"),
                                     ("ltv_plain", "x--", "plain SVD")):
                pts: dict[int, list[float]] = {}
                for r in rows:
                    if r["task"] == t:
                        pts.setdefault(r["rank"], []).append(r[key][metric])
                xs = sorted(pts)
                line, = ax.plot(xs, [statistics.fmean(pts[x]) for x in xs], style, color=color,
                                label=f"{t} {what}")
                color = line.get_color()
            ref = "zero-shot" if metric == "d_ntp" else "icl"
            vals = [r[ref][metric] for r in rows if r["task"] == t and r["rank_label"] == FULL]
            ax.axhline(statistics.fmean(vals), color=color, ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rank R")
        ax.set_ylabel(label)
        ax.set_title(f"{label} (dotted: {'zero-shot' if metric == 'd_ntp' else 'ICL'})")
        ax.legend(fontsize=7)
    fig.suptitle(f"{doc['model']}: LTV cut to rank R")
    fig.tight_layout()
    return save_figure(fig, out_dir / "rank.png")
