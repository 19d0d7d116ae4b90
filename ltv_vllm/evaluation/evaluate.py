"""Methods × tasks × runs → JSON, a markdown table and plots (paper Table 1 and Fig. 3 style).

Each run draws a new episode (demos + N train queries) from its own seed; the balanced test
subset depends only on the test seed, so zero-shot states are captured once per task and
shared by every run. d_NTP of a method is KL(P_icl ‖ P_method) on the test subset of that
run (ICL's own d_NTP is 0 by definition).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from ltv_vllm import __version__
from ltv_vllm.core.fileio import atomic_write, save_figure
from ltv_vllm.core.metrics import accuracy, d_ntp, pearson, spearman
from ltv_vllm.core.teacher import TeacherOptions
from ltv_vllm.core.vector_files import VectorError, read_safetensors
from ltv_vllm.errors import ArgumentError
from ltv_vllm.evaluation import ensemble as ens
from ltv_vllm.evaluation.sweep import Sweep, config_key, read_checkpoint
from ltv_vllm.extraction.capture import label_head
from ltv_vllm.methods import METHODS as TASK_VECTOR_METHODS
from ltv_vllm.methods import MethodOptions, MethodScores, inference_cost, score_methods
from ltv_vllm.models.hardware import hardware, machine_line
from ltv_vllm.pipeline.extract import (
    CapturedModel,
    Captures,
    ExtractOptions,
    LoadedModel,
    capture_episode,
    capture_test_zero_shot,
    capturer_for,
    check_counts,
    check_format,
    check_teacher,
    concrete_batch,
    episode_labels,
    label_rows,
    method_context,
    model_dtype,
    plan_episode,
    states_methods,
    teach,
)
from ltv_vllm.pipeline.transfer import (
    METHODS,
    TRANSFER_METHOD,
    SourceModel,
    check_pair,
    run_transfer_episode,
)
from ltv_vllm.tasks.specs import Task, label_token_ids

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


@dataclass(frozen=True)
class EvalConfig:
    k: int | None = None  # None: DEFAULT_K, or max(TRANSFER_K, K) per task in a transfer evaluation
    n: int = 256
    lam: float | str = 5.0  # or "auto" (leave-one-out)
    n_test: int = 500
    runs: int = 5
    seed: int = 0
    batch_size: int | str = 16  # or "auto" (the Capturer plans each pass)
    n_val: int = 32  # labelled validation examples for TV / FV / SV's layer choice
    cost_samples: int = 16  # test prompts timed per method in each task's first run; 0: none
    options: MethodOptions = field(default_factory=MethodOptions)  # the methods' own knobs
    # M demonstration sets per episode: single-prompt ICL is the mean over their prompts, and
    # the ensemble, the mean-state ICL and multi-prompt LTV join the methods (`ensemble`)
    demo_sets: int = 1
    # what the states methods are fitted to (`core.teacher`); the ICL rows stay the prompt's
    teacher: TeacherOptions = field(default_factory=TeacherOptions)

    def __post_init__(self) -> None:
        check_counts(k=self.k, n=self.n, lam=self.lam, n_test=self.n_test,
                     batch_size=self.batch_size, runs=self.runs)
        if self.n_val < 0 or self.cost_samples < 0:
            raise ArgumentError("--n-val and --cost-samples must be ≥ 0")
        if isinstance(self.demo_sets, bool) or int(self.demo_sets) < 1:
            raise ArgumentError(f"--demo-sets must be at least 1, got {self.demo_sets}")

    def episode_options(self, seed: int) -> ExtractOptions:
        return ExtractOptions(k=self.k, n=self.n, lam=self.lam, seed=seed, n_test=self.n_test,
                              batch_size=self.batch_size, n_val=self.n_val,
                              demo_sets=self.demo_sets, teacher=self.teacher)

    def method_options(self, seed: int, progress: bool,
                       planned: int | None = None) -> MethodOptions:
        return self.options.replace(lam=self.lam, seed=seed,
                                    batch_size=concrete_batch(self.batch_size, planned),
                                    progress=progress)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("options", "teacher")}
        if not self.teacher.is_default:  # recorded only when set: earlier results extend
            d["teacher"] = self.teacher.record()
        return {**d, "options": {k: v for k, v in self.options.to_dict().items()
                                 if k not in ("lam", "seed", "batch_size", "progress")}}


def default_methods(transfer: bool, demo_sets: int = 1) -> list[str]:
    if demo_sets > 1:
        return ["zero-shot", "icl", ens.ENSEMBLE, "ltv", ens.MULTI, "mean"]
    return ["zero-shot", "icl", "ltv", TRANSFER_METHOD if transfer else "mean"]


def resolve_methods(methods: Sequence[str] | None, *, transfer: bool,
                    demo_sets: int = 1) -> list[str]:
    """The methods an evaluation runs, in order: unknown ones refused; ICL always (d_NTP is
    measured against it), and ltv-transfer always in a transfer evaluation."""
    if transfer and demo_sets > 1:
        raise ArgumentError("--demo-sets: a transfer evaluation fits one ICL prompt per "
                            "episode (drop --demo-sets or --source-model)")
    ms = list(methods) if methods else default_methods(transfer, demo_sets)
    known = (*METHODS, TRANSFER_METHOD) if transfer else all_methods(demo_sets)
    unknown = [m for m in ms if m not in known]
    if unknown:
        hint = " (ltv-transfer needs --source-model)" if TRANSFER_METHOD in unknown else ""
        if transfer and set(unknown) & set(TASK_VECTOR_METHODS):
            hint = " (the baselines are evaluated without --source-model)"
        if set(unknown) & set(ens.METHODS):
            hint = " (the multi-prompt methods need --demo-sets 2 or more)"
        raise ArgumentError(f"--methods: unknown {', '.join(unknown)}; choose from "
                            f"{', '.join(known)}{hint}")
    if "icl" not in ms:
        ms.insert(0, "icl")
    if transfer and TRANSFER_METHOD not in ms:
        ms.append(TRANSFER_METHOD)
    return ms


def check_teachers(teacher: TeacherOptions, methods: Sequence[str], tasks: Sequence[Task],
                   plan: dict[str, list[Any]], *, transfer: bool, lm: Any = None) -> None:
    """A teacher other than the prompt's needs a method fitted on states among `methods`, no
    transfer, and what `check_teacher` asks of each task (the CLI calls this before the
    model loads, `lm` None; `evaluate` again with it)."""
    if teacher.is_default:
        return
    if transfer or not any(m in states_methods() or m == ens.MULTI for m in methods):
        raise ArgumentError("--teacher shapes what the methods fitted on states ("
                            f"{', '.join(states_methods())}) imitate: name one in --methods, "
                            "without --source-model")
    for t in tasks:
        check_teacher(teacher, "ltv", t, lm, plan[t.name][0])


def plan_episodes(
    tasks: Sequence[Task], cfg: EvalConfig, *, transfer: bool
) -> dict[str, list[Any]]:
    """Every run's episode per task: data loaded and k / N checked before any model loads."""
    return {t.name: [plan_episode(t, cfg.episode_options(cfg.seed + r), transfer=transfer)
                     for r in range(cfg.runs)] for t in tasks}


