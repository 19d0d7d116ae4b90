"""Methods × tasks × runs → JSON, a markdown table and plots (paper Table 1 and Fig. 3 style).

Each run draws a new episode (demos + N train queries) from its own seed; the balanced test
subset depends only on the test seed, so zero-shot states are captured once per task and
shared by every run. d_NTP of a method is KL(P_icl ‖ P_method) on the test subset of that
run (ICL's own d_NTP is 0 by definition).

The episodes run where the executor runs them (`evaluation.executor`: here, one after
another, or as Ray tasks on a cluster, `episodes.EpisodeRunner`); this process alone keeps
the sweep — its checkpoint and its result document — whatever order they come back in.
Reading the result back (summary, table, plots, files) is `evaluation.report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ltv_vllm import __version__
from ltv_vllm.core.teacher import TeacherOptions
from ltv_vllm.errors import ArgumentError
from ltv_vllm.evaluation import ensemble as ens
from ltv_vllm.evaluation.episodes import (  # noqa: F401 - re-exported: their old home
    EPISODE_HEADER,
    EpisodeResult,
    EpisodeRunner,
    RunnerSpec,
    _load_episode,
    _save_episode,
    episode_checkpoint,
    score_sets,
)
from ltv_vllm.evaluation.executor import failed_list, run_sweep
from ltv_vllm.evaluation.report import (  # noqa: F401 - re-exported: their old home
    FIXED_LABELS,
    SOURCE,
    TEACHER,
    all_methods,
    bars_per_task,
    correlations,
    markdown_table,
    method_colors,
    method_label,
    per_query_intervals,
    plot,
    summarise,
    write_report,
)
from ltv_vllm.evaluation.sweep import Sweep, config_key, read_checkpoint
from ltv_vllm.methods import METHODS as TASK_VECTOR_METHODS
from ltv_vllm.methods import MethodOptions
from ltv_vllm.models.hardware import hardware
from ltv_vllm.pipeline.extract import (
    CapturedModel,
    ExtractOptions,
    LoadedModel,
    check_counts,
    check_format,
    check_teacher,
    concrete_batch,
    model_dtype,
    plan_episode,
    states_methods,
)
from ltv_vllm.pipeline.transfer import (
    METHODS,
    TRANSFER_METHOD,
    SourceModel,
    check_pair,
)
from ltv_vllm.tasks.specs import Task


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
    executor: Any = None,
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

    `executor`: where the episodes run (`evaluation.executor`; None: here, in order). Each
    episode's records carry where it ran and how long it took (`episode`); an episode that
    raised on a cluster is listed under `failed` (and is not marked done: a rerun retries it).
    """
    methods = resolve_methods(methods, transfer=source is not None, demo_sets=cfg.demo_sets)
    own = tuple(m for m in methods if m != TRANSFER_METHOD)
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
    if isinstance(lm, CapturedModel) and source is not None:
        raise ArgumentError("a transfer evaluation captures both models with transformers")
    spec = RunnerSpec({t.name: t for t in tasks}, own, keys, cfg, plan,
                      pair_ids if source is not None else {})

    def keep(res: EpisodeResult) -> None:
        """An episode back from wherever it ran: its cost table kept (the sweep keeps its
        records and writes the checkpoint), its own checkpoint done with."""
        if res.cost is not None:
            costs[res.task] = res.cost
        if checkpoint is not None:
            episode_checkpoint(checkpoint).unlink(missing_ok=True)

    def local() -> EpisodeRunner:
        return spec.runner(lm, source=source, checkpoint=checkpoint, key=config_key(config),
                           progress=progress)

    failed = run_sweep(sweep, executor, spec, local, keep=keep)
    records = sweep.records
    return {
        "config": config,
        "machine": {**hardware(), "ltv_vllm": __version__},
        "wall_seconds": sweep.wall_seconds,
        "records": records,
        # (none yet where every episode failed: the document lists why, `failed`)
        "summary": summarise(records, [t.name for t in tasks], keys) if records else {},
        "correlation": correlations(records, [t.name for t in tasks]) if records else {},
        # each method against ICL on the same test queries, with intervals (per-query records)
        **({"intervals": {"vs": "icl", "methods": per_query_intervals(
            records, [t.name for t in tasks], keys)}}
           if records and "icl" in keys and source is None else {}),
        **({"inference_cost": costs} if costs else {}),
        # episodes that raised (a cluster's executor goes on without them): a rerun retries
        **({"failed": failed_list(failed)} if failed else {}),
        **({"extends": {k: extend.get(k) for k in ("command", "machine", "extends")}
            | {"tasks": extend["config"]["tasks"], "runs": extend["config"]["runs"]}}
           if extend is not None else {}),
    }



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

