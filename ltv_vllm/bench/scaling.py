"""How much of ICL a vector recovers against N, from one prompt and from M (issue 54).

Per task and run, one episode at the largest N with M demonstration sets, captured once:
  * the train queries of a smaller N are the first N of them (`sample_episode` draws its
    queries one by one from a seeded stream, so the N = 256 queries are the N = 1,024 ones'
    first 256: the episode `evaluate --n 256` fits on, save that its further demonstration
    sets are drawn among the examples the larger N leaves free);
  * their states are captured in nested slices, each timed, so the capture time of N is the
    sum of its slices' (zero-shot and the first set for the paper's LTV; every set for
    multi-prompt LTV);
  * the test subset's zero-shot states and every set's ICL states once.
Each episode records the machine that timed it (`machine_line`): a sweep grown on another
machine keeps its old episodes' timings, and the report then gives capture times per task
and machine instead of one mean over machines that cannot be compared.
For every N, the registry's `ltv` is fitted to the first set's states (the paper's LTV) and
to the mean of the M sets' (multi-prompt LTV), and everything is scored with
`evaluation.ensemble`: accuracy, d_NTP against one prompt and against the M-prompt ensemble.

Recovery is (acc − acc_zero-shot) / (acc_ref − acc_zero-shot) against single-prompt ICL and
against the ensemble, reported only where the reference beats zero-shot by `MIN_GAIN` (a
gain of a query or two is no denominator: it turns a one-query difference into ±600 %).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import save_figure
from ltv_vllm.evaluation import ensemble as ens
from ltv_vllm.models.hardware import machine_line

FITS = ("ltv", ens.MULTI)  # the paper's LTV (first set), multi-prompt LTV (the sets' mean)
REFS = ("zero-shot", "icl", ens.ENSEMBLE, ens.STATES)
MIN_GAIN = 0.02  # accuracy points (of 1) a reference must gain over zero-shot for a recovery


@dataclass(frozen=True)
class ScalingSpec:
    """What every process's scaling runner shares, picklable (`evaluation.executor`): the
    tasks by name and the sweep's settings."""

    tasks: dict[str, Any]
    ns: tuple[int, ...]
    demo_sets: int
    k: int
    lam: float | str
    n_test: int
    seed: int
    batch_size: int
    teacher: Any  # core.teacher.TeacherOptions

    def runner(self, lm: Any, *, progress: bool = False) -> ScalingRunner:
        return ScalingRunner(self, lm, progress)


