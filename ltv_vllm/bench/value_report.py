"""The value protocol's documents (`ltv-vllm bench value`): what results.json records of the
options, earlier runs read back to merge (`merge_docs`), and the summary written as results.md
(the tables, their intervals, the serving costs and what dev chose). Runs in the bench's
process; no model."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ltv_vllm.bench.value_rows import (
    FREE_BEST,
    GOLD_BEST,
    LAYER,
    LORA,
    MIXED,
    PROBE,
    PROMPT_BEST,
)
from ltv_vllm.errors import ArgumentError


def options_record(opts: Any) -> dict[str, Any]:
    """What results.json records of the options (and what merged runs must share)."""
    return {**opts.state_key(), "seeds": list(opts.seeds), "batch_size": opts.batch_size,
            "lora": opts.lora, "lora_options": _lora_record(opts),
            **({"layer_rows": True} if opts.layer_rows else {})}  # absent: older runs merge


def merge_docs(paths: Sequence[Path], opts: Any,
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


def _lora_record(opts: Any) -> dict[str, Any] | None:
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
              "labels": "With the N train queries' labels",
              "layer": "At a decoder block: LTV fitted to the k-shot prompt's block-ℓ states"}
    titles = {name: title for name, title in titles.items() if name in s}
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
    dev_rows = {PROMPT_BEST, FREE_BEST, GOLD_BEST, MIXED, PROBE, LORA, LAYER}
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
