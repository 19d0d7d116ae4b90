"""Compiling demonstrations into a served task: the request, its checks, and the worker.

A compile request (the JSON body of `POST /v1/ltv/tasks`; `ltv-vllm compile` builds it):

    {"name": "sentiment",
     "task": {"in_prefix": "Review", "label_prefix": "Sentiment",
              "labels": ["negative", "positive"]},
     "demos": [{"text": "a gem", "label": "positive"}, ...],    k labelled demonstrations
     "queries": ["the plot drags", ...],                        N unlabeled inputs
     "test": [{"text": "...", "label": "negative"}, ...],       optional: accuracy, d_NTP
     "lam": 5.0,                              optional (default 5, or "auto": leave-one-out)
     "teacher": {"calibration": "batch",      optional: what the vector imitates (`core.
                 "gold_weight": 0.5,          teacher`; default the prompt itself); a gold
                 "gold_share": 1.0}}          blend needs every query as {"text", "label"}

`parse_request` checks everything a worker would trip on (names, label words whose first
tokens collide, a class without a demo, sizes, prompts longer than the served context)
before anything runs. `compile_task` is the extraction itself — the same ridge fit as
`ltv-vllm extract`, on the request's own demos and queries — and publishes the result as a
task-store entry. `python -m ltv_vllm.serving.store.compile JOB_DIR` runs it in a worker process
with
bounded threads (the server keeps a core), reporting through `JOB_DIR/status.json`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltv_vllm.core.fileio import atomic_write
from ltv_vllm.core.teacher import TeacherOptions
from ltv_vllm.errors import UserError
from ltv_vllm.serving.store.taskstore import check_name
from ltv_vllm.tasks.data import Episode, Example
from ltv_vllm.tasks.specs import Task, TaskError, label_token_ids

MAX_DEMOS = 256
MAX_QUERIES = 4096
MAX_TEST = 2048
MAX_TEXT = 20_000  # characters per input
ENTRY = "entry"    # JOB_DIR/entry: the staged entry a worker leaves for the server to publish
FIELDS = {"name", "task", "demos", "queries", "test", "lam", "teacher"}
TEACHER_FIELDS = {"calibration", "gold_weight", "gold_share"}
TASK_FIELDS = {"in_prefix", "label_prefix", "labels"}
TASK_OPTIONAL = {"instruction", "prompt"}  # `Task`'s: an instruction line, the query template


class CompileError(UserError):
    """A compile request that cannot run (one line, naming the field)."""


@dataclass(frozen=True)
class CompileRequest:
    name: str
    task: Task
    demos: tuple[Example, ...]
    queries: tuple[str, ...]
    test: tuple[Example, ...]
    lam: float | str  # or "auto": by closed-form leave-one-out error
    teacher: TeacherOptions = TeacherOptions()
    query_labels: tuple[int, ...] = ()  # a gold blend's: one label index per query

    @classmethod
    def from_episode(cls, name: str, ep: Episode, *, lam: float = 5.0,
                     test: bool = True, teacher: TeacherOptions | None = None
                     ) -> CompileRequest:
        """A sampled episode (`data.sample_episode`) as a compile request: its demos, its
        queries' texts (and labels, for a gold blend), and its test examples unless `test`
        is False."""
        teacher = teacher or TeacherOptions()
        labels = tuple(int(e.label) for e in ep.queries) if teacher.gold_weight else ()
        return cls(name, ep.task, ep.demos, tuple(e.text for e in ep.queries),
                   ep.test if test else (), lam, teacher, labels)

    def episode(self) -> Episode:
        labels = self.query_labels or (-1,) * len(self.queries)
        return Episode(self.task, 0, self.demos,
                       tuple(Example(q, y) for q, y in zip(self.queries, labels, strict=True)),
                       self.test)

    def to_dict(self) -> dict[str, Any]:
        labs = self.task.labels
        queries: list[Any] = list(self.queries)
        if self.query_labels:
            queries = [{"text": q, "label": labs[y]}
                       for q, y in zip(self.queries, self.query_labels, strict=True)]
        return {"name": self.name,
                "task": compile_spec(self.task),
                "demos": [{"text": e.text, "label": labs[e.label]} for e in self.demos],
                "queries": queries,
                "test": [{"text": e.text, "label": labs[e.label]} for e in self.test],
                "lam": self.lam,
                **({} if self.teacher.is_default else {"teacher": self.teacher.record()})}


def compile_spec(task: Task) -> dict[str, Any]:
    """A task as a compile request's `task` object (the server's `parse_request` reads it)."""
    return {"in_prefix": task.in_prefix, "label_prefix": task.label_prefix,
            "labels": list(task.labels),
            **{k: getattr(task, k) for k in sorted(TASK_OPTIONAL) if getattr(task, k)}}


def _text(x: Any, where: str) -> str:
    if not isinstance(x, str) or not x.strip():
        raise CompileError(f"{where}: a non-empty string, got {json.dumps(x)[:60]}")
    if len(x) > MAX_TEXT:
        raise CompileError(f"{where}: {len(x)} characters, over {MAX_TEXT}")
    return x


def _examples(items: Any, field: str, labels: tuple[str, ...], limit: int) -> tuple[Example, ...]:
    if not isinstance(items, list):
        raise CompileError(f"{field}: a list of {{\"text\", \"label\"}} objects")
    if len(items) > limit:
        raise CompileError(f"{field}: {len(items)} examples, over the limit of {limit}")
    out = []
    for i, e in enumerate(items):
        if not isinstance(e, dict) or set(e) != {"text", "label"}:
            raise CompileError(f"{field}[{i}]: an object with exactly \"text\" and \"label\"")
        if e["label"] not in labels:
            raise CompileError(f"{field}[{i}]: label {e['label']!r} is not one of {list(labels)}")
        out.append(Example(_text(e["text"], f"{field}[{i}].text"), labels.index(e["label"])))
    return tuple(out)


def parse_request(body: Any, *, tokenizer: Any, max_model_len: int) -> CompileRequest:
    """Every check a compile needs, on the served model's tokenizer and context; raises
    CompileError (or TaskError) with one line."""
    if not isinstance(body, dict):
        raise CompileError("the request body is a JSON object")
    if unknown := sorted(set(body) - FIELDS):
        raise CompileError(f"unknown field {unknown[0]!r}; known: {', '.join(sorted(FIELDS))}")
    for f in ("name", "task", "demos", "queries"):
        if f not in body:
            raise CompileError(f"missing field {f!r}")
    name = check_name(body["name"])
    spec = body["task"]
    if not isinstance(spec, dict) or not TASK_FIELDS <= set(spec) <= TASK_FIELDS | TASK_OPTIONAL:
        raise CompileError("task: an object with in_prefix, label_prefix and labels, and "
                           "optionally instruction and prompt")
    labels = spec["labels"]
    if not isinstance(labels, list) or not all(isinstance(x, str) and x.strip() for x in labels):
        raise CompileError("task.labels: a list of label words")
    optional = {k: _text(spec[k], f"task.{k}") for k in sorted(TASK_OPTIONAL) if k in spec}

    def prefix(key: str) -> str:  # beside a prompt of its own a prefix may be empty
        if "prompt" in optional and isinstance(spec[key], str):
            return spec[key]
        return _text(spec[key], f"task.{key}")

    task = Task(name, prefix("in_prefix"), prefix("label_prefix"), tuple(labels),
                source="compiled", **optional)  # TaskError: < 2 labels, duplicates, a bad prompt
    label_token_ids(task, tokenizer)  # TaskError when two labels share a first token
    demos = _examples(body["demos"], "demos", task.labels, MAX_DEMOS)
    if missing := [lab for i, lab in enumerate(task.labels) if all(e.label != i for e in demos)]:
        raise CompileError(f"demos: no demonstration of {missing[0]!r}; give at least one per "
                           "label")
    queries = body["queries"]
    if not isinstance(queries, list) or not queries:
        raise CompileError("queries: a non-empty list of unlabeled inputs")
    if len(queries) > MAX_QUERIES:
        raise CompileError(f"queries: {len(queries)}, over the limit of {MAX_QUERIES}")
    teacher = _teacher(body.get("teacher"))
    query_labels: tuple[int, ...] = ()
    if teacher.gold_weight:  # the blend's gold labels: every query labelled
        labelled = _examples(queries, "queries", task.labels, MAX_QUERIES)
        queries, query_labels = (tuple(e.text for e in labelled),
                                 tuple(int(e.label) for e in labelled))
    else:
        queries = tuple(_text(q, f"queries[{i}]") for i, q in enumerate(queries))
    test = _examples(body.get("test", []), "test", task.labels, MAX_TEST)
    lam = _lam(body.get("lam", 5.0))
    req = CompileRequest(name, task, demos, queries, test, lam, teacher, query_labels)
    prefix = req.episode().demo_prefix()
    n_prefix = len(tokenizer(prefix)["input_ids"])
    # every input counted in tokens: the longest in characters need not be the longest in
    # tokens (a run of digits or symbols can take a token per character)
    inputs = [task.query(t) for t in (*queries, *(e.text for e in test))]
    n_query = max(len(ids) for ids in tokenizer(inputs, add_special_tokens=False)["input_ids"])
    n = n_prefix + n_query
    if n + 1 > max_model_len:
        raise CompileError(f"the demos and the longest input make a {n}-token prompt; the "
                           f"served context is {max_model_len} tokens: give fewer or shorter "
                           "demos or inputs")
    return req


def _teacher(spec: Any) -> TeacherOptions:
    """The request's teacher (absent: the prompt itself), each field checked."""
    if spec is None:
        return TeacherOptions()
    if not isinstance(spec, dict) or not set(spec) <= TEACHER_FIELDS:
        raise CompileError("teacher: an object with calibration (icl, batch or contextual), "
                           "gold_weight and gold_share, each optional")
    try:
        return TeacherOptions(**spec)
    except (UserError, TypeError) as e:
        raise CompileError("teacher: " + str(e).replace("--teacher", "calibration")
                           .replace("--gold-weight", "gold_weight")
                           .replace("--gold-share", "gold_share")) from None


