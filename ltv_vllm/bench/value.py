"""The vector's value measured as a reviewer would (`ltv-vllm bench value`): every choice on
a dev split, the test split touched once per reported row, per-query records kept, paired
bootstrap intervals on every difference (docs/methods.md, "Measuring value").

Per task and seed, one episode (`tasks.data.sample_episode`): k-shot demonstration sets
(M of them; the first is the prompt a default vector replaces), a many-shot set, N train
queries (what a fit sees, with their labels where a row uses labels), n_dev dev queries
(labelled, disjoint from all of those: every choice) and the test subset (a function of the
test seed alone, so every seed and every row is scored on the same test queries).

States are captured once per episode and kept under OUT/states (`capture_states`); the
rows are then computed in two steps whose inputs keep the test split out of every choice:

  * `choose(train, dev, ...)` sees the train and dev splits only and returns, per row, the
    configuration it chose and a `predict` function;
  * `score_test(fits, test)` applies each row's `predict` to the test split, once.

Two regimes, each its own table:

  * no labels (the paper's setting): label-free fits (teacher base × calibration × λ)
    against the exact prompt each was fitted to (its teacher), the fit chosen on dev among
    them, and the best prompt of the same demonstrations (chosen on dev);
  * with the N queries' labels: the default (one k-shot prompt blended with gold labels at
    w = 0.8, λ = 5), LTV with prompt, calibration, w and λ chosen on dev, LTV mixed with the
    probe (mix on dev), a logistic probe on h_zs (L2 on dev), a PEFT LoRA fine-tune (lr and
    epochs on dev; `extraction.finetune`), the many-shot and the k-shot prompts.

The dev split's labels are used by every dev-chosen row of both regimes (a row's `labels`
column counts them); no fit of the no-labels regime reads a train label.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.core.metrics import accuracy
from ltv_vllm.core.probe import PROBE_L2, fit_probe
from ltv_vllm.core.ridge import ridge_fit
from ltv_vllm.core.stats import Interval, stratified_bootstrap
from ltv_vllm.core.teacher import (
    CALIBRATIONS,
    CONTENT_FREE,
    DEFAULT_GOLD_WEIGHT,
    TeacherOptions,
    calibration_offset,
    fit_targets,
    label_logprobs,
)
from ltv_vllm.errors import ArgumentError

DEFAULT_LAM = 5.0
LAMS: tuple[float | str, ...] = (5.0, "auto")
GOLD_WEIGHTS = (0.5, 0.8, 0.9, 0.95)
GOLD_CALIBRATIONS = ("icl", "batch")
MIX = (0.25, 0.5, 0.75)  # the probe's weight in the LTV + probe mixture (0 and 1: its parts)

# row names (stable: docs and tests read them from results.json)
ZERO_SHOT = "zero-shot"
PROMPT_K = "prompt, one k-shot"
PROMPT_MANY = "prompt, many-shot"
PROMPT_BEST = "prompt, best on dev"
FREE_BEST = "LTV label-free, chosen on dev"
FREE_BEST_TEACHER = "teacher of the chosen label-free fit"
DEFAULT = "default (one k-shot, gold 0.8, λ=5)"
GOLD_BEST = "LTV gold, chosen on dev"
MIXED = "LTV gold + probe, mix on dev"
PROBE = "probe (L2 on dev)"
LORA = "LoRA r8 (lr, epochs on dev)"

FREE_BASES = ("one", "many")


def free_row(base: str, calibration: str, lam: float | str) -> str:
    lam_s = "LOO" if lam == "auto" else f"{lam:g}"
    return f"LTV {base}/{calibration}, λ={lam_s}"


def teacher_row(base: str, calibration: str) -> str:
    """The prompt a label-free fit imitates: the prompt itself, or it calibrated."""
    if calibration == "icl":
        return PROMPT_K if base == "one" else PROMPT_MANY
    return f"prompt {base}, {calibration}-calibrated"


def regimes(lora: bool) -> dict[str, dict[str, Any]]:
    """Each table's rows and the comparisons ("row", "reference") it reports."""
    free_rows = [free_row(b, c, lam) for b in FREE_BASES for c in CALIBRATIONS for lam in LAMS]
    teachers = [teacher_row(b, c) for b in FREE_BASES for c in CALIBRATIONS if c != "icl"]
    free_pairs = [(free_row(b, c, lam), teacher_row(b, c))
                  for b in FREE_BASES for c in CALIBRATIONS for lam in LAMS]
    free_pairs += [(FREE_BEST, FREE_BEST_TEACHER), (FREE_BEST, PROMPT_BEST),
                   (FREE_BEST, PROMPT_K)]
    labelled = [DEFAULT, GOLD_BEST, MIXED, PROBE, *([LORA] if lora else []), PROMPT_MANY,
                PROMPT_K]
    refs = [PROBE, *([LORA] if lora else []), PROMPT_MANY, PROMPT_K]
    gold_pairs = [(row, ref) for row in (DEFAULT, GOLD_BEST, MIXED) for ref in refs]
    return {
        "no_labels": {"rows": [ZERO_SHOT, PROMPT_K, PROMPT_MANY, *teachers, PROMPT_BEST,
                               FREE_BEST_TEACHER, *free_rows, FREE_BEST],
                      "pairs": free_pairs},
        "labels": {"rows": [ZERO_SHOT, *labelled], "pairs": gold_pairs},
    }


# ---------------------------------------------------------------------------------------
# Splits and fits (pure: states in, label logits out)