class ScalingRunner:
    """One process's scaling episodes (the driver's, or a Ray worker's): its capturer, and
    per task its label rows and zero-shot test states. Each record names the machine that
    timed it (this process's)."""

    def __init__(self, spec: ScalingSpec, lm: Any, progress: bool) -> None:
        from ltv_vllm.bench.workload import machine
        from ltv_vllm.extraction.capture import Capturer

        self.spec, self.lm = spec, lm
        self.cap = Capturer(lm.model, lm.tokenizer, batch_size=spec.batch_size,
                            progress=progress,  # chat: the special tokens are in the template
                            special_tokens=all(t.special_tokens for t in spec.tasks.values()))
        self.machine = machine_line(machine())
        self.task_name: str | None = None
        self.held: dict[str, Any] = {}

    def run(self, name: str, run: int) -> Any:
        """Episode (`name`, `run`): one record per N."""
        import torch

        from ltv_vllm.evaluation.episodes import EpisodeResult
        from ltv_vllm.extraction.capture import icl_states_per_set, label_head
        from ltv_vllm.pipeline.extract import (
            ExtractOptions,
            capture_test_zero_shot,
            plan_episode,
        )
        from ltv_vllm.tasks.specs import label_token_ids

        sp, cap, task = self.spec, self.cap, self.spec.tasks[name]
        ep = plan_episode(task, ExtractOptions(k=sp.k, n=sp.ns[-1], lam=sp.lam,
                                               seed=sp.seed + run, n_test=sp.n_test, n_val=0,
                                               demo_sets=sp.demo_sets))
        if name != self.task_name:  # per task: its label rows and (shared) zero-shot test states
            label_ids = label_token_ids(task, self.lm.tokenizer)
            self.task_name = name
            self.held = {"label_ids": label_ids, "head": label_head(self.lm.model, label_ids),
                         "h_zs_test": capture_test_zero_shot(cap, task, ep)}
        labels = torch.tensor([e.label for e in ep.test])
        test_sets = torch.stack(icl_states_per_set(cap, ep, [task.query(e.text) for e in ep.test],
                                                   desc=f"{name} icl test"))
        h_zs_all, h_sets_all, seconds = self._train_states(task, ep)
        h_cf = None  # contextual calibration: each set's content-free states
        if sp.teacher.calibration == "contextual":
            from ltv_vllm.core.teacher import CONTENT_FREE

            h_cf = torch.stack(icl_states_per_set(cap, ep, [task.query(t) for t in CONTENT_FREE],
                                                  desc=f"{name} content-free")).float()
        recs = [self._record(name, run, ep, i, labels, test_sets, h_zs_all, h_sets_all,
                             seconds, h_cf) for i in range(len(sp.ns))]
        last = recs[-1]["scores"]
        return EpisodeResult(name, run, recs, note=(
            f"{name} run {run}: N={sp.ns[-1]} zero-shot "
            f"{100 * last['zero-shot']['accuracy']:.1f}% ICL {100 * last['icl']['accuracy']:.1f}%"
            f" ensemble {100 * last[ens.ENSEMBLE]['accuracy']:.1f}% LTV "
            f"{100 * last['ltv']['accuracy']:.1f}%"
            + (f" multi {100 * last[ens.MULTI]['accuracy']:.1f}%" if ens.MULTI in last else "")))

    def _train_states(self, task: Any, ep: Any) -> tuple[Any, Any, list[dict[str, Any]]]:
        """The train queries' zero-shot and per-set ICL states, captured in nested slices
        [0, n_1), [n_1, n_2), ...: each slice timed."""
        import torch

        from ltv_vllm.extraction.capture import icl_states_per_set, zero_shot_states

        zs, sets, seconds = [], [], []
        lo = 0
        for n in self.spec.ns:
            qs = ep.queries[lo:n]
            t0 = time.perf_counter()
            zs.append(zero_shot_states(self.cap, task, [e.text for e in qs],
                                       desc=f"{task.name} zero-shot train {lo}:{n}"))
            t1 = time.perf_counter()
            per_set_seconds: list[float] = []
            per_set = icl_states_per_set(self.cap, ep, [task.query(e.text) for e in qs],
                                         desc=f"{task.name} icl train {lo}:{n}",
                                         seconds=per_set_seconds)
            sets.append(torch.stack([h.float() for h in per_set]))
            seconds.append({"zero_shot": t1 - t0, "sets": per_set_seconds})
            lo = n
        return torch.cat(zs), torch.cat(sets, 1), seconds  # h_sets: (M, N_max, d)

    def _record(self, name: str, run: int, ep: Any, i: int, labels: Any, test_sets: Any,
                h_zs_all: Any, h_sets_all: Any, seconds: list[dict[str, Any]],
                h_cf: Any) -> dict[str, Any]:
        """The record of the i-th N: both fits to its first N queries, every score."""
        import torch

        from ltv_vllm.core.teacher import fit_targets
        from ltv_vllm.methods import Context, MethodOptions, score_methods

        sp, n = self.spec, self.spec.ns[i]
        w_c, b_c = self.held["head"]
        h_zs_test = self.held["h_zs_test"]
        z_sets, refs = ens.references(test_sets, w_c, b_c)
        gold = torch.tensor([e.label for e in ep.queries])
        zs_s = sum(s["zero_shot"] for s in seconds[:i + 1])
        set_s = [sum(s["sets"][m] for s in seconds[:i + 1]) for m in range(sp.demo_sets)]
        logits = {"zero-shot": h_zs_test @ w_c.T + b_c, "icl": z_sets[0], **refs}
        fit_seconds, lams = {}, {}
        for fit, target, which in (("ltv", h_sets_all[0, :n], slice(0, 1)),
                                   (ens.MULTI, h_sets_all[:, :n].mean(0), slice(None))):
            if fit == ens.MULTI and sp.demo_sets == 1:
                continue
            if not sp.teacher.is_default:  # the teacher of that prompt (or mean of prompts)
                target, test_teacher = fit_targets(
                    sp.teacher, target, test_sets[which].float().mean(0), w_c, b_c,
                    h_content_free=None if h_cf is None else h_cf[which].mean(0),
                    gold=gold[:n])
                if fit == "ltv":
                    logits["teacher"] = test_teacher @ w_c.T + b_c
            ctx = Context(self.cap, ep, self.held["label_ids"], MethodOptions(
                lam=sp.lam, batch_size=sp.batch_size, progress=False),
                identity=self.lm.identity, h_zs=h_zs_all[:n], h_icl=target)
            t0 = time.perf_counter()
            sc = score_methods(ctx, ["ltv"], h_zs_test, test_sets[0], labels, head=(w_c, b_c))
            fit_seconds[fit] = time.perf_counter() - t0
            logits[fit] = sc.logits["ltv"]
            lams[fit] = sc.params["ltv"]["lam"]  # --lam auto: the one leave-one-out chose
        return {"task": name, "run": run, "seed": sp.seed + run, "n": n,
                # no choice is made here (λ fixed or by leave-one-out on train), so there
                # is no dev split
                "splits": {"train": n, "dev": 0, "test": len(ep.test),
                           "test_seed": ep.test_seed},
                "scores": ens.set_scores(logits, z_sets, labels),
                "capture_seconds": {"ltv": zs_s + set_s[0], ens.MULTI: zs_s + sum(set_s)},
                "fit_seconds": fit_seconds, "lam": lams, "machine": self.machine}


