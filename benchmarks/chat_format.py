"""Chat-native task vectors, measured: a vector fitted through the model's chat template and
scored through it, against one fitted on the completion prompt, side by side on the same
episodes (same demonstrations, queries and test subset per task and run).

Per task and run, three renderings of one episode (`tasks.chat`):

  completion     the task's completion prompt; label = first token of " " + label
  chat, turns    the chat template, demonstrations as prior user/assistant turns; the query
                 as the last user turn; label = the assistant's first token (no space)
  chat, inline   the chat template, every demonstration inside the one user message

each scored zero-shot, with ICL, with LTV fitted on that rendering, and the mean shift; and
the opt-in path of a completion-fitted vector (`ltv_chat: "allow"`): the completion LTV's
shift applied to the chat rendering's zero-shot state, scored over the chat label tokens.
Accuracy is the argmax over the label tokens at the position that predicts the answer (what
`evaluate` reports, and what a served request's label-restricted answer is).

    python benchmarks/chat_format.py --model smollm2-135m --tasks packaged --runs 2 \\
        --n-test 200 --out benchmarks/results/chat_format_smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

RENDERINGS = ("completion", "chat, turns", "chat, inline")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="packaged")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--k", type=int, default=30)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--lam", type=float, default=5.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/chat_format"))
    a = ap.parse_args()

    import torch

    from ltv_vllm.extraction.capture import Capturer, label_head
    from ltv_vllm.methods import MethodOptions, score_methods
    from ltv_vllm.models.hardware import hardware, machine_line
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import (
        ExtractOptions,
        capture_episode,
        episode_labels,
        method_context,
        plan_episode,
    )
    from ltv_vllm.tasks.chat import chat_task
    from ltv_vllm.tasks.specs import get_tasks, label_token_ids

    torch.manual_seed(0)
    # every episode is saved as it finishes; a rerun with the same settings resumes, and
    # one with more tasks or runs adds only the episodes missing (an episode is a task and
    # a run); other settings are refused rather than the measured episodes dropped
    config = {k: str(v) for k, v in vars(a).items()}
    path = a.out / "results.json"
    old = json.loads(path.read_text()) if path.exists() else {}

    def settings(c: dict) -> dict:
        return {k: v for k, v in c.items() if k not in ("tasks", "runs")}

    if old.get("records") and settings(old.get("config", {})) != settings(config):
        theirs = settings(old.get("config", {}))
        diff = {k: (theirs.get(k), v) for k, v in settings(config).items() if theirs.get(k) != v}
        raise SystemExit(f"{path} holds episodes measured with other settings (was, now: "
                         f"{diff}); give another --out, or move it away")
    records: list[dict] = old.get("records", [])
    lm = load_model(a.model, dtype=a.dtype)  # after the checks above: they need no model
    done = {(r["task"], r["run"]) for r in records}
    t_start = time.perf_counter() - (old.get("wall_seconds", 0) if records else 0)
    tasks = get_tasks(a.tasks)
    # run 0 of every task first, then run 1, ...: an interrupted measurement covers tasks
    for run, task in ((r, t) for r in range(a.runs) for t in tasks):
        if (task.name, run) in done:
            continue
        forms = {"completion": task,
                 "chat, turns": chat_task(task, lm.tokenizer, "turns"),
                 "chat, inline": chat_task(task, lm.tokenizer, "inline")}
        opts = ExtractOptions(k=a.k, n=a.n, lam=a.lam, seed=run, n_test=a.n_test,
                              progress=False)
        base = plan_episode(task, opts)
        got: dict[str, dict] = {}
        for form, t in forms.items():
            ep = type(base)(t, base.seed, base.demos, base.queries, base.test,
                            base.test_seed, base.val)
            ids = label_token_ids(t, lm.tokenizer)
            cap = Capturer(lm.model, lm.tokenizer, batch_size="auto", progress=False,
                           special_tokens=t.special_tokens)
            t0 = time.perf_counter()
            c = capture_episode(cap, ep)
            seconds = time.perf_counter() - t0
            ctx = method_context(lm, cap, ep, ids, MethodOptions().replace(
                lam=a.lam, seed=run, batch_size=cap.batch_size, progress=False), c)
            sc = score_methods(ctx, ["ltv", "mean"], c.h_zs_test, c.h_icl_test,
                               episode_labels(ep))
            got[form] = {"scores": sc, "captures": c, "ids": ids,
                         "capture_seconds": seconds}
            rec = {"task": task.name, "run": run, "rendering": form,
                   "capture_seconds": round(seconds, 2),
                   "prompt_tokens": {
                       "zero_shot": len(cap.encode(t.zero_shot(ep.test[0].text))),
                       "icl": len(cap.encode(ep.demo_prefix() + t.query(ep.test[0].text)))},
                   **{m: sc.metrics[m]["accuracy"] for m in ("zero-shot", "icl", "ltv",
                                                               "mean")}}
            records.append(rec)
        # the opt-in path: the completion-fitted vector shifting the chat rendering
        tv = got["completion"]["scores"].artifacts["ltv"]
        for form in ("chat, turns",):
            g = got[form]
            w_c, b_c = label_head(lm.model, g["ids"])
            z = tv.shift_hidden(g["captures"].h_zs_test) @ w_c.T + b_c
            labels = episode_labels(base)
            acc = float((z.argmax(-1) == labels).float().mean())
            records.append({"task": task.name, "run": run,
                            "rendering": "chat, completion-fitted LTV (opt-in)",
                            "ltv": acc})
        print(task.name, run, {r["rendering"]: {k: round(v, 3) for k, v in r.items()
                                                if k in ("zero-shot", "icl", "ltv")}
                               for r in records if r["task"] == task.name
                               and r["run"] == run}, flush=True)
        doc = {"command": "python benchmarks/chat_format.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
               "machine": hardware(), "dtype": str(lm.model.dtype).removeprefix("torch."),
               "config": config, "wall_seconds": round(time.perf_counter() - t_start, 1),
               "episodes": sorted({(r["task"], r["run"]) for r in records}),
               "records": records, "summary": summarise(records)}
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
        (a.out / "README.md").write_text(report(doc, machine_line(doc["machine"])))


def summarise(records: list[dict]) -> dict:
    """Per task and rendering: the mean over runs of each method's accuracy, and the share of
    chat-ICL's gain over chat zero-shot that LTV recovers."""
    out: dict[str, dict] = {}
    for r in records:
        out.setdefault(r["task"], {}).setdefault(r["rendering"], []).append(r)
    summary: dict[str, dict] = {}
    for task, by in out.items():
        summary[task] = {}
        for form, rs in by.items():
            summary[task][form] = {m: statistics.mean(x[m] for x in rs)
                                   for m in ("zero-shot", "icl", "ltv", "mean") if m in rs[0]}
            s = summary[task][form]
            if "icl" in s and s["icl"] > s["zero-shot"]:
                s["recovered"] = (s["ltv"] - s["zero-shot"]) / (s["icl"] - s["zero-shot"])
    return summary


