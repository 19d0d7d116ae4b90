"""Which teacher a vector should imitate (issue 72): k-shot, M k-shot sets, many-shot, each
raw, calibrated or blended with gold labels, from states captured once and kept on disk.

Per task and run, one episode (k demonstrations, N train queries, the test subset) and:
  * h_zs on the train queries and the test subset;
  * for each of the M k-shot demonstration sets and for one many-shot set (`many_shot_demos`:
    same queries, its own demonstrations): h_icl on the train queries, the test subset and
    the content-free inputs (`core.teacher.CONTENT_FREE`), each set's seconds and its prompt's
    token count.
Those tensors are written to `states/<task>_seed<s>.safetensors` beside the results (s: the
episode's seed), so every fit variant (teacher, calibration, gold blend, λ) is rescored from
them without a recapture (`--rescore`), and a sweep grown by tasks, runs or variants captures
only what is new (`--runs 3` after `--runs 1 --seed 2` captures seeds 0 and 1 alone).

A variant is base/calibration[/gold weight]: base `one` (the first k-shot prompt: the paper's
target), `sets` (the M prompts' mean state: multi-prompt LTV), `many` (the many-shot prompt).
Each is scored by its teacher's own test accuracy (its calibration applied; a gold blend has
no test-time teacher, so its teacher row is the unblended one), its LTV's accuracy and d_NTP
against one k-shot prompt (mean over the M), against the M-prompt ensemble and against its own
teacher, through the method registry's `ltv` (`score_methods`) as every other path.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.core.teacher import (
    CALIBRATIONS,
    CONTENT_FREE,
    TeacherOptions,
    fit_targets,
)
from ltv_vllm.errors import ArgumentError
from ltv_vllm.evaluation import ensemble as ens
from ltv_vllm.extraction.capture import zero_shot_states
from ltv_vllm.models.hardware import machine_line

BASES = ("one", "sets", "many")
DEFAULT_VARIANTS = tuple(f"{b}/{c}" for b in BASES for c in CALIBRATIONS) + (
    "one/icl/0.5", "sets/icl/0.5", "many/icl/0.5", "many/batch/0.5")


def parse_variant(spec: str) -> tuple[str, TeacherOptions]:
    """'base/calibration[/gold weight]' → (base, TeacherOptions); ValueError naming it."""
    parts = spec.split("/")
    if len(parts) not in (2, 3) or parts[0] not in BASES:
        raise ValueError(f"variant {spec!r}: base/calibration[/gold weight], base one of "
                         f"{', '.join(BASES)}")
    gold = float(parts[2]) if len(parts) == 3 else 0.0
    return parts[0], TeacherOptions(calibration=parts[1], gold_weight=gold)


def capture(cap: Any, task: Any, ep: Any, many: Sequence[Any], h_zs_test: torch.Tensor,
            labels_train: torch.Tensor, labels_test: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                                            dict[str, Any]]:
    """Every state an episode's variants need, float32, and what capturing them cost."""
    queries = [task.query(e.text) for e in ep.queries]
    tests = [task.query(e.text) for e in ep.test]
    devs = [task.query(e.text) for e in ep.val]  # empty without --n-dev
    cf = [task.query(t) for t in CONTENT_FREE]
    t0 = time.perf_counter()
    h_zs = zero_shot_states(cap, task, [e.text for e in ep.queries],
                            desc=f"{task.name} zero-shot train")
    cost: dict[str, Any] = {"zero_shot_seconds": time.perf_counter() - t0, "sets": []}
    out: dict[str, list[torch.Tensor]] = {"train": [], "test": [], "cf": [], "dev": []}
    prefixes = [*ep.demo_prefixes(), task.demos_text(many)]
    for m, prefix in enumerate(prefixes):
        name = "many" if m == len(prefixes) - 1 else f"set {m + 1}"
        t0 = time.perf_counter()
        out["train"].append(cap.icl(prefix, queries, desc=f"{task.name} {name} train").float())
        seconds = time.perf_counter() - t0
        out["test"].append(cap.icl(prefix, tests, desc=f"{task.name} {name} test").float())
        out["cf"].append(cap.icl(prefix, cf, desc=f"{task.name} {name} content-free").float())
        if devs:
            out["dev"].append(cap.icl(prefix, devs, desc=f"{task.name} {name} dev").float())
        cost["sets"].append({"seconds": seconds, "prompt_tokens": len(cap.encode(prefix)),
                             "k": len(many) if name == "many" else len(ep.demos)})
    states = {"h_zs": h_zs.float(), "h_zs_test": h_zs_test.float(),
              "h_icl": torch.stack(out["train"]), "h_icl_test": torch.stack(out["test"]),
              "h_icl_cf": torch.stack(out["cf"]), "labels": labels_train,
              "labels_test": labels_test}
    if devs:  # the dev split: every choice this bench reports as "chosen on dev"
        states["h_zs_dev"] = zero_shot_states(cap, task, [e.text for e in ep.val],
                                              desc=f"{task.name} zero-shot dev").float()
        states["h_icl_dev"] = torch.stack(out["dev"])
        states["labels_dev"] = torch.tensor([e.label for e in ep.val])
    return states, cost