def bench_scaling(model_spec: str, tasks: Sequence[Any], *, ns: Sequence[int], demo_sets: int,
                  runs: int, k: int, lam: float | str, n_test: int, seed: int, batch_size: int,
                  dtype: str, out_dir: Path, command: str, checkpoint: Path | None = None,
                  teacher: Any = None, executor: Any = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the sweep (resuming from `checkpoint`) through `executor` (`evaluation.executor`;
    None: here, in order), `dtype` concrete (every episode's); write results.json / .md and
    the plot. `teacher` (`core.teacher.TeacherOptions`, None: the prompt's states): what
    both fits imitate at every N; its own test accuracy joins the references as `teacher`."""
    import torch

    from ltv_vllm.bench import report
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.core.teacher import TeacherOptions
    from ltv_vllm.evaluation.executor import failed_list, run_sweep
    from ltv_vllm.evaluation.sweep import Sweep
    from ltv_vllm.models.loading import load_model

    ns = sorted(set(ns))
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    config = {"model": model_spec, "dtype": dtype,
              "tasks": [t.name for t in tasks], "ns": ns, "demo_sets": demo_sets, "k": k,
              "lam": lam, "n_test": n_test, "runs": runs, "seed": seed,
              "format": tasks[0].prompt_format if tasks else "completion"}
    teacher = teacher or TeacherOptions()
    if not teacher.is_default:  # recorded only when set: earlier sweeps still extend
        config["teacher"] = teacher.record()
    # an episode depends on its task, seed and run alone: a sweep grown by tasks or runs (the
    # same command otherwise) keeps the episodes a finished one in out_dir, or a checkpoint,
    # holds
    fixed = {k: v for k, v in config.items() if k not in ("tasks", "runs")}
    sweep = Sweep(fixed, config["tasks"], runs, checkpoint=checkpoint, desc="scaling runs",
                  state=_finished_state(out_dir, fixed, config["tasks"], runs, checkpoint))
    spec = ScalingSpec({t.name: t for t in tasks}, tuple(ns), demo_sets, k, lam, n_test, seed,
                       batch_size, teacher)
    failed = run_sweep(sweep, executor, spec,
                       lambda: spec.runner(load_model(model_spec, dtype=dtype), progress=True),
                       keep=lambda res: log(res.note))
    rows = sweep.records
    doc = {"command": command, **config, "threads": torch.get_num_threads(),
           "machine": machine(), "started": started,
           "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "wall_seconds": sweep.wall_seconds, "rows": rows,
           "summary": summarise(rows) if rows else {},
           **({"failed": failed_list(failed)} if failed else {})}
    if failed:  # the finished episodes stay in the checkpoint; a rerun runs the rest
        return doc
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write(doc, out_dir, scaling_markdown(doc))
    doc["plots"] = [str(scaling_plot(doc, out_dir))]
    return doc


def _finished_state(out_dir: Path, fixed: dict[str, Any], tasks: list[str], runs: int,
                    checkpoint: Path | None) -> dict[str, Any] | None:
    """The episodes of a finished sweep in out_dir with the same settings (but its tasks and
    runs) that this one asks for; None (a checkpoint's, or fresh) where there is none."""
    import json

    from ltv_vllm.evaluation.sweep import read_checkpoint

    try:
        old = json.loads((out_dir / "results.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(old, dict) or any(old.get(k) != v for k, v in fixed.items()):
        return None
    state = read_checkpoint(checkpoint, fixed)  # a checkpoint under way goes on from there
    have = {(r["task"], r["run"]) for r in state["records"]}
    # rows written before episodes recorded their machine were timed on the old sweep's
    timed_on = machine_line(old.get("machine") or {})
    keep = [{**r, "machine": r.get("machine", timed_on)} for r in old.get("rows", [])
            if r["task"] in tasks and r["run"] < runs and (r["task"], r["run"]) not in have]
    done = sorted({(r["task"], r["run"]) for r in keep} | {tuple(d) for d in state["done"]})
    # a checkpoint begun from this finished sweep already counts its time
    wall = state["wall_seconds"] if state["done"] else float(old.get("wall_seconds") or 0.0)
    return {"records": state["records"] + keep, "costs": {}, "done": [list(d) for d in done],
            "wall_seconds": wall}


def rerender(out_dir: Path) -> dict[str, Any]:
    """results.md and the plot again from results.json (the summary recomputed)."""
    import json

    from ltv_vllm.bench import report

    doc = json.loads((out_dir / "results.json").read_text())
    doc["summary"] = summarise(doc["rows"])
    doc.pop("plots", None)
    report.write(doc, out_dir, scaling_markdown(doc))
    doc["plots"] = [str(scaling_plot(doc, out_dir))]
    return doc


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """{N: {task: {method: {accuracy, d_ntp, d_ntp_ensemble, accuracy_std}}, capture
    seconds}}: means over runs; recovery per task from the means."""
    out: dict[str, Any] = {}
    for n in sorted({r["n"] for r in rows}):
        at = [r for r in rows if r["n"] == n]
        per_task: dict[str, Any] = {}
        for t in dict.fromkeys(r["task"] for r in at):
            rs = [r for r in at if r["task"] == t]
            methods = list(rs[0]["scores"])
            cell = {}
            for m in methods:
                accs = [r["scores"][m]["accuracy"] for r in rs]
                cell[m] = {"accuracy": _mean(accs),
                           "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                           "d_ntp": _mean([r["scores"][m]["d_ntp"] for r in rs]),
                           "d_ntp_ensemble": _mean([r["scores"][m]["d_ntp_ensemble"]
                                                    for r in rs])}
            for fit in FITS:
                if fit in cell:
                    cell[fit]["recovery"] = recovery(cell, fit, "icl")
                    cell[fit]["recovery_ensemble"] = recovery(cell, fit, ens.ENSEMBLE)
                    # a mean over machines would be no machine's time: per machine below
                    cell[fit]["capture_seconds"] = (_mean([r["capture_seconds"][fit]
                                                           for r in rs])
                                                    if len(_machines(rs)) == 1 else None)
                    lams = [r["lam"][fit] for r in rs if fit in r.get("lam", {})]
                    if lams:  # results written before λ was recorded have none
                        cell[fit]["lam"] = statistics.median(lams)
            per_task[t] = cell
        out[str(n)] = per_task
    return out


def _by_machine(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """These rows by the machine that timed them, in order of first appearance (a row
    without one: the sweep's own, `''`)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r.get("machine", ""), []).append(r)
    return out


def _machines(rows: list[dict[str, Any]]) -> list[str]:
    return list(_by_machine(rows))


def capture_by_machine(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Capture seconds per run at N = n, per task and the machine that timed it: mean
    over that machine's runs of the task."""
    at = [r for r in rows if r["n"] == n]
    out = []
    for t in dict.fromkeys(r["task"] for r in at):
        for m, rs in _by_machine([r for r in at if r["task"] == t]).items():
            out.append({"task": t, "machine": m, "runs": len(rs), **{
                fit: _mean([r["capture_seconds"][fit] for r in rs])
                for fit in FITS if fit in rs[0]["capture_seconds"]}})
    return out


def recovery(cell: dict[str, Any], fit: str, ref: str) -> float | None:
    """(acc_fit − acc_zs) / (acc_ref − acc_zs), None where the reference does not beat
    zero-shot by `MIN_GAIN` (there is no gain to recover, or too little to divide by)."""
    zs = cell["zero-shot"]["accuracy"]
    gain = cell[ref]["accuracy"] - zs
    return (cell[fit]["accuracy"] - zs) / gain if gain >= MIN_GAIN else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


def scaling_markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    ns = [str(n) for n in doc["ns"]]
    tasks = doc["tasks"]
    M = doc["demo_sets"]
    machines = _machines(doc["rows"])
    timed = (f"{machine_line(doc['machine'])}, {doc['threads']} threads" if len(machines) == 1
             else f"timed on {len(machines)} machines (capture times per machine below; the "
                  f"last command on {machine_line(doc['machine'])}, {doc['threads']} threads)")
    label = {"zero-shot": "Zero-shot", "icl": "ICL, one prompt (mean over the M)",
             ens.ENSEMBLE: f"ICL ensemble ({M} prompts)", ens.STATES: "ICL, states averaged",
             "ltv": "LTV (paper: one prompt)", ens.MULTI: f"LTV, {M} prompts"}
    teacher = doc.get("teacher")
    if teacher:  # both fits imitate it; its own accuracy after the prompts'
        from ltv_vllm.core.teacher import TeacherOptions

        name = TeacherOptions(**teacher).name
        label = {**{k: v for k, v in label.items() if k not in FITS},
                 "teacher": f"Teacher {name} (one prompt)",
                 "ltv": f"LTV → {name} (one prompt)", ens.MULTI: f"LTV → {name}, {M} prompts"}
    lines = ["# Multi-prompt fitting and N: recovery of ICL's accuracy", "", "```",
             doc["command"], "```", "",
             (f"Model `{doc['model']}` ({doc['dtype']}, {doc['format']} format), k={doc['k']}, "
              f"M={M} demonstration sets, λ={doc['lam']}, {doc['n_test']} test queries, "
              f"{doc['runs']} run(s) per task (means over runs; ± the std over runs); "
              f"{timed}; "
              f"wall time {doc['wall_seconds'] / 60:.1f} min."), ""]
    for n in ns:
        methods = [m for m in label if m in s[n][tasks[0]]]
        head = "| Method | " + " | ".join(tasks) + " | Avg. |"
        sep = "|---|" + "---|" * (len(tasks) + 1)
        lines += [f"## N = {n}", "", "**Accuracy (%)**", "", head, sep]
        for m in methods:
            cells = [s[n][t][m] for t in tasks]
            lines.append(f"| {label[m]} | " + " | ".join(
                f"{100 * c['accuracy']:.1f} ± {100 * c['accuracy_std']:.1f}" for c in cells)
                + f" | {100 * _mean([c['accuracy'] for c in cells]):.1f} |")
        for key, title in (("d_ntp", "d_NTP against one prompt (mean KL over the M prompts)"),
                           ("d_ntp_ensemble", f"d_NTP against the {M}-prompt ensemble")):
            lines += ["", f"**{title}**", "", head, sep]
            for m in methods:
                if m == ("icl" if key == "d_ntp" else ens.ENSEMBLE):
                    continue
                cells = [s[n][t][m][key] for t in tasks]
                lines.append(f"| {label[m]} | " + " | ".join(f"{c:.3f}" for c in cells)
                             + f" | {_mean(cells):.3f} |")
        lines += ["", "**Recovery** (share of the reference's accuracy gain over zero-shot; "
                  f"– where the reference gains less than {100 * MIN_GAIN:.0f} points) and "
                  "capture time per run",
                  "", "| Fit | against | " + " | ".join(tasks) + " | capture (s, mean) |",
                  "|---|---|" + "---|" * (len(tasks) + 1)]
        for fit in FITS:
            if fit not in s[n][tasks[0]]:
                continue
            caps = [s[n][t][fit]["capture_seconds"] for t in tasks]
            cap = "–" if len(machines) > 1 else f"{_mean(caps):.1f}"
            for key, ref in (("recovery", "one prompt"), ("recovery_ensemble", "ensemble")):
                lines.append(f"| {label[fit]} | {ref} | " + " | ".join(
                    _pct(s[n][t][fit][key]) for t in tasks) + f" | {cap} |")
        if len(machines) > 1:
            fits = [f for f in FITS if f in s[n][tasks[0]]]
            lines += ["", "**Capture time per run (s) by the machine that timed it**", "",
                      "| Task | timed on | runs | " + " | ".join(label[f] for f in fits) + " |",
                      "|---|---|---|" + "---|" * len(fits)]
            lines += [f"| {c['task']} | {c['machine']} | {c['runs']} | "
                      + " | ".join(f"{c[f]:.1f}" for f in fits) + " |"
                      for c in capture_by_machine(doc["rows"], int(n))]
        if doc["lam"] == "auto":  # each episode's λ, chosen by leave-one-out on its states
            lines += ["", "**λ by leave-one-out** (median over runs)", "",
                      "| Fit | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
            for fit in FITS:
                if fit in s[n][tasks[0]]:
                    lines.append(f"| {label[fit]} | " + " | ".join(
                        f"{s[n][t][fit].get('lam', float('nan')):.3g}" for t in tasks) + " |")
        if ens.MULTI in s[n][tasks[0]]:
            above = [t for t in tasks
                     if s[n][t][ens.MULTI]["accuracy"] >= s[n][t]["icl"]["accuracy"]]
            lines += ["", f"{label[ens.MULTI]} at or above one-prompt ICL's accuracy on "
                      f"**{len(above)} of {len(tasks)}** tasks"
                      + (f" ({', '.join(above)})" if above else "") + "."]
        lines.append("")
    return "\n".join(lines)


def scaling_plot(doc: dict[str, Any], out_dir: Path) -> Path:
    """Recovery against N (log scale) per task, both fits, against one prompt and against
    the ensemble; d_NTP against both (mean over tasks: defined where ICL does not help too);
    the capture time per run beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, tasks, ns = doc["summary"], doc["tasks"], doc["ns"]
    fits = [f for f in FITS if f in s[str(ns[0])][tasks[0]]]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for ax, key, title in ((axes[0], "recovery", "against one ICL prompt"),
                           (axes[1], "recovery_ensemble",
                            f"against the {doc['demo_sets']}-prompt ensemble")):
        for t in tasks:
            color = None
            for fit, style in zip(fits, ("o-", "s--"), strict=False):
                pts = [(n, s[str(n)][t][fit][key]) for n in ns]
                pts = [(n, 100 * v) for n, v in pts if v is not None]
                if not pts:
                    continue
                line, = ax.plot(*zip(*pts, strict=True), style, color=color,
                                label=f"{t} {'LTV' if fit == 'ltv' else 'multi'}")
                color = line.get_color()
        ax.axhline(100, color="gray", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (unlabeled queries)")
        ax.set_ylabel("recovery (% of the gain over zero-shot)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # no task had a gain to recover: no lines
        axes[0].legend(fontsize=6, ncols=2)
    ax = axes[2]
    for fit, style in zip(fits, ("o-", "s--"), strict=False):
        for key, alpha, ref in (("d_ntp", 1.0, "one prompt"),
                                ("d_ntp_ensemble", 0.5, "ensemble")):
            ax.plot(ns, [_mean([s[str(n)][t][fit][key] for t in tasks]) for n in ns], style,
                    alpha=alpha, color="tab:blue" if fit == "ltv" else "tab:purple",
                    label=f"{'LTV' if fit == 'ltv' else 'multi'} vs {ref}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N")
    ax.set_ylabel("d_NTP (mean over tasks)")
    ax.set_title("d_NTP against one prompt and the ensemble", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax = axes[3]
    by_machine = _by_machine(doc["rows"])
    several = len(by_machine) > 1  # label and title each line by its machine
    # one machine's times per line: never averaged across machines
    for i, (m, rows) in enumerate(by_machine.items()):
        where = f" · {m or machine_line(doc['machine'])}" if several else ""
        for fit, style in zip(fits, ("o-", "s--"), strict=False):
            pts = [(n, _mean([r["capture_seconds"][fit] for r in rows if r["n"] == n]))
                   for n in ns if any(r["n"] == n for r in rows)]
            ax.plot(*zip(*pts, strict=True), style, color=f"C{2 * i + (fit != 'ltv')}",
                    label=("LTV (zero-shot + 1 set)" if fit == "ltv"
                           else f"multi (zero-shot + {doc['demo_sets']} sets)") + where)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N")
    ax.set_ylabel("capture seconds per run (mean over tasks)")
    ax.set_title(f"capture time ({machine_line(doc['machine'])})" if not several
                 else "capture time, per machine", fontsize=8)
    # capture grows with N: the upper left is free for a legend that names the machines
    ax.legend(fontsize=5 if several else 7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{doc['model']} ({doc['dtype']}, {doc['format']}): recovery against N, "
                 f"k={doc['k']}, {doc['runs']} run(s)")
    fig.tight_layout()
    return save_figure(fig, out_dir / "recovery_vs_n.png")