def _lam(lam: Any) -> float | str:
    """The request's λ: a positive finite number, or "auto"."""
    if lam == "auto":
        return "auto"
    try:
        ok = not isinstance(lam, bool) and isinstance(lam, int | float) and \
            math.isfinite(float(lam)) and lam > 0
    except OverflowError:  # an integer literal past float range (10**400)
        ok = False
    if not ok:
        shown = json.dumps(lam)
        raise CompileError(f"lam: a positive finite number or \"auto\", got "
                           f"{shown if len(shown) <= 40 else shown[:37] + '...'}")
    return float(lam)


# -- the worker -----------------------------------------------------------------------------
def compile_task(req: CompileRequest, model_dir: str | Path, store_root: str | Path, *,
                 base_model: str, max_rank: int | None = None, into: str | Path | None = None,
                 status: Any = None) -> dict[str, Any]:
    """Extract the request's LTV on the model in `model_dir` (transformers) and write it as
    a task-store entry; the entry's record. With `into` the entry is only staged there (the
    server publishes it: a worker that dies at any point leaves no entry); without, it is
    published in the store at once."""
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, extract
    from ltv_vllm.serving.store.taskstore import TaskStore

    def say(state: str, **kw: Any) -> None:
        if status is not None:
            status(state, **kw)

    store = TaskStore(store_root)
    t0 = time.perf_counter()
    say("loading model")
    lm = load_model(str(model_dir))
    ep = req.episode()
    say("extracting", n=len(req.queries), k=len(req.demos))
    opts = ExtractOptions(k=len(req.demos), n=len(req.queries), lam=req.lam,
                          n_test=max(1, len(req.test)), n_val=0, progress=False,
                          teacher=req.teacher)
    tv = extract(lm, req.task, "ltv", opts, episode=ep).artifact
    say("writing")
    kw = {"source": "compiled", "base_model": base_model, "rank": max_rank,
          "extra": {"compile_seconds": time.perf_counter() - t0, "n_test": len(req.test)}}
    if into is not None:
        staged = store.stage(req.name, tv, model_dir, into=into, **kw)
        return dict(json.loads((staged / "entry.json").read_text()))
    return store.add(req.name, tv, model_dir, **kw).record


