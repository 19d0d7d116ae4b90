"""Task specs: prompt templates, label words, data source; the built-in registry.

A Task is everything needed to turn text into a prompt and a label into a token. The
templates and label words are those of the paper (after I2CL), fixed in DESIGN.md:

    query = "{in_prefix}: {text}\\n{label_prefix}:"       (no trailing space)
    demo  = query + " " + label + "\\n"
    label token = first token of " " + label
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError


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

    def __post_init__(self) -> None:
        if len(self.labels) < 2:
            raise TaskError(
                f"task {self.name!r}: needs at least two labels, got {list(self.labels)}"
            )
        if len(set(self.labels)) != len(self.labels):
            raise TaskError(f"task {self.name!r}: duplicate label words {list(self.labels)}")

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def query(self, text: str) -> str:
        return f"{self.in_prefix}: {text}\n{self.label_prefix}:"

    def demo(self, text: str, label: int) -> str:
        return f"{self.query(text)} {self.labels[label]}\n"

    def icl_prompt(self, demo_prefix: str, text: str) -> str:
        # Demos are concatenated with nothing between them; the query follows directly.
        return demo_prefix + self.query(text)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["labels"] = list(self.labels)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        missing = {"name", "in_prefix", "label_prefix", "labels", "source"} - set(d)
        if missing:
            raise TaskError(f"task spec is missing {sorted(missing)}")
        return cls(
            name=str(d["name"]),
            in_prefix=str(d["in_prefix"]),
            label_prefix=str(d["label_prefix"]),
            labels=tuple(str(x) for x in d["labels"]),
            source=str(d["source"]),
            hub=dict(d.get("hub") or {}),
        )


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


def load_task_file(path: str | Path) -> Task:
    """A user task from a JSON or YAML spec: name, in_prefix, label_prefix, labels, data.

    `data` (or `source`) is a local .jsonl/.csv path, resolved relative to the spec file.
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
    src = d.pop("data", None) or d.get("source")
    if not src:
        raise TaskError(f"task spec {path} needs a `data` file")
    if not str(src).startswith(("packaged:", "hub:")):
        p = Path(src)
        src = str(p if p.is_absolute() else (path.parent / p).resolve())
    d["source"] = src
    return Task.from_dict(d)


def get_task(spec: str | Task) -> Task:
    """A built-in task name or the path of a JSON/YAML task spec."""
    if isinstance(spec, Task):
        return spec
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]
    if Path(spec).suffix in (".json", ".yaml", ".yml"):
        return load_task_file(spec)
    known = ", ".join(sorted(BUILTIN_TASKS))
    raise TaskError(f"unknown task {spec!r}; built-in tasks: {known}; or pass a .json/.yaml spec")


def get_tasks(spec: str) -> list[Task]:
    """Comma-separated task names / spec files, or "packaged" for every packaged task."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["packaged"]:
        return [t for t in BUILTIN_TASKS.values() if t.source.startswith("packaged:")]
    if not names:
        raise TaskError("no task given")
    tasks = [get_task(n) for n in names]
    dup = sorted({t.name for t in tasks if sum(u.name == t.name for u in tasks) > 1})
    if dup:
        raise TaskError(f"task(s) given twice: {', '.join(dup)}")
    return tasks


def label_token_ids(task: Task, tokenizer: Any) -> list[int]:
    """First token of " " + label for each label; two labels sharing it is an error."""
    ids: list[int] = []
    for lab in task.labels:
        toks = tokenizer(" " + lab, add_special_tokens=False)["input_ids"]
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