def report(doc: dict, machine: str) -> str:
    runs: dict[str, list[int]] = {}
    for t, r in doc["episodes"]:
        runs.setdefault(t, []).append(r)
    lines = ["# Chat-native task vectors", "", f"`{doc['command']}`", "",
             f"{machine}, {doc['dtype']}; {doc['wall_seconds']:.0f} s", "",
             "Episodes measured (task: runs): " + ", ".join(
                 f"{t}: {', '.join(map(str, rs))}" for t, rs in runs.items()) + ".", "",
             "Accuracy (mean over runs) on the test subset, label-restricted argmax at the "
             "answer's position. *recovered*: (LTV − zero-shot) / (ICL − zero-shot), where ICL "
             "beats zero-shot.", "",
             "| task | rendering | zero-shot | ICL | LTV | mean | recovered |",
             "|---|---|---|---|---|---|---|"]
    for task, by in doc["summary"].items():
        for form, s in by.items():
            cell = [f"{100 * s[m]:.1f}" if m in s else "" for m in ("zero-shot", "icl", "ltv",
                                                                      "mean")]
            rec = f"{100 * s['recovered']:.0f} %" if "recovered" in s else ""
            lines.append(f"| {task} | {form} | " + " | ".join(cell) + f" | {rec} |")
    lines += ["", *cost_table(doc["records"])]
    return "\n".join(lines) + "\n"


def cost_table(records: list[dict]) -> list[str]:
    """What each rendering costs against the completion prompt: its prompt tokens (the first
    test query's, zero-shot and with the demonstrations) and the whole capture pass (train
    and test, zero-shot and ICL, the shared-demo cache on), as ratios per episode averaged."""
    base = {(r["task"], r["run"]): r for r in records if r["rendering"] == "completion"}
    by: dict[str, list[tuple[float, float, float, float, float]]] = {}
    for r in records:
        b = base.get((r["task"], r["run"]))
        if "capture_seconds" not in r or b is None:
            continue
        by.setdefault(r["rendering"], []).append((
            r["prompt_tokens"]["zero_shot"], r["prompt_tokens"]["icl"], r["capture_seconds"],
            r["prompt_tokens"]["icl"] / b["prompt_tokens"]["icl"],
            r["capture_seconds"] / b["capture_seconds"]))
    out = ["Cost, mean over the episodes: prompt tokens of a test query (zero-shot; with the "
           "demonstrations), and the seconds of the episode's whole capture (train and test "
           "queries, zero-shot and ICL, the demonstrations' KV cached once; wall time on the "
           "machine above, which other work shared: rough); × completion: per-episode ratio.",
           "", "| rendering | zero-shot tokens | ICL tokens | ICL tokens × completion | "
           "capture s | capture × completion |", "|---|---|---|---|---|---|"]
    for form, xs in by.items():
        m = [statistics.mean(x[i] for x in xs) for i in range(5)]
        out.append(f"| {form} | {m[0]:.0f} | {m[1]:.0f} | {m[3]:.2f} | {m[2]:.0f} | "
                   f"{m[4]:.2f} |")
    return out


if __name__ == "__main__":
    main()