def _main(job_dir: str) -> int:
    """`python -m ltv_vllm.serving.store.compile JOB_DIR`: JOB_DIR/job.json → a staged entry
    JOB_DIR/entry
    (the server publishes it); status.json says how far it got (state, error)."""
    job = Path(job_dir)
    status_path = job / "status.json"
    _die_with_parent()

    def status(state: str, **kw: Any) -> None:
        doc = {"state": state, "pid": os.getpid(), "time": time.time(), **kw}
        atomic_write(status_path, lambda tmp: Path(tmp).write_text(json.dumps(doc)))

    try:
        spec = json.loads((job / "job.json").read_text())
        import torch

        torch.set_num_threads(int(spec.get("threads", 1)))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec["model_dir"])
        req = parse_request(spec["request"], tokenizer=tok, max_model_len=spec["max_model_len"])
        record = compile_task(req, spec["model_dir"], spec["store"],
                              base_model=spec["base_model"], max_rank=spec.get("max_rank"),
                              into=job / ENTRY, status=status)
        status("done", record=record)
        return 0
    except (UserError, TaskError) as e:
        status("failed", error=str(e))
        return 1
    except BaseException as e:  # report, then fail: the server shows it to the client
        status("failed", error=f"{type(e).__name__}: {e}",
               traceback=traceback.format_exc()[-4000:])
        return 1


def _die_with_parent() -> None:
    """A worker whose server is gone stops (a restarted server drops the job; its entry
    never appears half-written either way)."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
