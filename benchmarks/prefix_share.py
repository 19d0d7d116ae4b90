"""Do requests for different tasks share the KV of a common prefix? Per-request tasks
against LoRA adapters, measured by vLLM's own prefix-cache counters.

Every request is one shared prefix (a long system-style preamble: the same demonstrations of
one task, as a deployment would put in front of every request) followed by its own query,
and names one of the tasks in turn. With per-request tasks (`serve.task_engine`) the shift
happens at the LM head only and vLLM's cache key holds no `extra_args`, so every request
after the first finds the prefix cached whatever its task; LoRA adapters are part of the key
(`kv_cache_utils`), so each task keeps its own copy. Reported: prefix-cache hits / queried
tokens over all requests, one engine per mode, the same prompts.

    python benchmarks/prefix_share.py --model smollm2-135m --tasks sst2,trec \\
        --vectors benchmarks/results/serving_multitask/work/vectors \\
        --out benchmarks/results/prefix_share_smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="sst2,trec")
    ap.add_argument("--vectors", type=Path, required=True)
    ap.add_argument("--mode", choices=["shift", "lora"], help="one mode (in this process)")
    ap.add_argument("--n", type=int, default=64, help="requests")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_share"))
    a = ap.parse_args()
    if a.mode is None:  # each mode in a fresh process (vLLM keeps global state), then report
        import subprocess
        import sys

        res = {}
        for mode in ("shift", "lora"):
            subprocess.run([sys.executable, __file__, "--model", a.model, "--tasks", a.tasks,
                            "--vectors", str(a.vectors), "--mode", mode, "--n", str(a.n),
                            "--out", str(a.out)], check=True)
            res[mode] = json.loads((a.out / f"{mode}.json").read_text())
        report(a, res)
        return
    run_mode(a)


def run_mode(a) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from ltv_vllm.models.hardware import hardware, resolve_for_model
    from ltv_vllm.models.resolve import resolve_model
    from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
    from ltv_vllm.serving.launcher.lora_plan import plan_lora
    from ltv_vllm.serving.launcher.recipe import task_engine
    from ltv_vllm.tasks.specs import get_task

    model_dir = resolve_model(a.model)
    names = a.tasks.split(",")
    vectors = {t: next(a.vectors.glob(f"{t}-k*.safetensors")) for t in names}
    task = get_task(names[0])
    ep = plan_episode(task, ExtractOptions(n_test=a.n, seed=0, n_val=0))
    prefix = ep.demo_prefix()
    prompts = [prefix + task.query(e.text) for e in ep.test][: a.n]
    common = {"dtype": resolve_for_model("auto", model_dir), "enforce_eager": True,
              "max_model_len": 4096, "enable_prefix_caching": True, "seed": 0,
              "disable_log_stats": False}
    params = [SamplingParams(max_tokens=1, temperature=0.0) for _ in prompts]
    loras = None
    if a.mode == "shift":
        engine = task_engine(model_dir, vectors)
        os.environ.update(engine.env)
        llm = LLM(**engine.kwargs, **common)
        for i, p in enumerate(params):
            p.extra_args = {"ltv_task": names[i % len(names)]}
    else:
        plan = plan_lora(model_dir, vectors, lora_dir=a.out / "adapters")
        plan.write()
        llm = LLM(model=str(model_dir), **plan.engine_kwargs(), **common)
        loras = [LoRARequest(t, j + 1, str(plan.adapters[t])) for j, t in enumerate(names)]
        loras = [loras[i % len(names)] for i in range(len(prompts))]

    def counter(name: str) -> float:
        return sum(float(getattr(m, "value", 0) or 0) for m in llm.get_metrics()
                   if m.name == name)

    q0, h0 = counter("vllm:prefix_cache_queries"), counter("vllm:prefix_cache_hits")
    # one request at a time, so each finds what the earlier ones left (a batch would
    # schedule them together and share within the step)
    for i, p in enumerate(prompts):
        llm.generate([p], [params[i]], lora_request=None if loras is None else [loras[i]],
                     use_tqdm=False)
    queries = counter("vllm:prefix_cache_queries") - q0
    hits = counter("vllm:prefix_cache_hits") - h0
    tok = llm.get_tokenizer()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.mode}.json").write_text(json.dumps({
        "queries": queries, "hits": hits, "hit_rate": hits / queries, "requests": len(prompts),
        "prefix_tokens": len(tok(prefix)["input_ids"]), "tasks": names,
        "dtype": common["dtype"], "machine": hardware()}))


def report(a, res: dict) -> None:
    from ltv_vllm.models.hardware import machine_line

    any_ = next(iter(res.values()))
    cmd = (f"python benchmarks/prefix_share.py --model {a.model} --tasks {a.tasks} --vectors "
           f"{a.vectors} --n {a.n} --out {a.out}")
    md = ["# Prefix-cache sharing across tasks\n", f"```\n{cmd}\n```\n",
          f"{machine_line(any_['machine'])}; {any_['dtype']}; {any_['requests']} requests, one "
          f"at a time, each a shared {any_['prefix_tokens']}-token prefix (the "
          f"{any_['tasks'][0]} demonstrations) and its own query, tasks "
          f"{', '.join(any_['tasks'])} in turn.\n",
          "| mode | prefix-cache hits / queried tokens |", "|---|---|"]
    for mode, r in res.items():
        md.append(f"| {mode} | {100 * r['hit_rate']:.1f}% ({int(r['hits'])} / "
                  f"{int(r['queries'])}) |")
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    (a.out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
