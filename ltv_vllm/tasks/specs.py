"""Task specs: prompt templates, label words, data source; the built-in registry.

A Task is everything needed to turn text into a prompt and a label into a token. The
templates and label words are those of the paper (after I2CL):

    query = "{in_prefix}: {text}\\n{label_prefix}:"       (no trailing space)
    demo  = query + " " + label + "\\n"
    label token = first token of " " + label

A user's spec may change the query (`prompt`, a template over {text}), put an instruction
line once before every prompt (zero-shot: before the query; ICL: before the demonstrations),
make an example's text from several data columns (`input`, e.g. a premise and a hypothesis)
and give chat prompts a system turn (`system`, `tasks.chat`).
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ltv_vllm.errors import UserError


class TaskError(UserError):
    """A task spec that cannot be used (unknown name, bad file, colliding labels)."""


@dataclass(frozen=True)
class Task:
    name: str
    in_prefix: str
    label_prefix: str
    labels: tuple[str, ...]
    # Where the examples come from: "packaged:<file>", "hub:<dataset id>[:<config>]" or
    # a path to a local .jsonl/.csv file. Hub details (text field, splits) live in `hub`.
    source: str
    hub: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    instruction: str = ""  # once before every prompt, on a line of its own ("": none)
    prompt: str = ""       # the query, over {text} ("": the paper's, `query`)
    input: str = ""        # an example's text from the data's columns ("": the `text` column)
    system: str = ""       # chat prompts' system turn ("": the chat template's default)
    kind = "classification"
    prompt_format = "completion"  # or "chat" (`tasks.chat.ChatTask`)
    special_tokens = True  # prompts are tokenized with the tokenizer's special tokens

    def __post_init__(self) -> None:
        if len(self.labels) < 2:
            raise TaskError(
                f"task {self.name!r}: needs at least two labels, got {list(self.labels)}"
            )
        if len(set(self.labels)) != len(self.labels):
            raise TaskError(f"task {self.name!r}: duplicate label words {list(self.labels)}")
        if self.prompt:
            named = template_fields(self.prompt, f"task {self.name!r}: prompt")
            if unknown := named - {"text", "in_prefix", "label_prefix"}:
                raise TaskError(f"task {self.name!r}: prompt names {sorted(unknown)}; it may "
                                "name {text}, {in_prefix} and {label_prefix} (the data's "
                                "columns go in `input`)")
            if "text" not in named:
                raise TaskError(f"task {self.name!r}: prompt has no {{text}}")
            if self.prompt != self.prompt.rstrip():
                raise TaskError(f"task {self.name!r}: prompt ends in white space; the label "
                                "follows it after one space")
        if self.input:
            template_fields(self.input, f"task {self.name!r}: input")

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def query(self, text: str) -> str:
        if not self.prompt:
            return f"{self.in_prefix}: {text}\n{self.label_prefix}:"
        return self.prompt.format(text=text, in_prefix=self.in_prefix,
                                  label_prefix=self.label_prefix)

    def demo(self, text: str, label: int) -> str:
        return f"{self.query(text)} {self.labels[label]}\n"

    @property
    def lead(self) -> str:
        """The instruction line every prompt starts with ("" without one)."""
        return self.instruction + "\n" if self.instruction else ""

    def icl_prompt(self, demo_prefix: str, text: str) -> str:
        # Demos are concatenated with nothing between them; the query follows directly.
        return demo_prefix + self.query(text)

    def zero_shot(self, text: str) -> str:
        """The zero-shot prompt (a chat rendering puts the conversation's head first)."""
        return self.zero_shot_prefix + self.query(text)

    @property
    def zero_shot_prefix(self) -> str:
        """What every zero-shot prompt has before `query(text)` (captured once)."""
        return self.lead

    def demos_text(self, demos: Sequence[Any]) -> str:
        """What an ICL prompt has before `query(text)`."""
        return self.lead + "".join(self.demo(e.text, e.label) for e in demos)

    def label_text(self, label: str) -> str:
        """The text whose first token is the label's token, after the prompt."""
        return " " + label

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["labels"] = list(self.labels)
        for key in TEMPLATE_KEYS:  # unset: absent, as in files written before they existed
            if not d[key]:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        needed = {"name", "labels", "source"} | (
            set() if d.get("prompt") else {"in_prefix", "label_prefix"})
        missing = needed - set(d)
        if missing:
            raise TaskError(f"task spec is missing {sorted(missing)}")
        if bad := [k for k in TEMPLATE_KEYS if not isinstance(d.get(k, ""), str)]:
            raise TaskError(f"task spec: {bad[0]} must be a string")
        return cls(
            name=str(d["name"]),
            in_prefix=str(d.get("in_prefix", "")),
            label_prefix=str(d.get("label_prefix", "")),
            labels=tuple(str(x) for x in d["labels"]),
            source=str(d["source"]),
            hub=dict(d.get("hub") or {}),
            **{k: d.get(k, "") for k in TEMPLATE_KEYS},
        )


# a Task's optional template keys (its fields; a spec file's keys too)
TEMPLATE_KEYS = ("instruction", "prompt", "input", "system")


def template_fields(template: str, where: str) -> set[str]:
    """The {names} a format template uses (a bad template: one TaskError line)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise TaskError(f"{where}: {e} (write a literal brace as {{{{ or }}}})") from None
    named = {f for _, f, _, _ in parsed if f is not None}
    if bad := sorted(f for f in named if not f.isidentifier()):
        raise TaskError(f"{where}: {{{bad[0]}}} is not a field name (write a literal brace "
                        "as {{ or }})")
    return named


REGRESSION_FAMILIES = ("linear", "relu")


@dataclass(frozen=True)
class RegressionTask:
    """A synthetic regression family (the paper's appendix "Regression Experiments").

    Each run draws one *instance* (one function f) from its seed: linear f(x) = wᵀx with
    w ~ N(0, I_m); relu f(x) = αᵀReLU(Vx) with V ~ N(0, I) (r × m), α ~ N(0, I/r); inputs
    x ~ N(0, I_m); y = f(x) + noise · N(0, 1). Prompts:

        query = "x: [x1, ..., xm]\ny:"            (no trailing space)
        demo  = query + " " + y + "\n\n"           (a blank line between demos)

    with every number printed to `decimals` places. The answer is generated, not a label
    token: there are no `labels`.
    """

    name: str
    family: str
    m: int = 6
    r: int = 100
    noise: float = 0.0
    decimals: int = 4
    in_prefix: str = "x"
    label_prefix: str = "y"
    source: str = "synthetic"
    kind = "regression"
    prompt_format = "completion"
    special_tokens = True

    def __post_init__(self) -> None:
        if self.family not in REGRESSION_FAMILIES:
            raise TaskError(f"task {self.name!r}: unknown regression family {self.family!r}; "
                            f"choose one of {', '.join(REGRESSION_FAMILIES)}")
        if self.m < 1 or self.r < 1:
            raise TaskError(f"task {self.name!r}: m and r must be at least 1, got m={self.m}, "
                            f"r={self.r}")
        if not 0 <= self.decimals <= 10:
            raise TaskError(f"task {self.name!r}: decimals must be 0..10, got {self.decimals}")
        if not (self.noise >= 0 and math.isfinite(self.noise)):
            raise TaskError(f"task {self.name!r}: noise must be a finite number >= 0, "
                            f"got {self.noise}")

    def number(self, v: float) -> str:
        return f"{v:.{self.decimals}f}"

    def x_text(self, x: Sequence[float]) -> str:
        return "[" + ", ".join(self.number(v) for v in x) + "]"

    def query(self, text: str) -> str:
        return f"{self.in_prefix}: {text}\n{self.label_prefix}:"

    def demo(self, text: str, y: float) -> str:
        return f"{self.query(text)} {self.number(y)}\n\n"

    def icl_prompt(self, demo_prefix: str, text: str) -> str:
        return demo_prefix + self.query(text)

    def zero_shot(self, text: str) -> str:
        return self.query(text)

    def demos_text(self, demos: Sequence[Any]) -> str:
        return "".join(self.demo(e.text, e.label) for e in demos)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RegressionTask:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - {"kind", "data"}
        if unknown:
            raise TaskError(f"regression task spec has unknown keys {sorted(unknown)}; "
                            f"known: {sorted(known)}")
        if "family" not in d:
            raise TaskError("regression task spec needs a `family` (linear or relu)")
        try:
            return cls(name=str(d.get("name") or d["family"]), family=str(d["family"]),
                       m=int(d.get("m", 6)), r=int(d.get("r", 100)),
                       noise=float(d.get("noise", 0.0)), decimals=int(d.get("decimals", 4)),
                       in_prefix=str(d.get("in_prefix", "x")),
                       label_prefix=str(d.get("label_prefix", "y")))
        except (TypeError, ValueError) as e:
            raise TaskError(f"regression task spec: {e}") from None


AnyTask = Task | RegressionTask


def is_regression(task: object) -> bool:
    return isinstance(task, RegressionTask)


def task_from_dict(d: dict[str, Any]) -> AnyTask:
    """A task spec as saved in a file's metadata (either kind)."""
    if d.get("kind") == "regression":
        return RegressionTask.from_dict(d)
    return Task.from_dict(d)


REGRESSION_TASKS: dict[str, RegressionTask] = {
    "linear": RegressionTask("linear", "linear"),
    "relu": RegressionTask("relu", "relu"),
}


def _t(name: str, inp: str, lab: str, labels: list[str], source: str, **hub: Any) -> Task:
    return Task(name, inp, lab, tuple(labels), source, hub)


# The paper's eight tasks. `source` is the packaged StaICC copy where one exists; `hub`
# records the dataset the paper's reference code used, for users who have a hub.
BUILTIN_TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        _t("agnews", "News", "Type", ["World", "Sports", "Business", "Technology"],
           "packaged:agnews", id="ag_news", text="text", train="train", test="test"),
        _t("dbpedia", "Input", "Label",
           ["company", "school", "artist", "athlete", "politics", "transportation", "building",
            "nature", "village", "animal", "plant", "album", "film", "book"],
           "hub:fancyzhx/dbpedia_14", id="fancyzhx/dbpedia_14", text="content", train="train",
           test="test"),
        _t("hate_speech18", "Text", "Label", ["neutral", "hate"],
           "packaged:hate_speech_18", id="hate_speech18", text="text", train="train",
           test="train", halves=True),
        _t("mr", "Review", "Sentiment", ["negative", "positive"],
           "packaged:rotten_tomatoes", id="rotten_tomatoes", text="text", train="train",
           test="test"),
        _t("sst2", "Review", "Sentiment", ["negative", "positive"],
           "packaged:sst2", id="glue", config="sst2", text="sentence", train="train",
           test="validation"),
        _t("sst5", "Sentence", "Sentiment",
           ["terrible", "negative", "neutral", "positive", "great"],
           "packaged:sst5", id="SetFit/sst5", text="text", train="train", test="test"),
        _t("subj", "Sentence", "Label", ["objective", "subjective"],
           "packaged:subjective", id="SetFit/subj", text="text", train="train", test="test"),
        _t("trec", "Question", "Answer Type",
           ["Abbreviation", "Entity", "Description", "Person", "Location", "Number"],
           "packaged:trec", id="trec", text="text", label="coarse_label", train="train",
           test="test"),
    ]
}


