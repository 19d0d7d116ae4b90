"""One evaluation episode — a (task, run) of `evaluate` — from its states to its records,
in whatever process runs it: the driver (the local executor) or a Ray worker
(`evaluation.executor`), which builds its `EpisodeRunner` once and keeps its model across
episodes. Its records depend only on the task, the run and the configuration, never on
which process ran it or what it ran before.

The episode in progress is saved beside the driver's checkpoint (`episode_checkpoint`) after
its capture and after each method, so a rerun resumes inside it too; a worker saves nothing
(the driver alone writes files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import atomic_write
from ltv_vllm.core.metrics import accuracy, d_ntp
from ltv_vllm.core.vector_files import VectorError, read_safetensors
from ltv_vllm.evaluation import ensemble as ens
from ltv_vllm.evaluation.report import SOURCE, TEACHER
from ltv_vllm.extraction.capture import label_head
from ltv_vllm.methods import MethodScores, inference_cost, score_methods
from ltv_vllm.pipeline.extract import (
    CapturedModel,
    Captures,
    capture_episode,
    capture_test_zero_shot,
    capturer_for,
    episode_labels,
    label_rows,
    method_context,
    teach,
)
from ltv_vllm.pipeline.transfer import TRANSFER_METHOD, run_transfer_episode
from ltv_vllm.tasks.specs import Task, label_token_ids


@dataclass
class EpisodeResult:
    """What an episode hands the driver: its records (one per method), the task's
    inference-cost table (its first run only, else None) and the progress bar's note."""

    task: str
    run: int
    records: list[dict[str, Any]]
    cost: dict[str, Any] | None = None
    note: str = ""
    error: str | None = None  # the episode raised: its one line (no records)
    extra: Any = None  # what else the driver keeps (a bench's captured states)


@dataclass(frozen=True)
class RunnerSpec:
    """What every process's runner of one evaluation shares, picklable (a Ray worker gets it
    once): the tasks by name, the methods (`own`: the target's; `keys`: every row of a
    record), the options, every run's planned episode, and a transfer's checked pair ids."""

    tasks: dict[str, Task]
    own: tuple[str, ...]
    keys: list[str]
    cfg: Any  # evaluate.EvalConfig
    plan: dict[str, list[Any]]
    pair_ids: dict[str, Any] = field(default_factory=dict)

    def runner(self, lm: Any, *, source: Any = None, checkpoint: str | Path | None = None,
               key: str = "", progress: bool = False) -> EpisodeRunner:
        """A runner on model `lm` (the driver's: with its checkpoint; a worker's: none)."""
        return EpisodeRunner(lm, self.tasks, self.own, self.keys, self.cfg, self.plan,
                             source, self.pair_ids, checkpoint, key, progress)