@dataclass(frozen=True)
class Split:
    """One split's states: h_zs (n, d), h_icl (P, n, d) (the M k-shot prompts, then the
    many-shot one), labels (n,)."""

    h_zs: torch.Tensor
    h_icl: torch.Tensor
    labels: torch.Tensor
    name: str = ""  # train, dev or test


@dataclass
class Fit:
    """A row: what it chose on dev, its dev accuracy, and its map from a split to logits."""

    config: dict[str, Any]
    predict: Callable[[Split], torch.Tensor]
    dev_accuracy: float = float("nan")
    labels_used: int = 0  # train labels the fit reads (dev labels are counted apart)
    seconds: float = 0.0  # fitting or training time (captures are counted apart)


@dataclass(frozen=True)
class Head:
    w_c: torch.Tensor  # (K, d) the label rows of the LM head
    b_c: torch.Tensor  # (K,)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h.float() @ self.w_c.float().T + self.b_c.float()


def prompt_index(base: str, sets: int, m: int = 0) -> int:
    """Index into h_icl's P axis: k-shot set m, or the many-shot prompt (the last)."""
    return sets if base == "many" else m


def _offset(calibration: str, head: Head, train: Split, cf: torch.Tensor, p: int) -> torch.Tensor:
    opts = TeacherOptions(calibration=calibration)
    return calibration_offset(opts, label_logprobs(train.h_icl[p], head.w_c, head.b_c),
                              label_logprobs(cf[p], head.w_c, head.b_c)).float()


def prompt_fit(head: Head, train: Split, cf: torch.Tensor, p: int, calibration: str,
               config: dict[str, Any]) -> Fit:
    """Prompt p as its own reader, calibrated: the teacher a fit imitates (no fit at all)."""
    off = _offset(calibration, head, train, cf, p)
    return Fit(config, lambda s: head(s.h_icl[p]) + off)


def ltv_fit(head: Head, train: Split, cf: torch.Tensor, p: int, teacher: TeacherOptions,
            lam: float | str, config: dict[str, Any]) -> Fit:
    """LTV on h_zs fitted to prompt p's teacher (`core.teacher.fit_targets`), ridge at λ."""
    t0 = time.perf_counter()
    target, _ = fit_targets(teacher, train.h_icl[p], train.h_icl[p][:1], head.w_c, head.b_c,
                            h_content_free=cf[p], gold=train.labels)
    f = ridge_fit(train.h_zs, target - train.h_zs, lam)
    fit = Fit({**config, "lam_fitted": f.lam}, lambda s: head(s.h_zs + f.apply(s.h_zs)),
              labels_used=teacher.gold_rows(train.h_zs.shape[0]))
    fit.seconds = time.perf_counter() - t0
    return fit


def _dev_key(fit: Fit, dev: Split) -> tuple[float, float]:
    """What a dev choice maximises: accuracy, then the lower cross-entropy."""
    z = fit.predict(dev).double()
    ce = float(torch.nn.functional.cross_entropy(z, dev.labels.long()))
    return accuracy(z, dev.labels), -ce


def best_on_dev(cands: Sequence[Fit], dev: Split) -> Fit:
    """The candidate with the best dev accuracy (ties: lower dev cross-entropy, then the
    earlier one); its dev accuracy recorded."""
    keys = [_dev_key(c, dev) for c in cands]
    i = max(range(len(cands)), key=lambda j: (keys[j], -j))
    for c, k in zip(cands, keys, strict=True):
        c.dev_accuracy = k[0]
    return cands[i]