def list_tasks() -> list[Task]:
    return list(BUILTIN_TASKS.values())


NO_DATA = "none"  # the source of a spec file that names no data

# what a classification spec file may hold (`data` or `source`: where its examples are)
SPEC_KEYS = frozenset({"name", "in_prefix", "label_prefix", "labels", "data", "source", "hub",
                       "kind", *TEMPLATE_KEYS})


def load_task_file(path: str | Path) -> AnyTask:
    """A user task from a JSON or YAML spec: name, in_prefix, label_prefix, labels, data;
    optionally instruction, prompt, input and system (`Task`).

    `data` (or `source`) is a local .jsonl/.csv path, resolved relative to the spec file.
    A spec with a `family` (linear | relu) is a regression task: m, r, noise, decimals.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TaskError(f"cannot read task spec {path}: {e.strerror}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            d = yaml.safe_load(text)
        else:
            d = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error becomes one clear line
        raise TaskError(f"task spec {path} is not valid {path.suffix[1:] or 'JSON'}: {e}") from None
    if not isinstance(d, dict):
        raise TaskError(f"task spec {path} must be a mapping")
    d = dict(d)
    d.setdefault("name", path.stem)
    if "family" in d or d.get("kind") == "regression":
        return RegressionTask.from_dict(d)  # synthetic: no data file
    if d.get("kind", "classification") != "classification":
        raise TaskError(f"task spec {path}: unknown kind {d['kind']!r}; "
                        "classification or regression")
    # a key this code does not read would be ignored without a word (an instruction or a
    # "template" would change nothing): refused, as regression specs refuse theirs
    unknown = set(d) - SPEC_KEYS
    if unknown:
        raise TaskError(f"task spec {path} has unknown keys {sorted(unknown)}; known: "
                        f"{sorted(SPEC_KEYS)}")
    d.pop("kind", None)
    # without data a spec still serves `compile` (demonstrations sent) and `classify`
    src = d.pop("data", None) or d.get("source") or NO_DATA
    if not str(src).startswith(("packaged:", "hub:", NO_DATA)):
        p = Path(src)
        src = str(p if p.is_absolute() else (path.parent / p).resolve())
    d["source"] = src
    return Task.from_dict(d)


def get_task(spec: str | AnyTask, *, regression: bool = False) -> AnyTask:
    """A built-in task name or a JSON/YAML task spec. Regression tasks only where the caller
    handles them (`regression=True`); elsewhere naming one is a one-line error."""
    task = _lookup(spec)
    if isinstance(task, RegressionTask) and not regression:
        raise TaskError(f"{task.name!r} is a regression task (a generated number, no label "
                        f"words); this command takes classification tasks only")
    return task


def _lookup(spec: str | AnyTask) -> AnyTask:
    if isinstance(spec, (Task, RegressionTask)):
        return spec
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]
    if spec in REGRESSION_TASKS:
        return REGRESSION_TASKS[spec]
    if Path(spec).suffix in (".json", ".yaml", ".yml"):
        return load_task_file(spec)
    known = ", ".join(sorted(BUILTIN_TASKS) + sorted(REGRESSION_TASKS))
    raise TaskError(f"unknown task {spec!r}; built-in tasks: {known}; or pass a .json/.yaml spec")


def get_tasks(spec: str, *, regression: bool = False) -> list[AnyTask]:
    """Comma-separated task names / spec files, or "packaged" for every packaged task."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["packaged"]:
        return [t for t in BUILTIN_TASKS.values() if t.source.startswith("packaged:")]
    if not names:
        raise TaskError("no task given")
    tasks = [get_task(n, regression=regression) for n in names]
    dup = sorted({t.name for t in tasks if sum(u.name == t.name for u in tasks) > 1})
    if dup:
        raise TaskError(f"task(s) given twice: {', '.join(dup)}")
    return tasks


def label_token_ids(task: Task, tokenizer: Any) -> list[int]:
    """First token of " " + label for each label (of the label itself through a chat
    template: `Task.label_text`); two labels sharing it is an error."""
    ids: list[int] = []
    for lab in task.labels:
        toks = tokenizer(task.label_text(lab), add_special_tokens=False)["input_ids"]
        if not toks:
            raise TaskError(f"task {task.name!r}: label {lab!r} tokenizes to nothing")
        ids.append(int(toks[0]))
    seen: dict[int, str] = {}
    for lab, tid in zip(task.labels, ids, strict=True):
        if tid in seen:
            raise TaskError(
                f"task {task.name!r}: labels {seen[tid]!r} and {lab!r} share their first token "
                f"{tokenizer.convert_ids_to_tokens(tid)!r} (id {tid}); choose distinct label words"
            )
        seen[tid] = lab
    return ids
