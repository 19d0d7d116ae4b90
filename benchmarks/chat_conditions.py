"""Chat-fitted vectors served under conversations they were not fitted on: other system
prompts and earlier turns.

A vector fitted with `extract --format chat` imitates ICL at the assistant's first token
after the template's rendering of its system turn (the template's default, or the task
spec's `system`), the demonstrations as turns, and the query. A served chat request may bring
its own system prompt or earlier turns. Per task: one chat-fitted vector (demonstrations as
turns, the template's default system turn), then zero-shot and that vector scored on the
same test queries rendered under each condition below (ICL too, where it was fitted):

  fitted            the template's default system turn: what the vector was fitted under
  system: short     "You are a helpful assistant."
  system: labeler   "You label texts. Answer with one word."
  system: long      a four-sentence persona
  history           one earlier exchange before the query
  system + history  both

Accuracy is the argmax over the label tokens at the assistant's first token (what a served
label-restricted request answers; served = transformers is tested elsewhere).

    python benchmarks/chat_conditions.py --model qwen2.5-coder-1.5b --tasks trec,hate_speech18 \\
        --out benchmarks/results/chat_conditions_qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SYSTEMS = {
    "system: short": "You are a helpful assistant.",
    "system: labeler": "You label texts. Answer with one word.",
    "system: long": ("You are a careful, friendly assistant working for a research lab. You "
                     "read every message closely before you answer. You keep answers short "
                     "unless asked for detail. You never make up facts."),
}
HISTORY = [{"role": "user", "content": "Hello! Can you help me with a few questions?"},
           {"role": "assistant", "content": "Of course, go ahead."}]
CONDITIONS = ("fitted", *SYSTEMS, "history", "system + history")


def conversation(condition: str, content: str) -> list[dict[str, str]]:
    system = ([{"role": "system", "content": SYSTEMS[condition]}] if condition in SYSTEMS
              else [{"role": "system", "content": SYSTEMS["system: short"]}]
              if condition == "system + history" else [])
    history = HISTORY if "history" in condition else []
    return [*system, *history, {"role": "user", "content": content}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="trec,hate_speech18")
    ap.add_argument("--k", type=int, default=30)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--lam", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/chat_conditions"))
    a = ap.parse_args()

    import torch

    from ltv_vllm.extraction.capture import Capturer, label_head
    from ltv_vllm.models.hardware import hardware, machine_line
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, episode_labels, extract, plan_episode
    from ltv_vllm.tasks.chat import chat_task, render
    from ltv_vllm.tasks.specs import Task, get_tasks, label_token_ids

    torch.manual_seed(0)
    t_start = time.perf_counter()
    lm = load_model(a.model, dtype=a.dtype)
    records = []
    for task in get_tasks(a.tasks):
        ct = chat_task(task, lm.tokenizer, "turns")
        opts = ExtractOptions(k=a.k, n=a.n, lam=a.lam, seed=a.seed, n_test=a.n_test,
                              progress=False)
        ep = plan_episode(ct, opts)
        t0 = time.perf_counter()
        r = extract(lm, ct, "ltv", opts, episode=ep)
        fit_seconds = time.perf_counter() - t0
        tv, fitted = r.artifact, r.metrics
        ids = label_token_ids(ct, lm.tokenizer)
        w, b = label_head(lm.model, ids)
        labels = episode_labels(ep)
        cap = Capturer(lm.model, lm.tokenizer, batch_size="auto", progress=False,
                       special_tokens=ct.special_tokens)
        for condition in CONDITIONS:
            texts = [e.text for e in ep.test]
            if condition == "fitted":
                prompts = [ct.zero_shot(t) for t in texts]
            else:
                prompts = [render(lm.tokenizer, conversation(condition, ct.lead
                                                             + Task.query(ct, t)), ct.template)
                           for t in texts]
            h = cap.hidden(prompts).to(w.dtype)
            acc = {name: float(((x @ w.T + b).argmax(-1) == labels).float().mean())
                   for name, x in (("zero-shot", h), ("ltv", tv.shift_hidden(h)))}
            if condition == "fitted":  # the pipeline's own scores beside (its zero-shot
                # states run the head once: equal up to the dtype's rounding)
                acc.update(icl=fitted["icl"]["accuracy"],
                           pipeline_ltv=fitted["ltv"]["accuracy"],
                           pipeline_zero_shot=fitted["zero-shot"]["accuracy"])
            records.append({"task": task.name, "condition": condition, **acc,
                            "prompt_tokens": len(cap.encode(prompts[0]))})
            print(task.name, condition, {k: round(v, 3) for k, v in acc.items()}, flush=True)
        records[-len(CONDITIONS)]["fit_seconds"] = round(fit_seconds, 1)
    doc = {"command": "python benchmarks/chat_conditions.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
           "machine": hardware(), "dtype": str(lm.model.dtype).removeprefix("torch."),
           "wall_seconds": round(time.perf_counter() - t_start, 1), "records": records}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (a.out / "results.md").write_text(report(doc, machine_line(doc["machine"])))


def report(doc: dict, machine: str) -> str:
    lines = ["# Chat-fitted vectors under other system prompts and earlier turns", "",
             f"`{doc['command']}`", "", f"{machine}, {doc['dtype']}; "
             f"{doc['wall_seconds']:.0f} s", "",
             "Accuracy on the test subset, label-restricted argmax at the assistant's first "
             "token; one vector per task, fitted under the template's default system turn "
             "(demonstrations as turns). *gain*: LTV − zero-shot under the same condition.", "",
             "| task | condition | zero-shot | LTV | gain | ICL (fitted) |",
             "|---|---|---|---|---|---|"]
    for r in doc["records"]:
        icl = f"{100 * r['icl']:.1f}" if "icl" in r else ""
        lines.append(f"| {r['task']} | {r['condition']} | {100 * r['zero-shot']:.1f} | "
                     f"{100 * r['ltv']:.1f} | {100 * (r['ltv'] - r['zero-shot']):+.1f} | "
                     f"{icl} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