def choose(train: Split, dev: Split, cf: torch.Tensor, head: Head, *, sets: int,
           lora: Fit | None = None) -> dict[str, Fit]:
    """Every row of both tables from the train and dev splits alone (`sets`: the M k-shot
    prompts before the many-shot one in h_icl). `lora`: the LoRA rival, already trained and
    chosen on dev (`extraction.finetune`)."""
    K = head.w_c.shape[0]
    fits: dict[str, Fit] = {ZERO_SHOT: Fit({}, lambda s: head(s.h_zs))}
    many = prompt_index("many", sets)
    prompts = [(m, f"set {m + 1}") for m in range(sets)] + [(many, "many")]
    fits[PROMPT_K] = prompt_fit(head, train, cf, 0, "icl", {"prompt": "set 1"})
    fits[PROMPT_MANY] = prompt_fit(head, train, cf, many, "icl", {"prompt": "many"})
    fits[PROMPT_BEST] = best_on_dev(
        [prompt_fit(head, train, cf, p, c, {"prompt": name, "calibration": c})
         for p, name in prompts for c in CALIBRATIONS], dev)
    for base in FREE_BASES:
        p = prompt_index(base, sets)
        for c in CALIBRATIONS:
            if c != "icl":
                fits[teacher_row(base, c)] = prompt_fit(head, train, cf, p, c,
                                                        {"prompt": base, "calibration": c})
            for lam in LAMS:
                fits[free_row(base, c, lam)] = ltv_fit(
                    head, train, cf, p, TeacherOptions(calibration=c), lam,
                    {"prompt": base, "calibration": c, "lam": lam})
    # label-free, chosen on dev: every prompt (demonstration selection), calibration and λ
    free = [ltv_fit(head, train, cf, p, TeacherOptions(calibration=c), lam,
                    {"prompt": name, "calibration": c, "lam": lam})
            for p, name in prompts for c in CALIBRATIONS for lam in LAMS]
    fits[FREE_BEST] = best_on_dev(free, dev)
    chosen = fits[FREE_BEST].config
    p_free = many if chosen["prompt"] == "many" else int(chosen["prompt"].split()[1]) - 1
    fits[FREE_BEST_TEACHER] = prompt_fit(head, train, cf, p_free, chosen["calibration"],
                                         {"prompt": chosen["prompt"],
                                          "calibration": chosen["calibration"]})
    # with labels
    fits[DEFAULT] = ltv_fit(head, train, cf, 0, TeacherOptions(
        gold_weight=DEFAULT_GOLD_WEIGHT), DEFAULT_LAM,
        {"prompt": "set 1", "calibration": "icl", "gold_weight": DEFAULT_GOLD_WEIGHT,
         "lam": DEFAULT_LAM})
    gold = [ltv_fit(head, train, cf, p, TeacherOptions(calibration=c, gold_weight=w), lam,
                    {"prompt": name, "calibration": c, "gold_weight": w, "lam": lam})
            for p, name in prompts for c in GOLD_CALIBRATIONS for w in GOLD_WEIGHTS
            for lam in LAMS]
    fits[GOLD_BEST] = best_on_dev(gold, dev)
    t0 = time.perf_counter()
    probes = [fit_probe(train.h_zs, train.labels, K, l2) for l2 in PROBE_L2]
    seconds = (time.perf_counter() - t0) / len(probes)
    fits[PROBE] = best_on_dev([Fit({"l2": pr.l2}, lambda s, pr=pr: pr.logits(s.h_zs).float(),
                                   labels_used=train.h_zs.shape[0], seconds=seconds)
                               for pr in probes], dev)
    ltv_best, probe_best = fits[GOLD_BEST], fits[PROBE]

    def mixed(alpha: float) -> Callable[[Split], torch.Tensor]:
        return lambda s: ((1 - alpha) * torch.log_softmax(ltv_best.predict(s).double(), -1)
                          + alpha * torch.log_softmax(probe_best.predict(s).double(), -1)
                          ).float()

    fits[MIXED] = best_on_dev([Fit({"probe_weight": a, "ltv": ltv_best.config,
                                    "probe": probe_best.config}, mixed(a),
                                   labels_used=train.h_zs.shape[0],
                                   seconds=ltv_best.seconds + probe_best.seconds)
                               for a in (0.0, *MIX, 1.0)], dev)
    if lora is not None:
        fits[LORA] = lora
    for name in (PROMPT_K, PROMPT_MANY, DEFAULT, ZERO_SHOT, FREE_BEST_TEACHER,
                 *(teacher_row(b, c) for b in FREE_BASES for c in CALIBRATIONS if c != "icl"),
                 *(free_row(b, c, lam) for b in FREE_BASES for c in CALIBRATIONS
                   for lam in LAMS)):
        fits[name].dev_accuracy = _dev_key(fits[name], dev)[0]
    return fits


def score_test(fits: dict[str, Fit], test: Split) -> dict[str, list[int]]:
    """Each row's predicted label index on every test query: the one touch of the test."""
    return {name: fit.predict(test).argmax(-1).tolist() for name, fit in fits.items()}


# ---------------------------------------------------------------------------------------
# Intervals from per-query records

def per_query(records: dict[str, Any], task: str, row: str) -> torch.Tensor:
    """A row's per-query score on a task's test queries: correctness, mean over seeds."""
    gold = torch.tensor(records["tasks"][task]["gold"])
    eps = [e for e in records["episodes"] if e["task"] == task]
    assert eps, f"no episode of {task}"
    return torch.stack([(torch.tensor(e["test_predictions"][row]) == gold).double()
                        for e in eps]).mean(0)


def compare(records: dict[str, Any], row: str, ref: str, tasks: Sequence[str],
            seed: int = 0) -> dict[str, Any]:
    """row − ref, per task and averaged over tasks, with paired bootstrap intervals."""
    pairs = {t: (per_query(records, t, row), per_query(records, t, ref)) for t in tasks}
    per = {t: stratified_bootstrap([pq], seed=seed).record() for t, pq in pairs.items()}
    avg: Interval = stratified_bootstrap(list(pairs.values()), seed=seed)
    verdicts = [per[t]["verdict"] for t in tasks]
    return {"row": row, "reference": ref, "per_task": per, "average": avg.record(),
            "above": verdicts.count("above"), "tie": verdicts.count("tie"),
            "below": verdicts.count("below")}


def summarise(records: dict[str, Any], tasks: Sequence[str], lora: bool) -> dict[str, Any]:
    """Both tables: per task and row the test accuracy (mean over seeds), the mean dev
    accuracy, and every comparison of the regime with its intervals."""
    out: dict[str, Any] = {}
    for name, reg in regimes(lora).items():
        acc = {t: {r: float(per_query(records, t, r).mean()) for r in reg["rows"]}
               for t in tasks}
        out[name] = {"accuracy": acc,
                     "average": {r: statistics.fmean(acc[t][r] for t in tasks)
                                 for r in reg["rows"]},
                     "comparisons": [compare(records, r, ref, tasks) for r, ref in reg["pairs"]]}
    return out


# ---------------------------------------------------------------------------------------
# Capture and the sweep

