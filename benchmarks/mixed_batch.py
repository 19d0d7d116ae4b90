"""Classification on one engine: the tasks' queries in one mixed batch, or one batch per task.

`bench serving` runs zero-shot (and fused) one `generate` per task, but the multi-task modes
(`ltv-shift`, LoRA) one mixed `generate` over every task's queries. This times both shapes on
one engine, the fastest of 5 passes, for the bare model (`zs`) and for the per-request shift
engine (`shift`), with `bench serving`'s queries and vectors (run it first):

    VLLM_CPU_KVCACHE_SPACE=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        python benchmarks/mixed_batch.py zs      # then: ... shift
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

VECTORS = Path("benchmarks/results/serving_multitask/work/vectors")
TASKS = ("sst2", "trec")


def main(mode: str) -> None:
    from vllm import LLM

    from ltv_vllm.bench.workload import build_workload
    from ltv_vllm.models.resolve import resolve_model
    from ltv_vllm.serving.launcher.recipe import task_engine
    from ltv_vllm.serving.offline.llm import classification_params

    wl = build_workload("smollm2-135m", list(TASKS), n_per_task=100, k=30, n=256, lam=5.0,
                        seed=0, vector_dir=VECTORS, with_vectors=True, with_kernel=False)
    model_dir = resolve_model("smollm2-135m")
    common = {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 4096, "seed": 0,
              "logprobs_mode": "processed_logprobs"}
    if mode == "zs":
        llm = LLM(model=str(model_dir), **common)
    else:
        engine = task_engine(model_dir, {t: wl.vectors[t] for t in TASKS}, shift_steps="all")
        os.environ.update(engine.env)
        llm = LLM(**engine.kwargs, **common)

    def params(q):
        p = classification_params(wl.label_ids[q.task])
        if mode != "zs":
            p.extra_args = {"ltv_task": q.task}
        return p

    def run(groups) -> float:
        t = time.perf_counter()
        for g in groups:
            llm.generate([q.zs for q in g], [params(q) for q in g], use_tqdm=False)
        return time.perf_counter() - t

    qs = wl.queries
    run([qs[:16]])  # warm-up
    per_task = [[q for q in qs if q.task == t] for t in TASKS]
    res = {"mixed": min(run([qs]) for _ in range(5)),
           "per_task": min(run(per_task) for _ in range(5))}
    print("RESULT", mode, json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