def teacher_base(states: dict[str, torch.Tensor], base: str) -> dict[str, torch.Tensor]:
    """The base teacher's train, test and content-free states: the first k-shot set, the
    mean over the M k-shot sets, or the many-shot set (the last one stored)."""
    if base == "one":
        i = slice(0, 1)
    elif base == "sets":
        i = slice(0, states["h_icl"].shape[0] - 1)
    else:
        i = slice(-1, None)
    return {k: states[k][i].mean(0) for k in ("h_icl", "h_icl_test", "h_icl_cf")}


def score_variants(states: dict[str, torch.Tensor], variants: Sequence[str],
                   ctx_for: Callable[[torch.Tensor, torch.Tensor], Any],
                   head: tuple[torch.Tensor, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Each variant's teacher accuracy, LTV accuracy and its d_NTP against one k-shot prompt,
    the ensemble and its own teacher, from one episode's stored states. `ctx_for(h_zs,
    h_icl)`: the registry's Context for a fit to that target. With dev states (`--n-dev`)
    every row also holds its `dev_accuracy`: the same fit applied to the dev queries, what
    `summarise` chooses by (the test rows are never read for a choice)."""
    from ltv_vllm.core.metrics import accuracy, d_ntp
    from ltv_vllm.methods import get_method, score_methods

    w_c, b_c = head
    labels = states["labels_test"].long()
    k_sets = states["h_icl_test"][:-1]  # the M k-shot prompts (the references)
    z_sets, refs = ens.references(k_sets, w_c, b_c)
    zs_test = states["h_zs_test"]
    base_scores = ens.set_scores({"zero-shot": zs_test @ w_c.T + b_c, "icl": z_sets[0],
                                  **refs}, z_sets, labels)
    out: dict[str, dict[str, float]] = dict(base_scores)
    dev = "h_zs_dev" in states
    if dev:
        labels_dev = states["labels_dev"].long()
        out["zero-shot"]["dev_accuracy"] = accuracy(states["h_zs_dev"] @ w_c.T + b_c,
                                                    labels_dev)
        out["icl"]["dev_accuracy"] = accuracy(states["h_icl_dev"][0] @ w_c.T + b_c, labels_dev)
    for spec in variants:
        base, opts = parse_variant(spec)
        t = teacher_base(states, base)
        target, test_teacher = fit_targets(opts, t["h_icl"], t["h_icl_test"], w_c, b_c,
                                           h_content_free=t["h_icl_cf"], gold=states["labels"])
        z_teacher = (test_teacher @ w_c.T + b_c).float()
        sc = score_methods(ctx_for(states["h_zs"], target.float()), ["ltv"], zs_test,
                           test_teacher.float(), labels, head=head)
        z = sc.logits["ltv"]
        row = ens.set_scores({"v": z}, z_sets, labels)["v"]
        row.update({"teacher_accuracy": accuracy(z_teacher, labels),
                    "d_ntp_teacher": d_ntp(z_teacher, z), "lam": sc.params["ltv"]["lam"]})
        if dev:
            h_dev = get_method("ltv").shift(sc.artifacts["ltv"], states["h_zs_dev"])
            row["dev_accuracy"] = accuracy(h_dev @ w_c.T + b_c, labels_dev)
        out[spec] = row
    return out


@dataclass(frozen=True)
class CaptureSpec:
    """What every process's state capture shares, picklable (`evaluation.executor`): the
    tasks by name and the episodes' settings."""

    tasks: dict[str, Any]
    k: int
    many_k: int
    demo_sets: int
    n: int
    n_test: int
    n_dev: int
    seed: int
    batch_size: int

    def episode(self, task: Any, run: int) -> Any:
        from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode

        return plan_episode(task, ExtractOptions(k=self.k, n=self.n, lam=5.0,
                                                 seed=self.seed + run, n_test=self.n_test,
                                                 n_val=self.n_dev, demo_sets=self.demo_sets))

    def runner(self, lm: Any, *, progress: bool = False) -> CaptureRunner:
        return CaptureRunner(self, lm, progress)


class CaptureRunner:
    """One process's captures (the driver's, or a Ray worker's): an episode's states and
    their cost, handed back for the driver to store (`EpisodeResult.extra`); the machine
    line is this process's, which timed them."""

    def __init__(self, spec: CaptureSpec, lm: Any, progress: bool) -> None:
        from ltv_vllm.bench.workload import machine
        from ltv_vllm.extraction.capture import Capturer

        self.spec, self.lm = spec, lm
        self.cap = Capturer(lm.model, lm.tokenizer, batch_size=spec.batch_size,
                            progress=progress,
                            special_tokens=all(t.special_tokens for t in spec.tasks.values()))
        self.machine = machine_line(machine())
        self.zs_test: dict[str, torch.Tensor] = {}

    def run(self, name: str, run: int) -> Any:
        from ltv_vllm.evaluation.episodes import EpisodeResult
        from ltv_vllm.extraction.capture import label_head
        from ltv_vllm.pipeline.extract import capture_test_zero_shot
        from ltv_vllm.tasks.data import check_disjoint, load_dataset, many_shot_demos
        from ltv_vllm.tasks.specs import label_token_ids

        task = self.spec.tasks[name]
        ep = self.spec.episode(task, run)
        many = many_shot_demos(load_dataset(task), ep, self.spec.many_k)
        check_disjoint(ep, many)
        if name not in self.zs_test:  # the test subset is the same for every run
            self.zs_test[name] = capture_test_zero_shot(self.cap, task, ep)
        st, cost = capture(self.cap, task, ep, many, self.zs_test[name],
                           torch.tensor([e.label for e in ep.queries]),
                           torch.tensor([e.label for e in ep.test]))
        st["w_c"], st["b_c"] = label_head(self.lm.model, label_token_ids(task, self.lm.tokenizer))
        return EpisodeResult(name, run, [], note=f"{name} run {run} captured",
                             extra={"states": st, "cost": cost, "machine": self.machine})


def bench_teachers(model_spec: str, tasks: Sequence[Any], *, k: int, many_k: int,
                   demo_sets: int, n: int, runs: int, lam: float | str, n_test: int,
                   seed: int, batch_size: int, dtype: str, variants: Sequence[str],
                   out_dir: Path, command: str, rescore: bool = False,
                   merged: Sequence[dict[str, Any]] = (), n_dev: int = 0,
                   executor: Any = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Capture what is missing under out_dir/states (through `executor`,
    `evaluation.executor`; None: here, in order; the driver alone writes the files), score
    every variant, write results. `merged`: earlier results of this bench (`merge_docs`)
    whose episodes join the tables. `n_dev` > 0: a labelled dev split per episode (disjoint
    from the queries, demonstrations and test), every variant scored on it, and a "chosen
    on dev" row per task."""
    from safetensors.torch import load_file, save_file

    from ltv_vllm.bench import report
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.core.fileio import atomic_write
    from ltv_vllm.evaluation.executor import failed_list, run_sweep
    from ltv_vllm.evaluation.sweep import Sweep, fresh_state
    from ltv_vllm.methods import Context, MethodOptions
    from ltv_vllm.models.checkpoint import identity_from_dir
    from ltv_vllm.models.loading import load_model, load_tokenizer, local_model_dir
    from ltv_vllm.tasks.specs import label_token_ids

    for v in variants:
        parse_variant(v)
    states_dir = out_dir / "states"
    states_dir.mkdir(parents=True, exist_ok=True)
    # what an episode's stored states depend on besides its seed
    config = {"model": model_spec, "dtype": dtype, "k": k, "many_k": many_k,
              "demo_sets": demo_sets, "n": n, "n_test": n_test,
              # a dev split moves the further sets' demonstrations (drawn outside it); the
              # key is absent without one, so states stored before --n-dev stay valid
              **({"n_dev": n_dev} if n_dev else {})}
    spec = CaptureSpec({t.name: t for t in tasks}, k, many_k, demo_sets, n, n_test, n_dev,
                       seed, batch_size)
    tok = load_tokenizer(model_spec)
    identity = identity_from_dir(local_model_dir(model_spec))
    t_start = time.perf_counter()

    def stored(name: str, run: int) -> tuple[Path, Path, dict[str, Any]]:
        path = states_dir / f"{name}_seed{seed + run}.safetensors"
        return path, path.with_suffix(".json"), {**config, "seed": seed + run}

    def have(name: str, run: int) -> bool:
        path, meta_path, ep_config = stored(name, run)
        return path.is_file() and meta_path.is_file() and json.loads(
            meta_path.read_text()).get("config") == ep_config

    def keep(res: Any) -> None:  # the driver alone writes the states and their record
        path, meta_path, ep_config = stored(res.task, res.run)
        save_file({k_: v.contiguous() for k_, v in res.extra["states"].items()}, str(path))
        meta = {"config": ep_config, "cost": res.extra["cost"], "machine": res.extra["machine"]}
        atomic_write(meta_path, lambda p, m=meta: Path(p).write_text(json.dumps(m, indent=1)))

    names = [t.name for t in tasks]
    done = [[t, r] for t in names for r in range(runs) if have(t, r)]
    if rescore and len(done) < len(names) * runs:
        name, run = next((t, r) for t in names for r in range(runs) if [t, r] not in done)
        raise ArgumentError(f"{stored(name, run)[0]}: no stored states of this configuration "
                            "to rescore (run without --rescore to capture them)")
    sweep = Sweep({}, names, runs, state={**fresh_state(), "done": done}, desc="captures")
    failed = run_sweep(sweep, executor, spec,
                       lambda: spec.runner(load_model(model_spec, dtype=dtype), progress=True),
                       keep=keep)
    if failed:  # what was captured is stored: the command again captures the rest
        return {"failed": failed_list(failed)}
    rows = []
    for task, run in itertools.product(tasks, range(runs)):
        ep = spec.episode(task, run)
        label_ids = label_token_ids(task, tok)
        path, meta_path, _ = stored(task.name, run)
        st = load_file(str(path))
        meta = json.loads(meta_path.read_text())
        head = (st["w_c"], st["b_c"])

        def ctx_for(h_zs: torch.Tensor, h_icl: torch.Tensor, ep=ep, ids=label_ids) -> Any:
            return Context(None, ep, ids, MethodOptions(lam=lam, batch_size=batch_size,
                                                        progress=False),
                           identity=identity, h_zs=h_zs, h_icl=h_icl, dtype=dtype)

        scores = score_variants(st, variants, ctx_for, head)
        rows.append({"task": task.name, "run": run, "seed": seed + run, "scores": scores,
                     "cost": meta["cost"], "machine": meta["machine"],
                     "splits": {"train": len(ep.queries), "dev": len(ep.val),
                                "test": len(ep.test), "test_seed": ep.test_seed}})
        _log_episode(log, task.name, run, scores, variants, n_dev)
    rows += [r for other in merged for r in other["rows"]]  # `merge_docs` checked them
    rows.sort(key=lambda r: (names.index(r["task"]), r["seed"]))
    doc = {"command": command, **config, "n_dev": n_dev, "seed": seed, "lam": lam,
           "runs": max(sum(r["task"] == t for r in rows) for t in names),
           "merged": [other["command"] for other in merged],
           "tasks": names, "variants": list(variants), "machine": machine(),
           "threads": torch.get_num_threads(), "wall_seconds": time.perf_counter() - t_start,
           "rows": rows}
    doc["summary"] = summarise(doc)
    report.write(doc, out_dir, teachers_markdown(doc))
    doc["plots"] = [str(teachers_plot(doc, out_dir))]
    return doc


def _log_episode(log: Callable[[str], None], name: str, run: int, scores: dict[str, Any],
                 variants: Sequence[str], n_dev: int) -> None:
    log(f"{name} run {run}: zero-shot {100 * scores['zero-shot']['accuracy']:.1f}% "
        f"ICL {100 * scores['icl']['accuracy']:.1f}% LTV one/icl "
        f"{100 * scores['one/icl']['accuracy']:.1f}%" if "one/icl" in scores else name)
    pick = chosen_on_dev(scores, variants) if n_dev else None
    if pick is not None:
        log(f"  chosen on dev: {pick} (dev {100 * scores[pick]['dev_accuracy']:.1f}%), "
            f"test {100 * scores[pick]['accuracy']:.1f}%")


# what every episode's scores hold beside the variants
BASE_ROWS = ("zero-shot", "icl", ens.ENSEMBLE)
# what must agree for two runs of this bench to share tables (their seeds differ)
MERGE_KEYS = ("model", "dtype", "k", "many_k", "demo_sets", "n", "n_test", "lam", "n_dev")
MERGE_DEFAULTS = {"n_dev": 0}  # results written before the key existed


def merge_docs(paths: Sequence[Path], config: dict[str, Any], tasks: Sequence[str],
               variants: Sequence[str], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Earlier results.json files of this bench to merge (`--merge`), checked before any
    model loads: the same configuration but the seed, every variant scored, and no episode
    (task, seed) twice, nor one of this run's `seeds`. Returns them with only `tasks`' rows."""
    docs = []
    seen = {(t, s) for t in tasks for s in seeds}
    for path in paths:
        path = Path(path)
        try:
            doc = json.loads((path / "results.json" if path.is_dir() else path).read_text())
        except (OSError, ValueError) as e:
            raise ArgumentError(f"--merge {path}: not a readable results.json ({e})") from None
        if not isinstance(doc, dict) or "rows" not in doc or "many_k" not in doc:
            raise ArgumentError(f"--merge {path}: not the results of `ltv-vllm bench teachers`")
        differ = [f"{key} {doc.get(key, MERGE_DEFAULTS.get(key))!r} here "
                  f"{config.get(key, MERGE_DEFAULTS.get(key))!r}" for key in MERGE_KEYS
                  if doc.get(key, MERGE_DEFAULTS.get(key))
                  != config.get(key, MERGE_DEFAULTS.get(key))]
        if differ:
            raise ArgumentError(f"--merge {path}: another configuration: {'; '.join(differ)}")
        rows = [r for r in doc["rows"] if r["task"] in tasks]
        missing = sorted({v for r in rows for v in (*BASE_ROWS, *variants)
                          if v not in r["scores"]})
        if missing:
            raise ArgumentError(f"--merge {path}: its episodes lack {', '.join(missing)} "
                                "(rescore them with these --variants first)")
        if not rows:
            raise ArgumentError(f"--merge {path}: no episode of {', '.join(tasks)}")
        for r in rows:
            if (r["task"], r["seed"]) in seen:
                raise ArgumentError(f"--merge {path}: {r['task']} seed {r['seed']} is in this "
                                    "run or another merged one")
            seen.add((r["task"], r["seed"]))
        docs.append({**doc, "rows": rows})
    return docs


def chosen_on_dev(scores: dict[str, dict[str, float]], variants: Sequence[str]) -> str:
    """The variant with the best dev accuracy (ties: the first in `variants`); the test
    accuracies are not read."""
    return max(variants, key=lambda v: scores[v]["dev_accuracy"])


def summarise(doc: dict[str, Any]) -> dict[str, Any]:
    """{task: {method: means over runs}}, and per variant: tasks at or above one k-shot
    prompt, the mean accuracy gap to it, and the share of its teacher's gain recovered."""
    rows, tasks = doc["rows"], doc["tasks"]
    per: dict[str, dict[str, dict[str, float]]] = {}
    for t in tasks:
        rs = [r for r in rows if r["task"] == t]
        # the methods every episode scored (merged runs may have scored more)
        methods = [m for m in rs[0]["scores"] if all(m in r["scores"] for r in rs)]
        per[t] = {m: {key: statistics.fmean(r["scores"][m][key] for r in rs)
                      for key in rs[0]["scores"][m] if key != "set_accuracy"}
                  for m in methods}
    overall = {}
    for v in doc["variants"]:
        gaps = [per[t][v]["accuracy"] - per[t]["icl"]["accuracy"] for t in tasks]
        gain = [per[t][v]["teacher_accuracy"] - per[t]["zero-shot"]["accuracy"] for t in tasks]
        got = [per[t][v]["accuracy"] - per[t]["zero-shot"]["accuracy"] for t in tasks]
        overall[v] = {"at_or_above": sum(g >= 0 for g in gaps),
                      "mean_gap": statistics.fmean(gaps),
                      "accuracy": statistics.fmean(per[t][v]["accuracy"] for t in tasks),
                      "teacher_accuracy": statistics.fmean(per[t][v]["teacher_accuracy"]
                                                           for t in tasks),
                      "recovery": sum(got) / sum(gain) if sum(gain) > 0 else None}
    out: dict[str, Any] = {"per_task": per, "overall": overall}
    if doc.get("n_dev"):
        dev: dict[str, Any] = {}
        for t in tasks:
            rs = [r for r in rows if r["task"] == t]
            picks = [chosen_on_dev(r["scores"], doc["variants"]) for r in rs]
            dev[t] = {"picks": picks,
                      "accuracy": statistics.fmean(r["scores"][v]["accuracy"]
                                                   for r, v in zip(rs, picks, strict=True))}
        gaps = [dev[t]["accuracy"] - per[t]["icl"]["accuracy"] for t in tasks]
        out["chosen_on_dev"] = {"per_task": dev, "at_or_above": sum(g >= 0 for g in gaps),
                                "mean_gap": statistics.fmean(gaps),
                                "accuracy": statistics.fmean(dev[t]["accuracy"]
                                                             for t in tasks)}
    return out


def teachers_markdown(doc: dict[str, Any]) -> str:
    s, tasks = doc["summary"], doc["tasks"]
    per, overall = s["per_task"], s["overall"]
    costs = [r["cost"] for r in doc["rows"]]
    machines = sorted({r["machine"] for r in doc["rows"]})
    lines = ["# Teachers: what a vector is fitted to imitate", "", "```", doc["command"],
             *(f"# merged with the episodes of: {c}" for c in doc.get("merged", [])), "```",
             "", f"Model `{doc['model']}` ({doc['dtype']}), k={doc['k']} (M={doc['demo_sets']} "
             f"sets), many-shot k={doc['many_k']}, N={doc['n']}, λ={doc['lam']}, "
             f"{doc['n_test']} test queries, {doc.get('n_dev', 0)} dev queries, "
             f"{doc['runs']} run(s) per task (means over runs); "
             f"captured on {'; '.join(machines)}, {doc['threads']} threads; this command's "
             f"wall time {doc['wall_seconds'] / 60:.1f} min.", "",
             "A variant is base/calibration[/gold weight]: base `one` = the first k-shot "
             "prompt, `sets` = the mean state of the M k-shot prompts, `many` = the many-shot "
             "prompt; calibration `icl` = none, `batch` = batch calibration over the N train "
             "queries, `contextual` = content-free calibration; a gold weight blends each "
             "train query's gold label into its target. *teacher* is the teacher's own test "
             "accuracy (a gold blend's: the unblended teacher).", "",
             "**Accuracy (%)**", "", "| Method | " + " | ".join(tasks) + " | Avg. |",
             "|---|" + "---|" * (len(tasks) + 1)]

    def row(label: str, vals: list[float], fmt: str = "{:.1f}", scale: float = 100) -> str:
        return (f"| {label} | " + " | ".join(fmt.format(scale * v) for v in vals)
                + f" | {fmt.format(scale * statistics.fmean(vals))} |")

    lines.append(row("Zero-shot", [per[t]["zero-shot"]["accuracy"] for t in tasks]))
    lines.append(row(f"ICL, one {doc['k']}-shot prompt (mean over the M)",
                     [per[t]["icl"]["accuracy"] for t in tasks]))
    lines.append(row(f"ICL ensemble ({doc['demo_sets']} prompts)",
                     [per[t][ens.ENSEMBLE]["accuracy"] for t in tasks]))
    for v in doc["variants"]:
        lines.append(row(f"teacher {v}", [per[t][v]["teacher_accuracy"] for t in tasks]))
        lines.append(row(f"**LTV {v}**", [per[t][v]["accuracy"] for t in tasks]))
    dev = s.get("chosen_on_dev")
    if dev:
        lines.append(row(f"**LTV, variant chosen on dev** ({doc['n_dev']} dev queries per "
                         "episode)", [dev["per_task"][t]["accuracy"] for t in tasks]))
    lines += ["", "Every row is scored on the test queries; the best row of this table is "
              "therefore a choice made on test and reads high. "
              + ("The chosen-on-dev row is the held-out choice (per episode, the variant "
                 "with the best dev accuracy); its picks: " + "; ".join(
                     f"{t} {', '.join(dev['per_task'][t]['picks'])}" for t in tasks) + "."
                 if dev else "Rerun with `--n-dev 200` for a row chosen on held-out dev "
                 "queries; `ltv-vllm bench value` is the full held-out protocol.")]
    for key, title in (("d_ntp", f"d_NTP against one {doc['k']}-shot prompt"),
                       ("d_ntp_ensemble", f"d_NTP against the {doc['demo_sets']}-prompt "
                                          "ensemble"),
                       ("d_ntp_teacher", "d_NTP against its own teacher")):
        lines += ["", f"**{title}**", "", "| LTV variant | " + " | ".join(tasks) + " | Avg. |",
                  "|---|" + "---|" * (len(tasks) + 1)]
        lines += [row(v, [per[t][v][key] for t in tasks], "{:.3f}", 1) for v in doc["variants"]]
    lines += ["", "**Against one k-shot prompt** (tasks at or above it; mean accuracy gap in "
              "points; share of the teacher's own gain over zero-shot recovered, summed over "
              "tasks)", "", "| LTV variant | at or above | mean gap | recovery of its teacher |",
              "|---|---|---|---|"]
    for v in doc["variants"]:
        o = overall[v]
        rec = "–" if o["recovery"] is None else f"{100 * o['recovery']:.0f} %"
        lines.append(f"| {v} | {o['at_or_above']} of {len(tasks)} | "
                     f"{100 * o['mean_gap']:+.1f} | {rec} |")
    if dev:
        lines.append(f"| chosen on dev | {dev['at_or_above']} of {len(tasks)} | "
                     f"{100 * dev['mean_gap']:+.1f} | – |")
    lines += ["", "**Extraction cost per run** (mean over episodes; train-query passes only, "
              "the test's are not a cost of extraction)", "",
              "| Teacher | prompt tokens | capture seconds (zero-shot + its sets) |",
              "|---|---|---|"]
    for label, pick in ((f"one {doc['k']}-shot prompt", lambda sets: sets[:1]),
                        (f"{doc['demo_sets']} {doc['k']}-shot prompts", lambda sets: sets[:-1]),
                        (f"one {doc['many_k']}-shot prompt", lambda sets: sets[-1:])):
        tokens = statistics.fmean(sum(x["prompt_tokens"] for x in pick(c["sets"]))
                                  for c in costs)
        seconds = statistics.fmean(c["zero_shot_seconds"]
                                   + sum(x["seconds"] for x in pick(c["sets"])) for c in costs)
        lines.append(f"| {label} | {tokens:.0f} | {seconds:.1f} |")
    lines += [
              "", "Calibration and gold blends add no forward pass but the content-free "
              f"inputs' ({len(CONTENT_FREE)} prompts per set).", ""]
    return "\n".join(lines)


def teachers_plot(doc: dict[str, Any], out_dir: Path) -> Path:
    """Per variant: its LTV's mean accuracy gap to one k-shot prompt against its teacher's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ltv_vllm.core.fileio import save_figure

    overall, per, tasks = doc["summary"]["overall"], doc["summary"]["per_task"], doc["tasks"]
    icl = statistics.fmean(per[t]["icl"]["accuracy"] for t in tasks)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    vs = doc["variants"]
    x = range(len(vs))
    ax.bar([i - 0.2 for i in x], [100 * (overall[v]["teacher_accuracy"] - icl) for v in vs],
           0.4, label="teacher", color="tab:green")
    ax.bar([i + 0.2 for i in x], [100 * (overall[v]["accuracy"] - icl) for v in vs], 0.4,
           label="its LTV", color="tab:blue")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xticks(list(x), vs, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(f"accuracy − one {doc['k']}-shot prompt (points, mean over tasks)")
    ax.set_title(f"{doc['model']} ({doc['dtype']}): teachers and their vectors, "
                 f"{doc['runs']} run(s) × {len(tasks)} tasks", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return save_figure(fig, out_dir / "teachers.png")