@dataclass(frozen=True)
class ValueOptions:
    """One run of the protocol: sizes, seeds and the rivals' settings."""

    model: str = "smollm2-135m"
    k: int = 30
    many_k: int | str = 120  # or "max": as many as fit the context (`most_demos`)
    demo_sets: int = 3
    n: int = 256
    n_dev: int = 200
    n_test: int = 500
    seeds: tuple[int, ...] = (0, 1, 2)
    test_seed: int = 0
    dtype: str = "bfloat16"
    batch_size: int = 16
    lora: bool = True
    lora_options: Any = None  # extraction.finetune.LoraOptions (default when None)
    serving: Any = None  # bench.value_serving.ServingOptions: measure serving costs
    serving_tasks: tuple[str, ...] | None = None  # of those tasks alone (None: every task)

    def __post_init__(self) -> None:
        if self.many_k != "max" and (isinstance(self.many_k, bool | str)
                                     or int(self.many_k) < 1):
            raise ArgumentError(f"--many-k must be a positive number or 'max', got "
                                f"{self.many_k!r}")
        for name, v in (("--k", self.k), ("--n", self.n),
                        ("--n-dev", self.n_dev), ("--n-test", self.n_test),
                        ("--demo-sets", self.demo_sets), ("--batch-size", self.batch_size)):
            if isinstance(v, bool) or int(v) < 1:
                raise ArgumentError(f"{name} must be at least 1, got {v}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ArgumentError(f"--seeds must be distinct, got {list(self.seeds)}")

    def state_key(self) -> dict[str, Any]:
        """What an episode's stored states depend on besides task and seed."""
        return {"model": self.model, "dtype": self.dtype, "k": self.k, "many_k": self.many_k,
                "demo_sets": self.demo_sets, "n": self.n, "n_dev": self.n_dev,
                "n_test": self.n_test, "test_seed": self.test_seed}


def plan(task: Any, opts: ValueOptions, seed: int, tokenizer: Any = None,
         context: int | None = None) -> tuple[Any, tuple[Any, ...]]:
    """(the episode, its many-shot demonstrations): refused in one line before a model loads
    where the data cannot hold the splits. `many_k="max"` needs the tokenizer and context."""
    from ltv_vllm.tasks.data import load_dataset, many_shot_demos, sample_episode

    data = load_dataset(task)
    ep = sample_episode(data, k=opts.k, n=opts.n, n_test=opts.n_test, seed=seed,
                        test_seed=opts.test_seed, n_val=opts.n_dev, demo_sets=opts.demo_sets)
    K = task.num_classes
    if len(ep.val) < K * (opts.n_dev // K) or not ep.val:  # balanced: n_dev // K per class
        raise ArgumentError(f"{task.name}: --n-dev {opts.n_dev}: only {len(ep.val)} train "
                            "examples are left for a balanced dev split besides the demos and "
                            "queries")
    if opts.many_k != "max":
        return ep, many_shot_demos(data, ep, int(opts.many_k))
    if tokenizer is None or context is None:
        raise ArgumentError("--many-k max needs the model's tokenizer and context length")
    return ep, most_demos(data, ep, tokenizer, context)


def most_demos(data: Any, ep: Any, tokenizer: Any, context: int) -> tuple[Any, ...]:
    """The many-shot demonstrations with the most per class (k//K each) whose prompt, with
    the longest query of the episode after it, fits the context, and that the train data
    holds besides the queries and the dev split (binary search over the per-class count)."""
    from ltv_vllm.tasks.data import DataError, many_shot_demos

    task = ep.task
    K = task.num_classes
    longest = max((e.text for e in (*ep.queries, *ep.val, *ep.test)), key=len)

    def fits(per_class: int) -> tuple[Any, ...] | None:
        try:
            many = many_shot_demos(data, ep, per_class * K)
        except DataError:
            return None
        text = task.demos_text(many) + task.query(longest)
        n = len(tokenizer(text, add_special_tokens=task.special_tokens,
                          verbose=False)["input_ids"])  # probes go past the context
        return many if n <= context else None

    lo, hi = 0, min(data.class_counts("train")) + 1
    while hi - lo > 1:  # fits(lo) holds (or lo = 0), fits(hi) does not
        mid = (lo + hi) // 2
        if fits(mid) is not None:
            lo = mid
        else:
            hi = mid
    while lo > 0 and (many := fits(lo)) is None:  # selections differ per count: verify
        lo -= 1
    if lo == 0:
        raise ArgumentError(f"{task.name}: not one demonstration per class fits the context "
                            f"of {context} tokens")
    return many


def capture_states(cap: Any, task: Any, ep: Any, many: Sequence[Any],
                   h_zs_test: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every state an episode's rows need (float32) and what capturing them cost."""
    from ltv_vllm.extraction.capture import zero_shot_states

    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "h_zs_train": zero_shot_states(cap, task, [e.text for e in ep.queries],
                                       desc=f"{task.name} zero-shot train"),
        "h_zs_dev": zero_shot_states(cap, task, [e.text for e in ep.val],
                                     desc=f"{task.name} zero-shot dev"),
        "h_zs_test": h_zs_test}
    cost: dict[str, Any] = {"zero_shot_train_seconds": time.perf_counter() - t0, "prompts": []}
    splits = {"train": ep.queries, "dev": ep.val, "test": ep.test}
    per: dict[str, list[torch.Tensor]] = {s: [] for s in (*splits, "cf")}
    prefixes = [*ep.demo_prefixes(), task.demos_text(many)]
    for p, prefix in enumerate(prefixes):
        name = "many" if p == len(prefixes) - 1 else f"set {p + 1}"
        for s, exs in splits.items():
            t0 = time.perf_counter()
            per[s].append(cap.icl(prefix, [task.query(e.text) for e in exs],
                                  desc=f"{task.name} {name} {s}").float())
            if s == "train":
                cost["prompts"].append({"prompt": name, "train_seconds": time.perf_counter() - t0,
                                        "prompt_tokens": len(cap.encode(prefix)),
                                        "k": len(many) if name == "many" else len(ep.demos)})
        per["cf"].append(cap.icl(prefix, [task.query(t) for t in CONTENT_FREE],
                                 desc=f"{task.name} {name} content-free").float())
    for s in (*splits, "cf"):
        out[f"h_icl_{s}"] = torch.stack(per[s])
    for s, exs in splits.items():
        out[f"labels_{s}"] = torch.tensor([e.label for e in exs])
    return out, cost


def splits_of(st: dict[str, torch.Tensor]) -> tuple[Split, Split, Split]:
    def make(s: str) -> Split:
        return Split(st[f"h_zs_{s}"], st[f"h_icl_{s}"], st[f"labels_{s}"], s)

    return make("train"), make("dev"), make("test")


def text_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _digest(examples: Sequence[Any]) -> str:
    return hashlib.sha256(json.dumps([[e.text, e.label] for e in examples]).encode()
                          ).hexdigest()[:16]


def run_episode(st: dict[str, torch.Tensor], sets: int,
                lora: Fit | None = None) -> dict[str, Any]:
    """One episode's record: the choices (from train and dev), then the test predictions."""
    train, dev, test = splits_of(st)
    head = Head(st["w_c"], st["b_c"])
    fits = choose(train, dev, st["h_icl_cf"], head, sets=sets, lora=lora)
    return {"choices": {n: {"config": f.config, "dev_accuracy": f.dev_accuracy,
                            "labels_used": f.labels_used, "fit_seconds": f.seconds}
                        for n, f in fits.items()},
            "test_predictions": score_test(fits, test)}


@dataclass
class _Model:
    """The model, loaded on first need (a rerun over stored states may never load it)."""

    opts: ValueOptions
    lm: Any = None
    caps: dict[str, Any] = field(default_factory=dict)

    def capturer(self, task: Any) -> Any:
        from ltv_vllm.extraction.capture import Capturer
        from ltv_vllm.models.loading import load_model

        if self.lm is None:
            self.lm = load_model(self.opts.model, dtype=self.opts.dtype)
        if task.name not in self.caps:
            self.caps[task.name] = Capturer(self.lm.model, self.lm.tokenizer,
                                            batch_size=self.opts.batch_size, progress=True,
                                            special_tokens=task.special_tokens)
        return self.caps[task.name]


def lora_record(model: _Model, task: Any, ep: Any, label_ids: Sequence[int],
                path: Path, *, adapter_needed: bool = False) -> dict[str, Any]:
    """The LoRA rival of one episode: trained with lr and epochs chosen on dev, its dev and
    test label logits stored at `path` and its adapter beside it (`adapter_dir`), so a rerun
    over stored states reuses them (and trains again only where the adapter is needed, for
    serving, and missing)."""
    from ltv_vllm.core.fileio import atomic_write
    from ltv_vllm.extraction.finetune import LoraOptions, LoraTuner

    lo = replace(model.opts.lora_options or LoraOptions(), seed=ep.seed)
    key = {**model.opts.state_key(), "seed": ep.seed, "lora": lo.record()}
    adapter = adapter_dir(path)
    if path.is_file() and (not adapter_needed or (adapter / "adapter_config.json").is_file()):
        rec = json.loads(path.read_text())
        if rec.get("key") == key:
            return rec
    model.capturer(task)  # loads the model
    lm = model.lm
    with LoraTuner(lm.model, lm.tokenizer, label_ids, special_tokens=task.special_tokens,
                   opts=lo) as tuner:
        choice = tuner.fit([task.zero_shot(e.text) for e in ep.queries],
                           [e.label for e in ep.queries],
                           [task.zero_shot(e.text) for e in ep.val], [e.label for e in ep.val])
        # the kept adapter's test logits: computed once, read only by `score_test`
        z_test = tuner.label_logits([task.zero_shot(e.text) for e in ep.test], desc="lora test")
        z_dev = tuner.label_logits([task.zero_shot(e.text) for e in ep.val], desc="lora dev")
        tuner.save(adapter)  # what vLLM's LoRA serves (`bench value --serving`)
    rec = {"key": key, "lr": choice.lr, "epoch": choice.epoch,
           "dev_accuracy": choice.dev_accuracy, "curve": choice.curve,
           "train_seconds": choice.train_seconds, "dev_logits": z_dev.tolist(),
           "test_logits": z_test.tolist()}
    atomic_write(path, lambda p: Path(p).write_text(json.dumps(rec)))
    return rec


def adapter_dir(lora_json: Path) -> Path:
    """The PEFT adapter directory kept beside an episode's LoRA record."""
    return lora_json.with_name(lora_json.name.replace(".lora.json", ".adapter"))


def default_vector(model: _Model, task: Any, ep: Any, path: Path) -> Path:
    """The vector `extract` ships for this episode (its first demonstration set, the gold
    blend at DEFAULT_GOLD_WEIGHT, λ = 5), written to `path` (kept when already there)."""
    from ltv_vllm.pipeline.extract import ExtractOptions, extract

    if path.is_file():
        return path
    model.capturer(task)  # loads the model
    o = model.opts
    res = extract(model.lm, task, "ltv", ExtractOptions(
        k=o.k, n=o.n, lam=DEFAULT_LAM, seed=ep.seed, n_test=o.n_test, n_val=o.n_dev,
        batch_size=o.batch_size, progress=False,
        teacher=TeacherOptions(gold_weight=DEFAULT_GOLD_WEIGHT)),
        episode=replace(ep, extra_demos=()))
    res.artifact.save(path)
    return path


def lora_fit(rec: dict[str, Any], train_n: int) -> Fit:
    """The LoRA row as a Fit: the kept adapter's stored logits of the split asked for."""
    z = {"dev": torch.tensor(rec["dev_logits"]), "test": torch.tensor(rec["test_logits"])}

    def predict(s: Split) -> torch.Tensor:
        assert s.name in z, f"the LoRA rival has no logits of a {s.name!r} split"
        return z[s.name]

    return Fit({"lr": rec["lr"], "epoch": rec["epoch"]}, predict,
               dev_accuracy=rec["dev_accuracy"], labels_used=train_n,
               seconds=rec["train_seconds"])


def options_record(opts: ValueOptions) -> dict[str, Any]:
    """What results.json records of the options (and what merged runs must share)."""
    return {**opts.state_key(), "seeds": list(opts.seeds), "batch_size": opts.batch_size,
            "lora": opts.lora, "lora_options": _lora_record(opts)}


def merge_docs(paths: Sequence[Path], opts: ValueOptions,
               tasks: Sequence[str]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Earlier runs of `bench value` to merge (`--merge`): (results.json, records.json) of
    each, checked before any model loads — the same options (tasks aside), and no task that
    this run or another merged one has."""
    want = {k: v for k, v in options_record(opts).items() if k != "batch_size"}
    seen = set(tasks)
    out = []
    for path in paths:
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        try:
            doc = json.loads((folder / "results.json").read_text())
            records = json.loads((folder / "records.json").read_text())
        except (OSError, ValueError) as e:
            raise ArgumentError(f"--merge {path}: not a readable `bench value` result ({e})"
                                ) from None
        if not isinstance(doc, dict) or "options" not in doc or "episodes" not in doc:
            raise ArgumentError(f"--merge {path}: not the results of `ltv-vllm bench value`")
        theirs = {k: v for k, v in doc["options"].items() if k != "batch_size"}
        differ = [f"{k} {theirs.get(k)!r} here {v!r}" for k, v in want.items()
                  if theirs.get(k) != v]
        if differ:
            raise ArgumentError(f"--merge {path}: another configuration: {'; '.join(differ)}")
        twice = sorted(seen & set(doc["tasks"]))
        if twice:
            raise ArgumentError(f"--merge {path}: {', '.join(twice)} is in this run or another "
                                "merged one")
        seen |= set(doc["tasks"])
        out.append((doc, records))
    return out


def bench_value(tasks: Sequence[Any], opts: ValueOptions, out_dir: Path, command: str,
                log: Callable[[str], None] = print,
                merged: Sequence[tuple[dict[str, Any], dict[str, Any]]] = ()
                ) -> dict[str, Any]:
    """Capture what is missing under out_dir/states, run every episode, write results.json,
    records.json (per-query predictions) and results.md. `merged`: earlier runs of other
    tasks (`merge_docs`) whose episodes join the tables."""
    from safetensors.torch import load_file, save_file

    from ltv_vllm.bench import report
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.core.fileio import atomic_write
    from ltv_vllm.extraction.capture import label_head, zero_shot_states
    from ltv_vllm.models.checkpoint import context_length
    from ltv_vllm.models.hardware import machine_line
    from ltv_vllm.models.loading import load_tokenizer, local_model_dir
    from ltv_vllm.tasks.data import check_disjoint
    from ltv_vllm.tasks.specs import label_token_ids

    hw = machine()
    states_dir = out_dir / "states"
    states_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(opts.model)
    context = context_length(local_model_dir(opts.model))
    model = _Model(opts)
    t_start = time.perf_counter()
    episodes: list[dict[str, Any]] = []
    per_task: dict[str, dict[str, Any]] = {}
    for task in tasks:
        label_ids = label_token_ids(task, tok)
        zs_test: torch.Tensor | None = None
        for seed in opts.seeds:
            ep, many = plan(task, opts, seed, tok, context)
            check_disjoint(ep, many)
            path = states_dir / f"{task.name}_seed{seed}.safetensors"
            meta_path = path.with_suffix(".json")
            key = {**opts.state_key(), "seed": seed, "episode": ep.fingerprint(),
                   "dev": _digest(ep.val), "many": _digest(many)}
            have = path.is_file() and meta_path.is_file() and json.loads(
                meta_path.read_text()).get("key") == key
            if not have:
                cap = model.capturer(task)
                if zs_test is None:
                    t0 = time.perf_counter()
                    zs_test = zero_shot_states(cap, task, [e.text for e in ep.test],
                                               desc=f"{task.name} zero-shot test")
                    log(f"{task.name}: zero-shot test states in {time.perf_counter() - t0:.1f} s")
                st, cost = capture_states(cap, task, ep, many, zs_test)
                st["w_c"], st["b_c"] = label_head(model.lm.model, label_ids)
                save_file({k: v.contiguous() for k, v in st.items()}, str(path))
                meta = {"key": key, "cost": cost, "machine": machine_line(hw)}
                atomic_write(meta_path,
                             lambda p, m=meta: Path(p).write_text(json.dumps(m, indent=1)))
            st = load_file(str(path))
            meta = json.loads(meta_path.read_text())
            lora = None
            if opts.lora:
                rec = lora_record(model, task, ep, label_ids,
                                  states_dir / f"{task.name}_seed{seed}.lora.json",
                                  adapter_needed=opts.serving is not None
                                  and seed == opts.seeds[0])
                lora = lora_fit(rec, len(ep.queries))
            out = run_episode(st, opts.demo_sets, lora)
            episodes.append({"task": task.name, "seed": seed, **out, "cost": meta["cost"],
                             "machine": meta["machine"]})
            per_task[task.name] = {
                "gold": [e.label for e in ep.test],
                "test_ids": [text_id(e.text) for e in ep.test],
                "splits": {"train": len(ep.queries), "dev": len(ep.val), "test": len(ep.test),
                           "k": len(ep.demos), "demo_sets": len(ep.demo_sets),
                           "many_k": len(many)}}
            acc = {r: sum(p == g for p, g in zip(out["test_predictions"][r],
                                                 per_task[task.name]["gold"], strict=True))
                   / len(ep.test) for r in (PROMPT_K, DEFAULT, PROBE, FREE_BEST)}
            log(f"{task.name} seed {seed}: " + ", ".join(f"{r} {100 * a:.1f}%"
                                                          for r, a in acc.items()))
    serving = []
    for task in tasks if opts.serving is not None else ():
        if opts.serving_tasks is not None and task.name not in opts.serving_tasks:
            continue
        serving.append(_serve_task(model, task, opts, states_dir, tok, context, episodes, log))
    names = [t.name for t in tasks]
    for other, other_records in merged:  # checked by `merge_docs`
        preds = {(e["task"], e["seed"]): e["test_predictions"]
                 for e in other_records["episodes"]}
        episodes += [{**e, "test_predictions": preds[(e["task"], e["seed"])]}
                     for e in other["episodes"]]
        per_task |= other_records["tasks"]
        names += other["tasks"]
        serving += other.get("serving", [])
    records = {"tasks": per_task, "episodes": [
        {k: e[k] for k in ("task", "seed", "test_predictions")} for e in episodes]}
    doc = {"command": command, "options": options_record(opts),
           "merged": [other["command"] for other, _ in merged],
           "tasks": names, "splits": {t: per_task[t]["splits"] for t in names},
           "machine": hw, "threads": torch.get_num_threads(),
           "wall_seconds": time.perf_counter() - t_start,
           "episodes": [{k: e[k] for k in ("task", "seed", "choices", "cost", "machine")}
                        for e in episodes],
           "records": "records.json",
           "summary": summarise(records, names, opts.lora),
           "serving": serving}
    atomic_write(out_dir / "records.json",
                 lambda p: Path(p).write_text(json.dumps(records, separators=(",", ":"))))
    report.write(doc, out_dir, value_markdown(doc))
    return doc


# the transformers row each served way answers as
SERVED_AS = {"zero-shot": ZERO_SHOT, "prompt, one k-shot (prefix cache)": PROMPT_K,
             "prompt, many-shot (prefix cache)": PROMPT_MANY,
             "default vector (fused, first token)": DEFAULT, "LoRA adapter (vLLM LoRA)": LORA}


def _serve_task(model: _Model, task: Any, opts: ValueOptions, states_dir: Path, tok: Any,
                context: int, episodes: list[dict[str, Any]],
                log: Callable[[str], None]) -> dict[str, Any]:
    """The serving costs of the first seed's episode of `task`, and how often each engine's
    label agrees with the transformers row it serves on the same queries."""
    from ltv_vllm.bench.value_serving import serving_costs
    from ltv_vllm.models.hardware import resolve_for_model
    from ltv_vllm.models.loading import local_model_dir

    seed = opts.seeds[0]
    ep, many = plan(task, opts, seed, tok, context)
    stem = states_dir / f"{task.name}_seed{seed}"
    vector = default_vector(model, task, ep, stem.with_name(stem.name + ".default.pt"))
    adapter = adapter_dir(stem.with_name(stem.name + ".lora.json")) if opts.lora else None
    model_dir = local_model_dir(opts.model)
    res = serving_costs(model_dir, task, ep, many, _label_ids(task, tok), vector, adapter,
                        resolve_for_model(opts.dtype, model_dir), opts.serving,
                        states_dir.parent / "work", log=log)
    ours = next(e for e in episodes if e["task"] == task.name and e["seed"] == seed)
    for way, r in res["ways"].items():
        row = SERVED_AS.get(way.replace(" (again)", ""))
        mine = ours["test_predictions"][row][: len(r["predictions"])]
        r["agreement"] = sum(a == b for a, b in zip(mine, r["predictions"], strict=True)
                             ) / len(mine)
        r["served_as"] = row
    return res


def _label_ids(task: Any, tok: Any) -> list[int]:
    from ltv_vllm.tasks.specs import label_token_ids

    return list(label_token_ids(task, tok))


def _lora_record(opts: ValueOptions) -> dict[str, Any] | None:
    if not opts.lora:
        return None
    from ltv_vllm.extraction.finetune import LoraOptions

    lo = opts.lora_options or LoraOptions()
    return {k: v for k, v in lo.record().items() if k != "seed"} | {"seed": "the episode's"}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _interval(r: dict[str, Any]) -> str:
    return f"{100 * r['diff']:+.1f} [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}]"


def value_markdown(doc: dict[str, Any]) -> str:
    tasks, s, o = doc["tasks"], doc["summary"], doc["options"]
    machines = sorted({e["machine"] for e in doc["episodes"]})
    sizes = doc["splits"]
    lines = ["# The vector's value under a held-out protocol", "", "```", doc["command"],
             *(f"# merged with the tasks of: {c}" for c in doc.get("merged", [])), "```",
             "", f"Model `{o['model']}` ({o['dtype']}); seeds {o['seeds']} (demonstrations, "
             f"train and dev queries), test seed {o['test_seed']} (the same test queries for "
             f"every seed and row); captured on {'; '.join(machines)}, {doc['threads']} threads; "
             f"this command's wall time {doc['wall_seconds'] / 60:.1f} min.", "",
             "| Task | k | many-shot k | train N | dev | test |", "|---|---|---|---|---|---|"]
    lines += [f"| {t} | {sizes[t]['k']} × {sizes[t]['demo_sets']} sets | {sizes[t]['many_k']} | "
              f"{sizes[t]['train']} | {sizes[t]['dev']} | {sizes[t]['test']} |" for t in tasks]
    lines += ["", "Every choice (prompt, calibration, gold weight, λ, probe L2, LoRA lr and "
              "epochs, the mixture weight) reads the dev split alone; the test split is read "
              "once per row. Accuracy: mean over seeds; differences: paired bootstrap 95 % "
              "intervals over the test queries (per task), stratified by task for the average; "
              "*above*/*below*: the interval excludes 0. Per-query predictions: records.json."]
    titles = {"no_labels": "No labels: label-free fits against the prompt they imitate",
              "labels": "With the N train queries' labels"}
    for name, title in titles.items():
        reg = s[name]
        lines += ["", f"## {title}", "", "**Test accuracy (%)**", "",
                  "| Row | " + " | ".join(tasks) + " | Avg. |", "|---|" + "---|" * (len(tasks) + 1)]
        for row, avg in reg["average"].items():
            lines.append(f"| {row} | " + " | ".join(_pct(reg["accuracy"][t][row]) for t in tasks)
                         + f" | {_pct(avg)} |")
        lines += ["", "**Differences (points) with 95 % intervals**", "",
                  "| Row − reference | Avg. | above / tie / below | "
                  + " | ".join(tasks) + " |", "|---|---|---|" + "---|" * len(tasks)]
        for c in reg["comparisons"]:
            lines.append(f"| {c['row']} − {c['reference']} | {_interval(c['average'])} | "
                         f"{c['above']} / {c['tie']} / {c['below']} | "
                         + " | ".join(_interval(c["per_task"][t]) for t in tasks) + " |")
    for sv in doc.get("serving", []):
        lines += ["", f"## Serving cost: {sv['task']}, seed {sv['seed']}", "",
                  f"vLLM {doc['machine'].get('vllm')}, one engine per way in a fresh process, "
                  f"{sv['queries']} test queries, {sv['dtype']}, max_model_len "
                  f"{sv['max_model_len']}; classify = one label-restricted token per query, "
                  f"generate = {sv['gen_tokens']} free tokens per query; the fastest of "
                  f"{sv['repeats']} passes; ratios to the faster zero-shot run. *agrees*: the "
                  "engine's label equals the transformers row it serves, on the same queries.",
                  "", "| Way | serves the row | prompt tokens | classify req/s | × zero-shot "
                  "| generate tok/s | × zero-shot | served accuracy | agrees |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for way, r in sv["ways"].items():
            lines.append(f"| {way} | {r['served_as']} | {r['prompt_tokens_mean']:.0f} | "
                         f"{r['requests_per_s']:.1f} | {r['classify_ratio']:.2f} | "
                         f"{r['output_tokens_per_s']:.1f} | {r['generate_ratio']:.2f} | "
                         f"{_pct(r['accuracy'])} | {_pct(r['agreement'])} % |")
    lines += ["", "## Costs and choices", "",
              "| Row | train labels | dev labels | fit or training seconds (mean per episode) |",
              "|---|---|---|---|"]
    eps = doc["episodes"]
    rows = list(dict.fromkeys(r for name in titles for r in s[name]["average"]))
    dev_rows = {PROMPT_BEST, FREE_BEST, GOLD_BEST, MIXED, PROBE, LORA}
    n_dev = statistics.fmean(sizes[t]["dev"] for t in tasks)
    for row in rows:
        ch = [e["choices"][row] for e in eps if row in e["choices"]]
        lines.append(f"| {row} | {statistics.fmean(c['labels_used'] for c in ch):.0f} | "
                     f"{n_dev if row in dev_rows else 0:.0f} | "
                     f"{statistics.fmean(c['fit_seconds'] for c in ch):.2f} |")
    def capture(i: int) -> float:
        return statistics.fmean(e["cost"]["prompts"][i]["train_seconds"] for e in eps)

    lines += ["", "Capture (train passes, seconds per episode, mean): zero-shot "
              f"{statistics.fmean(e['cost']['zero_shot_train_seconds'] for e in eps):.1f}; "
              + "; ".join(f"{p['prompt']} ({p['k']} demos, {p['prompt_tokens']} tokens) "
                          f"{capture(i):.1f}" for i, p in enumerate(eps[0]["cost"]["prompts"]))
              + ".", "",
              "**What the dev split chose** (per seed)", "",
              "| Task | seed | " + " | ".join(sorted(dev_rows & set(rows), key=rows.index))
              + " |", "|---|---|" + "---|" * len(dev_rows & set(rows))]
    for e in eps:
        cells = []
        for row in sorted(dev_rows & set(rows), key=rows.index):
            cfg = e["choices"][row]["config"]
            cells.append(", ".join(f"{k}={v}" for k, v in cfg.items()
                                   if k not in ("ltv", "probe", "lam_fitted")))
        lines.append(f"| {e['task']} | {e['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
