"""Regression evaluation: methods × instances → generated answers → MSE, parse rate, KL.

Each run is one task *instance* (a function drawn from the run's seed, `data.
sample_regression_episode`): k demos, N unlabeled queries and the test queries all from it.
Extraction is the classification one (h at the query's last token, zero-shot and after the
demos; `methods`), and every answer is *generated* greedily in transformers (`generate`):

  zero-shot   the query alone            icl         demos + query (shared prefix cache)
  ltv, mean, mlp, i2cl                   the query alone, the method applied at every step
  ltv-first   LTV's map at the first generated token only (the paper's reference code)

Scores per method and instance (`metrics.regression_scores`): MSE over own answers (parsed and
not an echo of the query's x or a demo's y), MSE over all parsed answers, parse and echo
counts, MSE with failures scored as predict-0, answers of exactly 0; and, as the analogue of d_NTP
(there is no label set to restrict to), `kl_first`: KL(P_icl ‖ P_method) over the whole
vocabulary at the first generated token, averaged over the test queries.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ltv_vllm import __version__
from ltv_vllm.core.fileio import atomic_write
from ltv_vllm.core.metrics import parse_number, pearson, regression_scores, spearman
from ltv_vllm.core.vector import DEFAULT_SHIFT_STEPS
from ltv_vllm.errors import ArgumentError
from ltv_vllm.evaluation import report
from ltv_vllm.evaluation.evaluate import (
    EvalConfig,
    bars_per_task,
    method_label,
)
from ltv_vllm.evaluation.executor import failed_list, run_sweep
from ltv_vllm.evaluation.sweep import Sweep
from ltv_vllm.extraction.capture import Capturer
from ltv_vllm.extraction.generate import greedy, greedy_shared, greedy_states
from ltv_vllm.methods import METHODS, Context, get_method
from ltv_vllm.methods.base import full_log_probs
from ltv_vllm.models.hardware import hardware, machine_line
from ltv_vllm.models.resolve import resolve_model
from ltv_vllm.pipeline.extract import DEFAULT_K, ExtractOptions, LoadedModel
from ltv_vllm.tasks.data import sample_regression_episode
from ltv_vllm.tasks.specs import RegressionTask

FIRST = "ltv-first"


def regression_methods() -> tuple[str, ...]:
    """What a regression evaluation can run: the references, LTV's first-step ablation, and
    every registered method that declares "regression" (TV, FV and SV choose their layer on
    label accuracy, which a generated number does not have)."""
    return ("zero-shot", "icl", FIRST,
            *(name for name, m in METHODS.items() if "regression" in m.supports))


DEFAULT_REGRESSION_METHODS = ("zero-shot", "icl", "ltv", FIRST, "mean")
LABELS = {FIRST: "LTV, first step only"}


def resolve_regression_methods(methods: Sequence[str] | None) -> list[str]:
    ms = list(methods) if methods else list(DEFAULT_REGRESSION_METHODS)
    known = regression_methods()
    bad = [m for m in ms if m not in known]
    if bad:
        why = (" (TV, FV and SV choose their layer on label accuracy, i2cl-cal calibrates on "
               "the label token; regression has no labels)"
               if set(bad) & {"tv", "fv", "sv", "i2cl-cal"} else "")
        raise ArgumentError(f"--methods: {', '.join(bad)} cannot run on regression tasks{why}; "
                            f"choose from {', '.join(known)}")
    if "icl" not in ms:
        ms.insert(0, "icl")  # KL is measured against it
    return ms


def _kl(logp_ref: torch.Tensor, logp: torch.Tensor) -> float:
    """Mean over rows of KL(P_ref ‖ P) from full-vocabulary log-probabilities."""
    return float((logp_ref.exp() * (logp_ref - logp)).sum(-1).mean())


def _on_device_of(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor],
                                                                           torch.Tensor]:
    # hidden-space maps hold float32 CPU tensors; the head's input may live elsewhere
    return lambda h: fn(h.float().cpu()).to(h.device)


def score_instance(ctx: Context, methods: Sequence[str], max_new_tokens: int
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, float], dict[str, Any]]:
    """Every method's scores on one instance's test queries, extraction seconds, and the
    artifacts extracted."""
    cap, ep = ctx.cap, ctx.episode
    task = ep.task
    queries = [task.query(e.text) for e in ep.test]
    gen = {"max_new_tokens": max_new_tokens}
    ext: dict[str, float] = {}
    arts: dict[str, Any] = {}
    need = [m for m in methods if m not in ("zero-shot", "icl", FIRST)]
    if FIRST in methods and "ltv" not in need:
        need.append("ltv")  # extracted for the ablation, not reported
    for name in need:
        m = get_method(name)
        t0 = time.perf_counter()
        arts[name] = m.extract(ctx)
        ext[name] = time.perf_counter() - t0 + (ctx.capture_seconds if m.uses_states else 0.0)
    if FIRST in methods:
        ext[FIRST] = ext["ltv"]
    # Zero-shot and every map at the head's input share one prefill of the queries
    # (`greedy_shared`); its states are h_zs, so the first token's distributions need no
    # further pass (`shift` gives the state the head sees, in closed form).
    head_maps = [n for n in need if get_method(n).hidden_space]

    def mapping(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return _on_device_of(functools.partial(get_method(name).shift, arts[name]))

    maps = {"zero-shot": (None, "every"),
            **{n: (mapping(n), "every") for n in head_maps if n in methods},
            **({FIRST: (mapping("ltv"), "first")} if FIRST in methods else {})}
    texts, h_zs = greedy_shared(cap, queries, maps, desc=f"{task.name} query-only gen", **gen)
    texts["icl"], h_icl = greedy_states(cap, queries, prefix=ep.demo_prefix(),
                                        desc=f"{task.name} icl gen", **gen)
    logp = {"zero-shot": full_log_probs(cap, h_zs), "icl": full_log_probs(cap, h_icl)}
    for name in head_maps:
        logp[name] = full_log_probs(cap, get_method(name).shift(arts[name], h_zs))
    if FIRST in methods:
        logp[FIRST] = logp["ltv"]  # the first token is LTV's either way
    for name in need:  # methods that act inside the network (I2CL): their own passes
        if name in head_maps:
            continue
        m = get_method(name)
        with m.applied(ctx.model, arts[name]):
            logp[name] = full_log_probs(cap, cap.hidden(queries, desc=f"{task.name} {name} test"))
            texts[name] = greedy(cap, queries, desc=f"{task.name} {name} gen", **gen)
    out: dict[str, dict[str, Any]] = {}
    for name in methods:
        s = answer_scores(task, texts[name], ep)
        s["kl_first"] = 0.0 if name == "icl" else _kl(logp["icl"], logp[name])
        out[name] = s
    return out, ext, arts


def answer_scores(task: RegressionTask, texts: list[str], ep: Any) -> dict[str, Any]:
    """`metrics.regression_scores` of the generated texts against the episode's test examples
    (their x and the demos' printed y, to tell an echo from a prediction, and their y)."""
    answers = [parse_number(t, task.in_prefix + ":") for t in texts]
    s: dict[str, Any] = regression_scores(
        answers, [float(e.label) for e in ep.test], [json.loads(e.text) for e in ep.test],
        task.decimals, demo_labels=[float(task.number(float(e.label))) for e in ep.demos])
    s["texts"] = texts  # every generated answer, parsed or not: nothing is hidden
    return s


# the methods vLLM serves (a fused task-vector file); the others exist only as hooks
VLLM_METHODS = ("zero-shot", "icl", "ltv", FIRST, "mean")


def vllm_scores(lm: LoadedModel, ctx: Context, methods: Sequence[str], arts: dict[str, Any],
                hf: dict[str, dict[str, Any]], max_new_tokens: int, work: Path,
                kv_cache_gib: int = 2) -> dict[str, dict[str, Any]]:
    """The same answers generated by vLLM (`offline.generate_in_subprocess`: zero-shot and ICL
    on the plain model with prefix caching, LTV and the mean shift fused; LTV's first-step
    answers by the request step policy `first` in LTV's own engine), scored alike, and
    their agreement with transformers': the fraction of queries with the same parsed number
    (both unparsed counts as the same) and with the identical text."""
    from ltv_vllm.serving.offline.llm import generate_in_subprocess

    ep, tok = ctx.episode, lm.tokenizer
    task = ep.task
    queries = [task.query(e.text) for e in ep.test]
    prefix = ep.demo_prefix()
    model_dir = resolve_model(lm.spec)
    longest = max(len(ctx.cap.encode(prefix + q)) for q in queries)
    base = {"model": str(model_dir), "dtype": str(lm.model.dtype).removeprefix("torch."),
            "max_model_len": longest + max_new_tokens + 1, "max_new_tokens": max_new_tokens}
    tag = f"{task.name}-{ep.seed}"
    jobs = {}
    if {"zero-shot", "icl"} & set(methods):
        res = generate_in_subprocess({**base, "vector": None, "prompts": queries +
                                      [prefix + q for q in queries]}, work, f"{tag}-plain",
                                     kv_cache_gib)
        ids = res["token_ids"]
        jobs["zero-shot"], jobs["icl"] = ids[:len(queries)], ids[len(queries):]
    for m in ("ltv", "mean"):
        if m in methods or (m == "ltv" and FIRST in methods):
            path = arts[m].save(work / f"{tag}-{m}.safetensors")
            # LTV: every step and the first only, as two requests per query in one engine
            steps = ["all", "first"] if m == "ltv" else None
            ids = generate_in_subprocess({**base, "vector": str(path), "prompts": queries,
                                          "steps": steps}, work, f"{tag}-{m}",
                                         kv_cache_gib)["token_ids"]
            jobs[m] = ids[:len(queries)]
            if m == "ltv":
                jobs[FIRST] = ids[len(queries):]
    out = {}
    for m, ids in jobs.items():
        if m not in methods:
            continue
        texts = [tok.decode(t, skip_special_tokens=True) for t in ids]
        s = answer_scores(task, texts, ep)
        ours = [parse_number(t, task.in_prefix + ":") for t in hf[m]["texts"]]
        theirs = [parse_number(t, task.in_prefix + ":") for t in texts]
        s["agreement"] = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(texts)
        s["identical_text"] = sum(a == b for a, b in zip(hf[m]["texts"], texts,
                                                         strict=True)) / len(texts)
        out[m] = s
    return out


def evaluate_regression(
    lm: LoadedModel,
    tasks: Sequence[RegressionTask],
    methods: Sequence[str],
    cfg: EvalConfig,
    *,
    max_new_tokens: int = 12,
    progress: bool = True,
    checkpoint: str | Path | None = None,
    vllm_work: Path | None = None,
    executor: Any = None,
) -> dict[str, Any]:
    """Every task × instance; the result document `write_regression_report` saves.
    `executor`: where the instances run (`evaluation.executor`; None: here, in order).

    `vllm_work`: also generate every answer vLLM serves (zero-shot, ICL, LTV, mean) through
    vLLM, with its job files there; each record gains `vllm` scores and agreement."""
    methods = resolve_regression_methods(methods)
    if max_new_tokens < 1:
        raise ArgumentError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    k = cfg.k or DEFAULT_K
    config = {
        "kind": "regression",
        "model": lm.spec,
        "model_identity": lm.identity.to_dict(),
        "dtype": str(lm.model.dtype).removeprefix("torch."),
        "tasks": [t.name for t in tasks],
        "task_specs": {t.name: t.to_dict() for t in tasks},
        "methods": methods,
        "max_new_tokens": max_new_tokens,
        "vllm": vllm_work is not None,
        **{key: v for key, v in cfg.to_dict().items() if key not in ("n_val", "cost_samples")},
        "k": k,
    }
    if executor is not None and vllm_work is not None:
        raise ArgumentError("--vllm generates every answer through one vLLM engine here: "
                            "not with --executor ray")
    sweep = Sweep(config, [t.name for t in tasks], cfg.runs, checkpoint=checkpoint,
                  progress=progress, desc="instances")
    spec = RegressionSpec({t.name: t for t in tasks}, tuple(methods), cfg, k, max_new_tokens)
    failed = run_sweep(sweep, executor, spec,
                       lambda: spec.runner(lm, progress=progress, vllm_work=vllm_work))
    records = sweep.records
    names = [t.name for t in tasks]
    return {
        "config": config,
        "machine": {**hardware(), "ltv_vllm": __version__},
        "wall_seconds": sweep.wall_seconds,
        "records": records,
        "summary": summarise_regression(records, names, methods) if records else {},
        "references": references(config),
        "correlation": _correlation(records) if records else {},
        **({"failed": failed_list(failed)} if failed else {}),
    }


@dataclass(frozen=True)
class RegressionSpec:
    """What every process's regression runner shares, picklable (`evaluation.executor`)."""

    tasks: dict[str, RegressionTask]
    methods: tuple[str, ...]
    cfg: EvalConfig
    k: int
    max_new_tokens: int

    def runner(self, lm: LoadedModel, *, progress: bool = False,
               vllm_work: Path | None = None) -> RegressionRunner:
        return RegressionRunner(self, lm, progress, vllm_work)


class RegressionRunner:
    """One process's regression instances (the driver's, or a Ray worker's): its model's
    capturer made once."""

    def __init__(self, spec: RegressionSpec, lm: LoadedModel, progress: bool,
                 vllm_work: Path | None) -> None:
        self.spec, self.lm, self.progress, self.vllm_work = spec, lm, progress, vllm_work
        self.cap = Capturer(lm.model, lm.tokenizer, batch_size=spec.cfg.batch_size,
                            progress=progress)

    def run(self, name: str, run: int) -> Any:
        """Instance `run` of task `name`: one record per method."""

        from ltv_vllm.evaluation.episodes import EpisodeResult

        sp, lm = self.spec, self.lm
        task, seed, methods = sp.tasks[name], sp.cfg.seed + run, list(sp.methods)
        ep = sample_regression_episode(task, k=sp.k, n=sp.cfg.n, n_test=sp.cfg.n_test,
                                       seed=seed)
        ctx = Context(self.cap, ep, [], sp.cfg.method_options(seed, self.progress),
                      identity=lm.identity)
        scores, ext, arts = score_instance(ctx, methods, sp.max_new_tokens)
        served = (vllm_scores(lm, ctx, methods, arts, scores, sp.max_new_tokens,
                              self.vllm_work) if self.vllm_work is not None else {})
        recs = [{"task": task.name, "run": run, "seed": seed, "method": m, **scores[m],
                 "extraction_seconds": ext.get(m), "k_used": len(ep.demos),
                 **({"vllm": served[m]} if m in served else {})}
                for m in methods]
        return EpisodeResult(name, run, recs, note=f"{name}: " + " ".join(
            f"{m}={scores[m]['mse']:.2f}" for m in methods))


def extract_regression(lm: LoadedModel, task: RegressionTask, opts: ExtractOptions, *,
                       method: str = "ltv", max_new_tokens: int = 12
                       ) -> tuple[Any, dict[str, dict[str, float]]]:
    """`extract --task linear`: the instance of `opts.seed`, its LTV (or mean shift) as a
    task-vector file (fitted by the registry's method), and zero-shot / ICL / the method
    scored on its test queries by generation."""
    k = opts.k or DEFAULT_K
    ep = sample_regression_episode(task, k=k, n=opts.n, n_test=opts.n_test, seed=opts.seed)
    cap = Capturer(lm.model, lm.tokenizer, batch_size=opts.batch_size, progress=opts.progress)
    ctx = Context(cap, ep, [], opts.method_options(cap.batch_size), identity=lm.identity)
    scores, ext, arts = score_instance(ctx, ["zero-shot", "icl", method], max_new_tokens)
    tv, secs = arts[method], ext[method]  # extracted once, by the scoring
    metrics = {m: {key: v for key, v in sc.items() if key != "texts"} for m, sc in scores.items()}
    tv = replace(tv, provenance=replace(tv.provenance, k=k, metrics=metrics,
                                        timings={"extraction_seconds": secs},
                                        shift_steps=DEFAULT_SHIFT_STEPS))
    return tv, metrics


# averaged over instances; the answer counts are summed instead (`summarise_regression`)
METRICS = ("mse", "parse_rate", "mse_zero_fill", "kl_first", "mse_own")

# predictors that read only the demos, beside the model's methods: what the MSEs mean
REFERENCES = {"zero": "predict 0 (the prior mean of y)",
              "demo_mean": "predict the demos' mean y",
              "least_squares": "least squares on the k demos (with an intercept)"}


def reference_scores(ep: Any) -> dict[str, float]:
    """Test MSE of each `REFERENCES` predictor on one instance. Least squares on the demos is
    the learner a linear instance calls for (exact up to the printed rounding once k > m);
    on relu it is a misspecified linear learner — either way a floor ICL could aim at."""
    x_demo = torch.tensor([json.loads(e.text) for e in ep.demos], dtype=torch.float64)
    x_test = torch.tensor([json.loads(e.text) for e in ep.test], dtype=torch.float64)
    # the demos' y as printed in the prompt: what the model sees
    y_demo = torch.tensor([float(ep.task.number(float(e.label))) for e in ep.demos],
                          dtype=torch.float64)
    y = torch.tensor([float(e.label) for e in ep.test], dtype=torch.float64)
    ones = torch.ones(len(x_demo), 1, dtype=torch.float64)
    coef = torch.linalg.lstsq(torch.cat([x_demo, ones], 1), y_demo[:, None]).solution[:, 0]
    pred = x_test @ coef[:-1] + coef[-1]
    return {"zero": float((y ** 2).mean()),
            "demo_mean": float(((y - y_demo.mean()) ** 2).mean()),
            "least_squares": float(((y - pred) ** 2).mean())}


def references(cfg: dict[str, Any]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per task, each reference's mean ± std over the evaluation's instances, redrawn from the
    configuration (instances are pure functions of their seed, so any results.json can be
    re-reported)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name in cfg["tasks"]:
        task = RegressionTask.from_dict(cfg["task_specs"][name])
        runs = [reference_scores(sample_regression_episode(
            task, k=cfg["k"], n=1, n_test=cfg["n_test"], seed=cfg["seed"] + r))
            for r in range(cfg["runs"])]
        out[name] = {key: _mean_std([r[key] for r in runs]) for key in REFERENCES}
    return out


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x == x]  # an instance with no parsed answer has no MSE (NaN)
    return report._mean_std(xs) if xs else (float("nan"), 0.0)


def summarise_regression(records: list[dict[str, Any]], tasks: list[str],
                         methods: list[str]) -> dict[str, Any]:
    """Per task and method: each metric's mean ± std over instances, with how many instances
    it rests on (`mse_instances`: an instance with no parsed answer has no MSE and drops out
    of the mean), and counts over all instances: answers, parsed, echoes of x, and the
    queries answered by their instance's most frequent value."""
    out: dict[str, Any] = {}
    for t in tasks:
        out[t] = {}
        for m in methods:
            rs = [r for r in records if r["task"] == t and r["method"] == m]
            cell: dict[str, Any] = {"runs": len(rs)}
            for key in METRICS:
                vals = [r[key] for r in rs if key in r]
                if len(vals) < len(rs):
                    continue  # an old record without this score: `rescore` adds it
                cell[key], cell[key + "_std"] = _mean_std(vals)
                cell[key + "_instances"] = sum(v == v for v in vals)
            for key in ("n", "parsed", "echoes", "echoes_x", "echoes_demo", "top_count",
                        "zeros"):
                if all(key in r for r in rs):
                    cell[key + "_total"] = sum(r[key] for r in rs)
            tops = {r.get("top_answer") for r in rs}
            cell["top_answer"] = tops.pop() if len(tops) == 1 else None  # shared by all
            served = [r["vllm"] for r in rs if "vllm" in r]
            if served:
                cell["vllm"] = {key: _mean_std([v[key] for v in served])[0]
                                for key in ("mse", "parse_rate", "agreement", "identical_text")}
            out[t][m] = cell
    return out


def rescore(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with every score that comes from the answers recomputed from its stored texts
    (transformers' and vLLM's) against the instances, redrawn from the configuration:
    an older results.json gains the echo counts, and a change to the scoring re-reports
    every committed evaluation without generating anything again."""
    cfg = doc["config"]
    eps: dict[tuple[str, int], tuple[RegressionTask, Any]] = {}
    records = []
    for r in doc["records"]:
        if (r["task"], r["seed"]) not in eps:
            task = RegressionTask.from_dict(cfg["task_specs"][r["task"]])
            eps[r["task"], r["seed"]] = (task, sample_regression_episode(
                task, k=r.get("k_used", cfg["k"]), n=1, n_test=cfg["n_test"], seed=r["seed"]))
        task, ep = eps[r["task"], r["seed"]]
        new = {**r, **answer_scores(task, r["texts"], ep)}
        if "vllm" in r:
            new["vllm"] = {**r["vllm"], **answer_scores(task, r["vllm"]["texts"], ep)}
        records.append(new)
    return {**doc, "records": records,
            "summary": summarise_regression(records, cfg["tasks"], cfg["methods"]),
            # the references read only the demos: kept as stored (a redraw would differ in
            # the last bits of a least-squares solve)
            "references": doc.get("references") or references(cfg),
            "correlation": _correlation(records)}


def _correlation(records: list[dict[str, Any]]) -> dict[str, Any]:
    """kl_first against MSE over (method, task, run) points, ICL left out (its KL is 0)."""
    pts = [r for r in records if r["method"] != "icl" and r["mse"] == r["mse"]]
    x, y = [r["kl_first"] for r in pts], [r["mse"] for r in pts]
    return {"pearson": pearson(x, y), "spearman": spearman(x, y), "points": len(pts)}


def _label(m: str) -> str:
    return LABELS.get(m) or method_label(m)


def _mse(x: float) -> str:
    # a degenerate answer such as ' 24444444444' squares to ~1e20: keep such cells readable
    return f"{x:.2f}" if abs(x) < 1e5 else f"{x:.2e}"


def _instances(c: dict[str, Any], key: str) -> str:
    """', on 2 of 5 instances' where a mean rests on fewer instances than ran (an instance
    with no answer of the kind has no MSE)."""
    got = c.get(key + "_instances", c["runs"])
    return "" if got >= c["runs"] else f", on {got} of {c['runs']} instances"


def regression_table(doc: dict[str, Any]) -> str:
    cfg, summ = doc["config"], doc["summary"]
    tasks, methods = cfg["tasks"], cfg["methods"]
    head = "| Method | " + " | ".join(tasks) + " |"
    sep = "|---|" + "---|" * len(tasks)
    lines = [f"Model `{cfg['model']}` ({cfg['dtype']}), k={cfg['k']}, N={cfg['n']}, "
             f"λ={cfg['lam']}, {cfg['n_test']} test queries per instance, {cfg['runs']} "
             f"instances per task (mean ± std over instances; counts over all instances), "
             f"greedy, at most {cfg['max_new_tokens']} new tokens, the first number of the "
             "answer line parsed. An **echo** is a parsed answer equal, as printed, to a "
             "coordinate of the query's own x (the model copied the `x: [x₁, …` line) or to "
             "a demo's y; the **own answers** are the parsed answers that are not echoes."]
    counted = all("echoes_total" in summ[t][m] for t in tasks for m in methods)

    def table(title: str, key: str, fmt: Callable[[float], str], skip: tuple[str, ...] = (),
              note: Callable[[dict[str, Any]], str] | None = None) -> None:
        lines.extend(["", title, "", head, sep])
        for m in methods:
            if m in skip:
                continue
            cells = []
            for t in tasks:
                c = summ[t][m]
                spread = " ± " + fmt(c[key + "_std"]) if cfg["runs"] > 1 else ""
                extra = (note(c) if note and counted else "") + _instances(c, key)
                cells.append(fmt(c[key]) + spread + (f" ({extra.lstrip(', ')})" if extra
                                                     else ""))
            lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")

    if counted:
        lines += ["", "**Answers**, of all queries: parsed / echoes of x / echoes of a demo's "
                  "y / own answers. A parse rate counts echoes as answers.", "", head, sep]
        for m in methods:
            cells = [f"{c['parsed_total']} / {c['echoes_x_total']} / {c['echoes_demo_total']}"
                     f" / {c['parsed_total'] - c['echoes_total']} of {c['n_total']}"
                     for c in (summ[t][m] for t in tasks)]
            lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
        table("**MSE over own answers** (parsed, not an echo; lower is better)", "mse_own",
              _mse, note=lambda c: f"{c['parsed_total'] - c['echoes_total']} own of "
                                   f"{c['n_total']}")
    table("**MSE over parsed answers**, echoes included (lower is better)", "mse", _mse,
          note=lambda c: f"{c['parsed_total']} parsed, {c['echoes_total']} echoes, of "
                         f"{c['n_total']}")
    refs = doc.get("references") or references(cfg)
    lines += ["", "**Reference predictors** that read only the demos (the same test queries):",
              "", head.replace("| Method |", "| Reference |"), sep]
    for key, label in REFERENCES.items():
        cells = [_mse(refs[t][key][0]) + (" ± " + _mse(refs[t][key][1]) if cfg["runs"] > 1
                                          else "") for t in tasks]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    table("**MSE with failures scored as predict-0**: every unparsed answer replaced by 0, the "
          "prior mean of y and the best constant guess (the *predict 0* reference), so a "
          "method that seldom answers scores about as well as predicting 0 here. The cost of "
          "failing to answer, never the method's own error.",
          "mse_zero_fill", _mse,
          note=lambda c: f"{c['n_total'] - c['parsed_total']} of {c['n_total']} unparsed")
    if counted:
        lines += ["", "**Constant answers**: queries answered exactly 0 (the *predict 0* "
                  "reference's answer) / with their instance's most frequent value (that "
                  "value where every instance's is the same), of all queries", "", head, sep]
        for m in methods:
            cells = []
            for t in tasks:
                c = summ[t][m]
                v = c.get("top_answer")
                cells.append(f"{c['zeros_total']} / {c['top_count_total']}"
                             + (f" ({v + 0.0:g})" if v is not None else "")
                             + f" of {c['n_total']}")
            lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
    table("**KL(P_icl ‖ P_method) at the first generated token, whole vocabulary** (the "
          "regression analogue of d_NTP)", "kl_first", "{:.3f}".format, skip=("icl",))
    if cfg.get("vllm"):
        lines += ["", "**Through vLLM** (the same greedy answers from `vllm.LLM`: zero-shot and "
                  "ICL on the plain model with prefix caching, LTV and the mean shift fused, "
                  "LTV's first step only by the request step policy `first` in LTV's engine, "
                  "where run): MSE over parsed answers / parse rate / queries with the same "
                  "parsed number as transformers / identical text", "", head, sep]
        for m in methods:
            if not all("vllm" in summ[t][m] for t in tasks):
                continue
            cells = []
            for t in tasks:
                v = summ[t][m]["vllm"]
                cells.append(f"{_mse(v['mse'])} / {v['parse_rate']:.2f} / {v['agreement']:.2f} / "
                             f"{v['identical_text']:.2f}")
            lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
    c = doc.get("correlation") or {}
    if c.get("pearson") is not None:
        lines += ["", f"KL vs MSE (over parsed answers) over {c['points']} (method, task, "
                  f"instance) points, ICL left out: Pearson r = {c['pearson']:+.2f}, "
                  f"Spearman ρ = {c['spearman']:+.2f}."]
    return "\n".join(lines) + "\n"


def plot_regression(doc: dict[str, Any], out_dir: Path) -> Path:
    cfg, summ = doc["config"], doc["summary"]
    tasks, methods = cfg["tasks"], cfg["methods"]
    key = "mse_own" if all("mse_own" in summ[t][m] for t in tasks for m in methods) else "mse"
    return bars_per_task(
        tasks, {m: [summ[t][m][key] for t in tasks] for m in methods},
        {m: [summ[t][m][key + "_std"] for t in tasks] for m in methods}, _label,
        "MSE (own answers: parsed, not echoes of x)" if key == "mse_own" else
        "MSE (parsed answers)", f"{cfg['model']}: regression MSE ({cfg['runs']} instances per "
        "task)", out_dir / "mse_per_task.png")


def write_regression_report(doc: dict[str, Any], out_dir: str | Path,
                            command: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {**doc, "command": command}
    j, md = out / "results.json", out / "results.md"
    atomic_write(j, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1)))
    text = (f"# ltv-vllm evaluate (regression)\n\n```\n{command}\n```\n\n{regression_table(doc)}"
            f"\nMachine: {machine_line(doc['machine'])}, torch {doc['machine']['torch']}, "
            f"{doc['config']['dtype']}; wall time {doc['wall_seconds'] / 60:.1f} min.\n")
    atomic_write(md, lambda tmp: Path(tmp).write_text(text))
    return [j, md, plot_regression(doc, out)]
