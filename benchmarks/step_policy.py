"""Which generated tokens a classification vector should shift: every step or the first only.

A served task vector shifts every token vLLM generates (the wrapper's `compute_logits` sees
no request and no step). For a classification vector the label is one token, and what
follows it is free generation under the same shift. This measures, per task, greedy answers
of `--max-new-tokens` tokens from the same episode and LTV:

  zero-shot, ICL (demos + query), LTV at every step, LTV at the first step only

and reports, over the test queries: the label accuracy of the answer's first word (the same
for both LTV policies by construction), how often the answer's first line is exactly a label
(a clean answer, as ICL gives), how often a label word comes back later in the answer (the
degeneration every-step shifting causes), and how often the first line equals ICL's.
The regression families need the shift at every step; `evaluate --tasks linear,relu` reports
`ltv` against `ltv-first` there.

With `--server`, the same vectors are then served by `ltv-vllm serve` (one multi-task server,
per-request tasks, the same dtype) and every test query is sent under the request step
policies `first`, `all`, `2` and `0` (`vllm_xargs.ltv_steps`, one request each, all in
flight together); each answer is compared with transformers' greedy answer under the same
policy (shift at exactly those steps), and the server's own answers are scored as above.

    python benchmarks/step_policy.py --model smollm2-135m --tasks trec,sst2 --server \
        --out benchmarks/results/step_policy_smollm2-135m
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from pathlib import Path

from ltv_vllm.extraction.capture import Capturer
from ltv_vllm.extraction.generate import greedy
from ltv_vllm.methods import Context, MethodOptions, get_method
from ltv_vllm.models.hardware import hardware, machine_line
from ltv_vllm.models.loading import load_model
from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
from ltv_vllm.tasks.specs import get_task, label_token_ids

POLICIES = ("zero-shot", "icl", "ltv every step", "ltv first step")
# a request's ltv_steps → the transformers answers it must reproduce
SERVER_POLICIES = {"first": "ltv first step", "all": "ltv every step", 2: "ltv first 2 steps",
                   0: "zero-shot"}


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def scores(texts: list[str], gold: list[str], labels: tuple[str, ...], icl: list[str]) -> dict:
    first = [(_words(t) or [""])[0] for t in texts]
    line = [t.strip().split("\n")[0].strip() for t in texts]
    icl_line = [t.strip().split("\n")[0].strip() for t in icl]
    again = [sum(w in labels for w in _words(t)) >= 2 for t in texts]
    n = len(texts)
    return {"label_accuracy": sum(f == g for f, g in zip(first, gold, strict=True)) / n,
            "clean_answer": sum(x in labels for x in line) / n,
            "label_repeated": sum(again) / n,
            "first_line_as_icl": sum(a == b for a, b in zip(line, icl_line, strict=True)) / n,
            "examples": texts[:4]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="trec,sst2")
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/step_policy"))
    ap.add_argument("--server", action="store_true",
                    help="also through `ltv-vllm serve`, policies first/all/2/0 per request")
    a = ap.parse_args()
    lm = load_model(a.model, dtype=a.dtype)
    cap = Capturer(lm.model, lm.tokenizer, progress=True)
    ltv = get_method("ltv")
    res: dict = {"model": a.model, "dtype": str(lm.model.dtype), "n_test": a.n_test,
                 "max_new_tokens": a.max_new_tokens, "machine": hardware(), "tasks": {}}
    served: dict = {}
    for name in a.tasks.split(","):
        task = get_task(name)
        ep = plan_episode(task, ExtractOptions(n_test=a.n_test, seed=a.seed, n_val=0))
        ctx = Context(cap, ep, label_token_ids(task, lm.tokenizer), MethodOptions(),
                      identity=lm.identity)
        art = ltv.extract(ctx)
        queries = [task.query(e.text) for e in ep.test]
        gold = [task.labels[e.label] for e in ep.test]
        shift = functools.partial(ltv.shift, art)
        gen = {"max_new_tokens": a.max_new_tokens}
        texts = {
            "zero-shot": greedy(cap, queries, desc=f"{name} zero-shot", **gen),
            "icl": greedy(cap, queries, prefix=ep.demo_prefix(), desc=f"{name} icl", **gen),
            "ltv every step": greedy(cap, queries, mapping=shift, desc=f"{name} ltv", **gen),
            "ltv first step": greedy(cap, queries, mapping=shift, steps="first",
                                     desc=f"{name} ltv-first", **gen)}
        res["tasks"][name] = {p: scores(texts[p], gold, task.labels, texts["icl"])
                              for p in POLICIES}
        if a.server:
            texts["ltv first 2 steps"] = greedy(cap, queries, mapping=shift, steps=2,
                                                desc=f"{name} ltv-first-2", **gen)
            a.out.mkdir(parents=True, exist_ok=True)
            served[name] = (art.save(a.out / f"{name}.safetensors"), queries, gold, task, texts)
    if a.server:
        res["server"] = through_server(a, served, str(lm.model.dtype).removeprefix("torch."))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1, ensure_ascii=False))
    cmd = (f"python benchmarks/step_policy.py --model {a.model} --tasks {a.tasks} "
           f"--n-test {a.n_test} --max-new-tokens {a.max_new_tokens}"
           f"{' --server' if a.server else ''} --out {a.out}")
    md = ["# Every step or first step: a classification vector in free generation\n",
          f"```\n{cmd}\n```\n", f"{machine_line(res['machine'])}; {res['dtype']}; greedy, "
          f"{a.max_new_tokens} new tokens, {a.n_test} test queries per task, k = 30 demos.\n",
          "| task | policy | label accuracy (first word) | clean answer (first line is a "
          "label) | a label word repeated | first line as ICL's |", "|---|---|---|---|---|---|"]
    for name, per in res["tasks"].items():
        for p in POLICIES:
            s = per[p]
            md.append(f"| {name} | {p} | {s['label_accuracy']:.2f} | {s['clean_answer']:.2f} | "
                      f"{s['label_repeated']:.2f} | {s['first_line_as_icl']:.2f} |")
    md.append("\nFirst answers per policy (repr):\n")
    for name, per in res["tasks"].items():
        for p in POLICIES:
            md.append(f"- {name}, {p}: " + ", ".join(repr(t) for t in per[p]["examples"][:3]))
    if a.server:
        srv = res["server"]
        md += ["", "## Through the server", "",
               (f"`ltv-vllm serve` with the tasks' vectors (multi-task, per-request tasks, "
                f"{srv['dtype']}), every query under each request policy (`vllm_xargs."
                "ltv_steps`), all in flight together; the answer against transformers' greedy "
                "answer with the shift at exactly the same steps. Started in "
                f"{srv['startup_seconds']:.0f} s."), "",
               "| task | ltv_steps | same answer as transformers | clean answer | label "
               "accuracy (first word) | a label word repeated |", "|---|---|---|---|---|---|"]
        for name, per in srv["tasks"].items():
            for pol, sc in per.items():
                md.append(f"| {name} | {pol} | {sc['same_as_transformers']:.2f} | "
                          f"{sc['clean_answer']:.2f} | {sc['label_accuracy']:.2f} | "
                          f"{sc['label_repeated']:.2f} |")
        md.append("\nServer answers, first query per policy (repr):\n")
        for name, per in srv["tasks"].items():
            for pol, sc in per.items():
                md.append(f"- {name}, {pol}: {sc['examples'][0]!r}")
    (a.out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def through_server(a, served: dict, dtype: str) -> dict:
    """Start one multi-task server with every task's vector; each query under each request
    policy; scores and agreement with transformers' answers under the same policy."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from ltv_vllm.bench.online import Server
    from ltv_vllm.serving.client import generate
    from ltv_vllm.serving.launcher.serve import ServeOptions, plan_server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # the command `ltv-vllm serve` would run (nothing to write: per-request tasks)
    plan = plan_server(ServeOptions(a.model, tuple(f"{name}={path}" for name, (path, *_r)
                                                   in served.items()), port=port, dtype=dtype))
    jobs = [(name, pol, i) for name, (_p, queries, *_r) in served.items()
            for pol in SERVER_POLICIES for i in range(len(queries))]
    with Server(plan.argv[3:], url=f"http://127.0.0.1:{port}",
                env={**plan.env, "TOKENIZERS_PARALLELISM": "false"},
                log_path=a.out / "server.log") as srv:
        startup = srv.startup_s

        def one(job):
            name, pol, i = job
            return generate(srv.url, served[name][1][i], model=name, steps=pol,
                            max_tokens=a.max_new_tokens).text

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, jobs))
    got: dict = {}
    for (name, pol, _i), text in zip(jobs, answers, strict=True):
        got.setdefault(name, {}).setdefault(pol, []).append(text)
    out = {"dtype": dtype, "startup_seconds": startup, "tasks": {}}
    for name, (_p, _q, gold, task, texts) in served.items():
        out["tasks"][name] = {}
        for pol, ref_name in SERVER_POLICIES.items():
            mine, ref = got[name][pol], texts[ref_name]
            sc = scores(mine, gold, task.labels, texts["icl"])
            same = sum(x == y for x, y in zip(mine, ref, strict=True))
            sc["same_as_transformers"] = same / len(ref)
            out["tasks"][name][str(pol)] = sc
    return out


if __name__ == "__main__":
    main()
