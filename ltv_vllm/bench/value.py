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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.bench.value_rivals import (
    ModelHandle,
    adapter_dir,
    default_vector,
    layer_fit,
    layer_record,
    lora_fit,
    lora_record,
)
from ltv_vllm.bench.value_rows import (
    DEFAULT,
    DEFAULT_LAM,
    FREE_BASES,
    FREE_BEST,
    FREE_BEST_TEACHER,
    GOLD_BEST,
    GOLD_CALIBRATIONS,
    GOLD_WEIGHTS,
    LAMS,
    LAYER,
    LORA,
    MIX,
    MIXED,
    PROBE,
    PROMPT_BEST,
    PROMPT_K,
    PROMPT_MANY,
    ZERO_SHOT,
    Fit,
    Head,
    Split,
    digest,
    free_row,
    regimes,
    teacher_row,
)
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

# ---------------------------------------------------------------------------------------
# Splits and fits (pure: states in, label logits out)

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


def summarise(records: dict[str, Any], tasks: Sequence[str], lora: bool,
              layer: bool = False) -> dict[str, Any]:
    """Every table: per task and row the test accuracy (mean over seeds), the mean dev
    accuracy, and every comparison of the regime with its intervals."""
    out: dict[str, Any] = {}
    for name, reg in regimes(lora, layer).items():
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
    layer_rows: bool = False  # the third table: LTV at a decoder block (`layer_record`)

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


def run_episode(st: dict[str, torch.Tensor], sets: int, lora: Fit | None = None,
                layer: Fit | None = None) -> dict[str, Any]:
    """One episode's record: the choices (from train and dev), then the test predictions.
    `lora`, `layer`: the rivals computed apart (`value_rivals`), already chosen on dev."""
    train, dev, test = splits_of(st)
    head = Head(st["w_c"], st["b_c"])
    fits = choose(train, dev, st["h_icl_cf"], head, sets=sets, lora=lora)
    if layer is not None:
        fits[LAYER] = layer
    return {"choices": {n: {"config": f.config, "dev_accuracy": f.dev_accuracy,
                            "labels_used": f.labels_used, "fit_seconds": f.seconds}
                        for n, f in fits.items()},
            "test_predictions": score_test(fits, test)}


def bench_value(tasks: Sequence[Any], opts: ValueOptions, out_dir: Path, command: str,
                log: Callable[[str], None] = print,
                merged: Sequence[tuple[dict[str, Any], dict[str, Any]]] = ()
                ) -> dict[str, Any]:
    """Capture what is missing under out_dir/states, run every episode, write results.json,
    records.json (per-query predictions) and results.md. `merged`: earlier runs of other
    tasks (`merge_docs`) whose episodes join the tables."""
    from safetensors.torch import load_file, save_file

    from ltv_vllm.bench import report
    from ltv_vllm.bench.value_report import options_record, value_markdown
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
    model = ModelHandle(opts)
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
                   "dev": digest(ep.val), "many": digest(many)}
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
            layer = None
            if opts.layer_rows:
                layer = layer_fit(layer_record(model, task, ep, label_ids, states_dir
                                               / f"{task.name}_seed{seed}.layer.json"))
            out = run_episode(st, opts.demo_sets, lora, layer)
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
                   / len(ep.test) for r in (PROMPT_K, DEFAULT, PROBE, FREE_BEST,
                                            *([LAYER] if layer else []))}
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
           "summary": summarise(records, names, opts.lora, opts.layer_rows),
           "serving": serving}
    atomic_write(out_dir / "records.json",
                 lambda p: Path(p).write_text(json.dumps(records, separators=(",", ":"))))
    report.write(doc, out_dir, value_markdown(doc))
    return doc


# the transformers row each served way answers as
SERVED_AS = {"zero-shot": ZERO_SHOT, "prompt, one k-shot (prefix cache)": PROMPT_K,
             "prompt, many-shot (prefix cache)": PROMPT_MANY,
             "default vector (fused, first token)": DEFAULT, "LoRA adapter (vLLM LoRA)": LORA}


def _serve_task(model: ModelHandle, task: Any, opts: ValueOptions, states_dir: Path, tok: Any,
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