@dataclass
class EpisodeRunner:
    """Everything one process needs to run episodes: the model (`lm`), the tasks, the methods
    (`own`: the target's; `keys`: every row of a record), the options and every run's
    planned episode; with a `source`, the transfer table's (`pair_ids` checked by the
    driver). `checkpoint` and `key`: where the driver saves the episode in progress (None in
    a worker)."""

    lm: Any
    tasks: dict[str, Task]
    own: tuple[str, ...]
    keys: list[str]
    cfg: Any  # evaluate.EvalConfig
    plan: dict[str, list[Any]]
    source: Any = None
    pair_ids: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | Path | None = None
    key: str = ""
    progress: bool = True
    _task: str | None = None  # the task whose shared pieces are held
    _shared: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cap = capturer_for(self.lm, self.cfg.batch_size, self.progress,
                                special_tokens=all(t.special_tokens
                                                   for t in self.tasks.values()))
        self.on_states = isinstance(self.lm, CapturedModel)

    def shared(self, name: str) -> dict[str, Any]:
        """What every run of task `name` shares (its test subset is the same for every run):
        its label ids and rows, and its test queries' zero-shot states once captured."""
        if name != self._task:
            label_ids = label_token_ids(self.tasks[name], self.lm.tokenizer)
            self._task = name
            self._shared = {"label_ids": label_ids, "head": label_rows(self.lm, label_ids),
                            "h_zs_test": None, "h_zs_test_source": None}
        return self._shared

    def run(self, name: str, run: int) -> EpisodeResult:
        """Episode (`name`, `run`): its records, in the method order of `keys`."""
        episode = self.plan[name][run]
        logits: dict[str, Any] = {}
        if self.source is None:
            metrics, ext, params, cost, captured, logits = self._own(name, run, episode)
        else:
            metrics, ext, params, cost, captured = self._transfer(name, episode)
        # each test query right or wrong, per method (the test subset is the same for every
        # run of a task: `report.per_query_intervals` pairs them)
        labels = episode_labels(episode)
        correct = {m: (z.argmax(-1).cpu() == labels).int().tolist()
                   for m, z in logits.items() if m in self.keys and z.shape[0] == len(labels)}
        recs = [{
            "task": name,
            "run": run,
            "seed": self.cfg.seed + run,
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
            **({"correct": correct[m]} if m in correct else {}),
            # how long its capture took (where and how long it ran: the executor's)
            "episode": {"capture_seconds": captured},
        } for m in self.keys]
        note = f"{name}: " + " ".join(f"{m}={metrics[m]['accuracy']:.3f}" for m in self.keys)
        return EpisodeResult(name, run, recs, cost, note)

    def _own(self, name: str, run: int, episode: Any) -> tuple:
        """The target's methods on one episode: (metrics, extraction seconds, params, the
        task's cost table or None, capture seconds, each method's test logits)."""
        cfg, lm, cap, own = self.cfg, self.lm, self.cap, self.own
        shared = self.shared(name)
        head, label_ids = shared["head"], shared["label_ids"]
        every_set, taught = cfg.demo_sets > 1, not cfg.teacher.is_default
        costly = run == 0 and cfg.cost_samples and not self.on_states
        where = (self.key, name, run)
        c, scored = _load_episode(self.checkpoint, *where)
        if costly:
            scored = {}  # the cost table times each method's artifact: extract all
        if c is None:
            if shared["h_zs_test"] is None:  # the test subset is the same for every run
                shared["h_zs_test"] = capture_test_zero_shot(cap, self.tasks[name], episode)
            c = capture_episode(cap, episode, h_zs_test=shared["h_zs_test"],
                                every_set=every_set)
            if self.on_states:  # one engine run for every episode: its share of that time
                c.capture_seconds = lm.seconds_for((1 + cfg.demo_sets) * len(episode.queries))
                c.first_seconds = lm.seconds_for(2 * len(episode.queries))
            _save_episode(self.checkpoint, *where, c, None)
        opts = cfg.method_options(cfg.seed + run, self.progress,
                                  getattr(cap, "batch_size", None))
        # every method but multi-prompt LTV: the first set's prompt, as the paper's
        one = c.first_set()
        fit_one, fit_all = one, c  # what the states methods are fitted to
        if taught:  # the teacher of the first prompt, and of the sets' mean
            rows = head if head is not None else label_head(lm.model, label_ids)
            fit_one = teach(cap, replace(episode, extra_demos=()), one, rows, cfg.teacher)
            fit_all = teach(cap, episode, c, rows, cfg.teacher) if every_set else fit_one
        ctx = method_context(lm, cap, episode, label_ids, opts, fit_one)
        labels = episode_labels(episode)
        save = partial(_save_episode, self.checkpoint, *where, c)  # (scores): so far
        single = [m for m in own if m not in ens.METHODS]
        sc = score_methods(ctx, single, one.h_zs_test, one.h_icl_test, labels, done=scored,
                           on_scored=save, head=head)
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
        cost = None
        if costly:
            cost = inference_cost(ctx, sc, single, cfg.cost_samples, ctx.opts.batch_size)
            if ens.MULTI in sc.artifacts:  # LTV's hook, with the multi-prompt vector
                cost[ens.MULTI] = inference_cost(
                    ctx, MethodScores(artifacts={"ltv": sc.artifacts[ens.MULTI]}), ["ltv"],
                    cfg.cost_samples, ctx.opts.batch_size)["ltv"]
        return (sc.metrics, sc.extraction_seconds, sc.params, cost, c.capture_seconds,
                sc.logits)

    def _transfer(self, name: str, episode: Any) -> tuple:
        """The transfer table's episode: both models' methods and the transferred LTV."""
        shared = self.shared(name)
        tr, ct, cs = run_transfer_episode(
            self.cap, self.source, episode, self.cfg.lam, self.pair_ids[name],
            h_zs_test_target=shared["h_zs_test"], h_zs_test_source=shared["h_zs_test_source"])
        shared["h_zs_test"], shared["h_zs_test_source"] = ct.h_zs_test, cs.h_zs_test
        ext = {**tr.target.extraction_seconds,
               **{SOURCE + m: v for m, v in tr.source.extraction_seconds.items()},
               TRANSFER_METHOD: tr.timings["extraction_seconds"]}
        return tr.metrics, ext, {}, None, ct.capture_seconds + cs.capture_seconds


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