def evaluate(
    lm: LoadedModel,
    tasks: Sequence[Task],
    methods: Sequence[str],
    cfg: EvalConfig,
    *,
    source: SourceModel | None = None,
    progress: bool = True,
    episodes: dict[str, list[Any]] | None = None,
    checkpoint: str | Path | None = None,
    extend: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every task × run and return the result document (also what `write_report` saves).

    With a `source`, `methods` (other than "ltv-transfer") run on both models — the source's
    as "source-<method>" — and "ltv-transfer" is the source → target logit-space vector
    scored on the target: the paper's transfer table.

    `checkpoint`: a JSON file rewritten (atomically) after every episode; an evaluation with
    the same configuration started again skips the episodes it holds (a long comparison
    survives an interruption), one of another configuration is refused. The episode in
    progress is saved beside it after its capture and after each method
    (`episode_checkpoint`), so a rerun resumes inside that episode too.

    `extend`: a finished result document of the same configuration but for its tasks and
    number of runs; its episodes that this evaluation also asks for are kept, not run again
    (`extension_state`), so a comparison can grow by a task or a run.
    """
    methods = resolve_methods(methods, transfer=source is not None, demo_sets=cfg.demo_sets)
    own = tuple(m for m in methods if m != TRANSFER_METHOD)
    every_set = cfg.demo_sets > 1
    keys = list(own)
    if source is not None:
        keys += [SOURCE + m for m in own] + [TRANSFER_METHOD]
    plan = episodes or plan_episodes(tasks, cfg, transfer=source is not None)
    taught = not cfg.teacher.is_default
    if taught:  # one line each, before any pass
        check_teachers(cfg.teacher, own, tasks, plan, transfer=source is not None, lm=lm)
        keys.insert(keys.index("icl") + 1 if "icl" in keys else 0, TEACHER)

    def k_for(task: Task) -> int:
        return cfg.episode_options(cfg.seed).k_for(task, transfer=source is not None)

    if source is not None:  # every pair check before the first heavy pass
        pair_ids = {t.name: check_pair(lm, source, plan[t.name][0]) for t in tasks}
    source_cfg = {}
    if source is not None:
        source_cfg = {"source_model": source.spec, "source_identity": source.identity.to_dict(),
                      "source_load": {k: v for k, v in source.load.items() if v is not None}}
    config = {
        "model": lm.spec,
        "model_identity": lm.identity.to_dict(),
        "dtype": model_dtype(lm),
        **({"engine": lm.engine} if isinstance(lm, CapturedModel) else {}),
        "tasks": [t.name for t in tasks],
        "methods": keys,
        **source_cfg,
        **cfg.to_dict(),
        "k_per_task": {t.name: k_for(t) for t in tasks},
        # a chat rendering (`tasks.chat`); the completion format records nothing (as before)
        **({"prompt_format": tasks[0].record()}
           if tasks and tasks[0].prompt_format == "chat" else {}),
    }
    state = read_checkpoint(checkpoint, config)
    if extend is not None and not state["done"]:
        state = extension_state(extend, config)
    sweep = Sweep(config, [t.name for t in tasks], cfg.runs, checkpoint=checkpoint, state=state,
                  progress=progress)
    costs: dict[str, dict[str, dict[str, float]]] = sweep.costs  # task → method → s/sample
    if len({t.prompt_format for t in tasks}) > 1:
        raise ArgumentError("an evaluation renders every task one way (--format)")
    for t in tasks:  # a chat rendering: its methods, and its pieces on the first episode
        # (the multi-prompt references and LTV are scored on final states, as ltv is)
        check_format([m for m in methods if m not in ens.METHODS], t, lm, plan[t.name][0])
    cap = capturer_for(lm, cfg.batch_size, progress,
                       special_tokens=all(t.special_tokens for t in tasks))
    on_states = isinstance(lm, CapturedModel)  # no model here: nothing to time a forward of
    if on_states and source is not None:
        raise ArgumentError("a transfer evaluation captures both models with transformers")
    by_name = {t.name: t for t in tasks}
    current = None
    for name, run in sweep:
        task = by_name[name]
        if name != current:  # a task's test subset is the same for every run
            current, label_ids = name, label_token_ids(task, lm.tokenizer)
            head = label_rows(lm, label_ids)
            h_zs_test = h_zs_test_source = None
        seed = cfg.seed + run
        episode = plan[task.name][run]
        if source is None:
            where = (config_key(config), task.name, run)
            c, scored = _load_episode(checkpoint, *where)
            if run == 0 and cfg.cost_samples and not on_states:
                scored = {}  # the cost table times each method's artifact: extract all
            if c is None:
                if h_zs_test is None:  # the test subset is the same for every run
                    h_zs_test = capture_test_zero_shot(cap, task, episode)
                c = capture_episode(cap, episode, h_zs_test=h_zs_test, every_set=every_set)
                if on_states:  # one engine run for every episode: its share of that time
                    c.capture_seconds = lm.seconds_for((1 + cfg.demo_sets)
                                                       * len(episode.queries))
                    c.first_seconds = lm.seconds_for(2 * len(episode.queries))
                _save_episode(checkpoint, *where, c, None)
            opts = cfg.method_options(seed, progress, getattr(cap, "batch_size", None))
            # every method but multi-prompt LTV: the first set's prompt, as the paper's
            one = c.first_set()
            fit_one, fit_all = one, c  # what the states methods are fitted to
            if taught:  # the teacher of the first prompt, and of the sets' mean
                rows = head if head is not None else label_head(lm.model, label_ids)
                fit_one = teach(cap, replace(episode, extra_demos=()), one, rows, cfg.teacher)
                fit_all = teach(cap, episode, c, rows, cfg.teacher) if every_set else fit_one
            ctx = method_context(lm, cap, episode, label_ids, opts, fit_one)
            labels = episode_labels(episode)
            save = partial(_save_episode, checkpoint, *where, c)  # (scores): the episode so far
            sc = score_methods(ctx, [m for m in own if m not in ens.METHODS], one.h_zs_test,
                               one.h_icl_test, labels, done=scored, on_scored=save, head=head)
            if taught:
                w_c, b_c = rows
                sc.logits[TEACHER] = fit_one.h_icl_test @ w_c.T + b_c
                sc.metrics[TEACHER] = {"accuracy": accuracy(sc.logits[TEACHER], labels),
                                       "d_ntp": d_ntp(sc.logits["icl"], sc.logits[TEACHER])}
            if every_set:
                multi = (method_context(lm, cap, episode, label_ids, opts, fit_all)
                         if ens.MULTI in own else None)
                rows = head if head is not None else label_head(ctx.model, label_ids)
                score_sets(sc, c, multi, labels, head, rows, scored, save)
            metrics, ext, params = sc.metrics, sc.extraction_seconds, sc.params
            if run == 0 and cfg.cost_samples and not on_states:
                costs[task.name] = inference_cost(ctx, sc, [m for m in own
                                                            if m not in ens.METHODS],
                                                  cfg.cost_samples, ctx.opts.batch_size)
                if ens.MULTI in sc.artifacts:  # LTV's hook, with the multi-prompt vector
                    costs[task.name][ens.MULTI] = inference_cost(
                        ctx, MethodScores(artifacts={"ltv": sc.artifacts[ens.MULTI]}), ["ltv"],
                        cfg.cost_samples, ctx.opts.batch_size)["ltv"]
        else:
            tr, ct, cs = run_transfer_episode(
                cap, source, episode, cfg.lam, pair_ids[task.name],
                h_zs_test_target=h_zs_test, h_zs_test_source=h_zs_test_source)
            h_zs_test, h_zs_test_source = ct.h_zs_test, cs.h_zs_test
            metrics = tr.metrics
            ext = {**tr.target.extraction_seconds,
                   **{SOURCE + m: v for m, v in tr.source.extraction_seconds.items()},
                   TRANSFER_METHOD: tr.timings["extraction_seconds"]}
            params = {}
        recs = [{
            "task": task.name,
            "run": run,
            "seed": seed,
            "method": m,
            "accuracy": metrics[m]["accuracy"],
            "d_ntp": metrics[m]["d_ntp"],
            **({"d_ntp_ensemble": metrics[m]["d_ntp_ensemble"]}
               if "d_ntp_ensemble" in metrics[m] else {}),
            "extraction_seconds": ext.get(m),
            "k_used": len(episode.demos),
            "n_test": len(episode.test),
            # the split sizes and the test's seed (the validation examples, --n-val, are the
            # dev split: the baselines' layer choice reads them, never the test)
            "n_train": len(episode.queries), "n_dev": len(episode.val),
            "test_seed": episode.test_seed,
            **({"params": params[m]} if m in params else {}),
        } for m in keys]
        sweep.finish(name, run, recs, f"{name}: " + " ".join(
            f"{m}={metrics[m]['accuracy']:.3f}" for m in keys))
        if checkpoint is not None:
            episode_checkpoint(checkpoint).unlink(missing_ok=True)
    records = sweep.records
    return {
        "config": config,
        "machine": {**hardware(), "ltv_vllm": __version__},
        "wall_seconds": sweep.wall_seconds,
        "records": records,
        "summary": summarise(records, [t.name for t in tasks], keys),
        "correlation": correlations(records, [t.name for t in tasks]),
        **({"inference_cost": costs} if costs else {}),
        **({"extends": {k: extend.get(k) for k in ("command", "machine", "extends")}
            | {"tasks": extend["config"]["tasks"], "runs": extend["config"]["runs"]}}
           if extend is not None else {}),
    }


def score_sets(sc: MethodScores, c: Captures, multi: Any, labels: Any, head: Any,
               rows: tuple[Any, Any], done: dict[str, dict[str, Any]], save: Any) -> None:
    """An episode of M > 1 demonstration sets, into `sc` (the single-prompt methods scored):
    multi-prompt LTV (LTV fitted in `multi`, whose h_icl is the mean of the sets' states;
    None: not asked for), the ensemble and the mean-state references, and every method's
    accuracy and d_NTP against single-prompt ICL and against the ensemble (`ensemble`).
    `head`: what `score_methods` takes (None: the model's); `rows`: the label rows W_C, b_C."""
    assert c.h_icl_test_sets is not None, "captured with every_set"
    if multi is not None:
        prev = done.get(ens.MULTI)
        fit = score_methods(multi, ["ltv"], c.h_zs_test, c.h_icl_test, labels,
                            done={"ltv": prev} if prev else None, head=head)
        for mine, theirs in ((sc.logits, fit.logits), (sc.artifacts, fit.artifacts),
                             (sc.extraction_seconds, fit.extraction_seconds),
                             (sc.params, fit.params)):
            if "ltv" in theirs:
                mine[ens.MULTI] = theirs["ltv"]
        save(sc)
    w_c, b_c = rows
    z_sets, refs = ens.references(c.h_icl_test_sets, w_c, b_c)
    sc.logits.update(refs)
    sc.metrics = ens.set_scores(sc.logits, z_sets, labels)
    sc.params["icl"] = {"set_accuracy": sc.metrics["icl"].pop("set_accuracy")}


# what an extension may change; each episode depends only on its task, the seed and its run
EXTENSIBLE = ("tasks", "runs", "k_per_task")


def check_extension(previous: dict[str, Any], config: dict[str, Any]) -> None:
    """Refuse to extend `previous` (a finished result document) with an evaluation whose
    `config` differs in anything but its tasks and runs. Only the keys `config` has are
    compared, so the CLI can check what it knows before the model loads."""
    old = previous.get("config")
    if not isinstance(old, dict) or not isinstance(previous.get("records"), list):
        raise ArgumentError("--extend: the earlier results.json is not an evaluation's result")
    # an evaluation from before --demo-sets drew one set per run
    old = {**old, "options": _with_default_options(old.get("options")),
           "demo_sets": old.get("demo_sets", 1)}
    diff = [k for k in config if k not in EXTENSIBLE and old.get(k) != config[k]]
    diff += [f"k for {t}" for t, k in (config.get("k_per_task") or {}).items()
             if t in old.get("k_per_task", {}) and old["k_per_task"][t] != k]
    if diff:
        raise ArgumentError(f"--extend: the earlier evaluation differs in {', '.join(diff)}; "
                            "only --tasks and --runs may change (or choose another --out)")


def _with_default_options(options: Any) -> Any:
    """An earlier document's method options, with knobs added since at their defaults (what
    that evaluation ran with): a new option does not make old results unextendable."""
    if not isinstance(options, dict):
        return options
    return {**EvalConfig().to_dict()["options"], **options}


def extension_state(previous: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The episodes of `previous` that an evaluation with `config` reuses: those of the tasks
    both ask for, runs below `config`'s; their cost tables; the time they took."""
    check_extension(previous, config)
    keep = [r for r in previous["records"]
            if r["task"] in config["tasks"] and r["run"] < config["runs"]]
    costs = {t: c for t, c in (previous.get("inference_cost") or {}).items()
             if t in config["tasks"]}
    return {"records": keep, "costs": costs,
            "done": sorted({(r["task"], r["run"]) for r in keep}),
            "wall_seconds": float(previous.get("wall_seconds") or 0.0)}


EPISODE_HEADER = "ltv_vllm_episode"


def episode_checkpoint(checkpoint: str | Path) -> Path:
    """Where the episode in progress is saved beside `checkpoint` (partial.json →
    partial.episode.safetensors): its captured states and every method scored so far."""
    return Path(checkpoint).with_suffix(".episode.safetensors")


def _save_episode(checkpoint: str | Path | None, key: str, task: str, run: int,
                  c: Captures, scores: MethodScores | None) -> None:
    """Save an episode in progress, so that a rerun neither captures its states again nor
    re-extracts a method it scored (on a 1.5B model on 2 cores the capture alone takes a
    quarter of an hour and FV's sweep most of an hour). Tensors only: safetensors."""
    if checkpoint is None:
        return
    from safetensors.torch import save_file

    tensors = {"h_zs": c.h_zs, "h_icl": c.h_icl, "h_zs_test": c.h_zs_test,
               "h_icl_test": c.h_icl_test}
    for name in ("h_icl_sets", "h_icl_test_sets"):  # M > 1 demonstration sets
        if getattr(c, name) is not None:
            tensors[name] = getattr(c, name)
    methods: dict[str, Any] = {}
    for m, z in (scores.logits.items() if scores else ()):
        if m in scores.extraction_seconds:  # not the references, which come from the states
            tensors[f"logits.{m}"] = z
            methods[m] = {"extraction_seconds": scores.extraction_seconds[m],
                          "params": scores.params.get(m)}
    header = {"key": key, "task": task, "run": run, "capture_seconds": c.capture_seconds,
              "test_seconds": c.test_seconds, "first_seconds": c.first_seconds,
              "methods": methods}
    # copies: safetensors refuses tensors sharing memory (the first set's test states)
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    atomic_write(episode_checkpoint(checkpoint), lambda tmp: save_file(
        tensors, tmp, metadata={EPISODE_HEADER: json.dumps(header)}))


def _load_episode(checkpoint: str | Path | None, key: str, task: str, run: int
                  ) -> tuple[Captures | None, dict[str, dict[str, Any]]]:
    """The saved part of this episode, or (None, {}) when there is none for it: a file of
    another episode or configuration, or a damaged one, is only lost work and is replaced."""
    if checkpoint is None or not episode_checkpoint(checkpoint).is_file():
        return None, {}
    try:
        header_json, t = read_safetensors(episode_checkpoint(checkpoint), key=EPISODE_HEADER)
        header = json.loads(header_json)
        if (header["key"], header["task"], header["run"]) != (key, task, run):
            return None, {}
        c = Captures(t["h_zs"], t["h_icl"], t["h_zs_test"], t["h_icl_test"],
                     float(header["capture_seconds"]), float(header["test_seconds"]),
                     t.get("h_icl_sets"), t.get("h_icl_test_sets"), header.get("first_seconds"))
        scored = {m: {**v, "logits": t[f"logits.{m}"]} for m, v in header["methods"].items()}
    except (VectorError, TypeError, KeyError, ValueError):
        return None, {}
    return c, scored


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
