"""Cost as the number of distinct tasks in a batch grows: K per-request tasks in flight.

One round is R requests in one `generate` (every one in the same batches: max_num_seqs = R),
request i naming task i mod K (so min(K, R) distinct tasks), every generated step shifted
(`ltv_steps: all`): classify (one greedy token) and generate (16 greedy tokens, EOS
ignored). The same prompts run on a stock engine (zero-shot, the baseline) and on one
per-request multi-task engine holding K_max vectors (`serve.task_engine`); on that engine
also with no task named (the wrapper's own cost). Each engine in a fresh process (vLLM keeps
global state), the fastest of --rounds rounds per cell, the cells interleaved round by
round. Vectors are random, at the rank and shape of a real fit (rank N = 256 on SmolLM2's
576-wide hidden state); their values do not change the cost. Reported: requests per second
and the ratio to zero-shot.

    python benchmarks/k_tasks.py --runner v1 --out benchmarks/results/k_tasks_smollm2-135m

`--runner v2` asks vLLM for its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1): on a CPU build
it needs a Triton that runs there; this repository's test shim (tests/v2shim, Triton's
interpreter) starts it, so V2 timings on a CPU are the interpreter's, not V2's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

KS = (1, 8, 64, 256)
WORDS = ("movie plot actor scene story film music ending cast script role drama comedy "
         "director screen dialogue pace camera theme moment").split()


def prompts(r: int) -> list[str]:
    import random

    rng = random.Random(0)
    return [f"Review: the {' '.join(rng.choice(WORDS) for _ in range(24))} {i}\nSentiment:"
            for i in range(r)]


def make_vectors(model_dir: Path, k: int, rank: int, out: Path,
                 labels: tuple[int, ...] = (5, 6), task: dict | None = None,
                 meta: dict | None = None) -> dict[str, str]:
    """K random vectors t0..t{K-1} at `rank` (every step shifted; their values do not change
    the cost); `task`, `meta`: more of each file's task spec and meta."""
    import torch

    from ltv_vllm.core.vector import TaskVector
    from ltv_vllm.models.loading import load_model

    loaded = load_model(str(model_dir), dtype="float32")
    ident, d = loaded.identity, int(loaded.model.config.hidden_size)
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for t in range(k):
        g = torch.Generator().manual_seed(t)
        U = 0.02 * torch.randn(d, rank, generator=g)
        V = torch.linalg.qr(torch.randn(d, rank, generator=g))[0]
        tv = TaskVector("hidden", U, V, None, ident, labels,
                        {"task": {**(task or {}), "name": f"t{t}"}, "shift_steps": "all",
                         **(meta or {})})
        paths[f"t{t}"] = str(tv.save(out / f"t{t}.safetensors"))
    return paths


def worker(a: argparse.Namespace) -> None:
    """One engine in this process; prints RESULT {cell: seconds (fastest round)}."""
    from vllm import LLM, SamplingParams

    from ltv_vllm.models.resolve import resolve_model
    from ltv_vllm.serving.launcher.recipe import task_engine

    model_dir = resolve_model(a.model)
    common = {"dtype": a.dtype, "enforce_eager": True, "max_model_len": 512, "seed": 0,
              "max_num_seqs": a.requests, "max_num_batched_tokens": 64 * a.requests,
              "kv_cache_memory_bytes": 1 << 30}
    if a.engine == "zs":
        llm = LLM(model=str(model_dir), **common)
        ks: tuple[int | None, ...] = (None,)
    else:
        vectors = json.loads(Path(a.vectors).read_text())
        engine = task_engine(model_dir, vectors, shift_steps="all")
        os.environ.update(engine.env)
        llm = LLM(**engine.kwargs, **common)
        ks = (None, *KS)
    ps = prompts(a.requests)
    shapes = {"classify": 1, "generate": 16}

    def params(k: int | None, i: int, tokens: int):
        extra = {} if k is None else {"ltv_task": f"t{i % k}", "ltv_steps": "all"}
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                              extra_args=extra or None)

    def once(k: int | None, tokens: int) -> float:
        ps_k = [params(k, i, tokens) for i in range(a.requests)]
        t = time.perf_counter()
        outs = llm.generate(ps, ps_k, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return dt

    once(ks[-1], 2)  # warm-up: every vector cast onto the device once
    best: dict[str, float] = {}
    for _ in range(a.rounds):
        for shape, tokens in shapes.items():
            for k in ks:
                cell = f"{shape}/{'none' if k is None else k}"
                best[cell] = min(best.get(cell, float("inf")), once(k, tokens))
    print("RESULT", json.dumps({"runner": llm.llm_engine.vllm_config.use_v2_model_runner,
                                "seconds": best}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runner", choices=["v1", "v2"], default="v1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=256, help="requests per round")
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/k_tasks"))
    ap.add_argument("--engine", choices=["zs", "tasks"], help=argparse.SUPPRESS)
    ap.add_argument("--vectors", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        return worker(a)

    from ltv_vllm.bench.workload import machine
    from ltv_vllm.models.resolve import resolve_model

    a.out.mkdir(parents=True, exist_ok=True)
    scratch = a.out / "work"
    vectors = scratch / "vectors.json"
    if not vectors.exists():
        vectors.write_text(json.dumps(make_vectors(resolve_model(a.model), max(KS), a.rank,
                                                   scratch / "vectors")))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_USE_V2_MODEL_RUNNER": "1" if a.runner == "v2" else "0"}
    seconds: dict[str, float] = {}
    for engine in ("zs", "tasks"):
        cmd = [sys.executable, __file__, "--engine", engine, "--vectors", str(vectors),
               "--model", a.model, "--dtype", a.dtype, "--requests", str(a.requests),
               "--rounds", str(a.rounds)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r.returncode or line is None:
            sys.exit(f"k_tasks: the {engine} engine failed:\n{r.stderr[-3000:]}")
        got = json.loads(line[len("RESULT "):])
        if got["runner"] != (a.runner == "v2"):
            sys.exit(f"k_tasks: asked for {a.runner}, vLLM ran the other runner")
        for cell, s in got["seconds"].items():
            seconds[cell if engine == "tasks" else cell.replace("/none", "/zs")] = s
    rows = []
    for shape, tokens in (("classify", 1), ("generate", 16)):
        zs = seconds[f"{shape}/zs"]
        for k in ("zs", "none", *map(str, KS)):
            s = seconds[f"{shape}/{k}"]
            distinct = {"zs": 0, "none": 0}.get(k, min(int(k) if k.isdigit() else 0,
                                                         a.requests))
            rows.append({"shape": shape, "K": k, "distinct_tasks": distinct,
                         "seconds": round(s, 4),
                         "requests_per_s": round(a.requests / s, 2),
                         "ratio_to_zero_shot": round(zs / s, 3), "tokens": tokens})
    res = {"command": " ".join(["python", "benchmarks/k_tasks.py", *sys.argv[1:]]),
           "machine": machine(), "runner": a.runner, "dtype": a.dtype,
           "requests": a.requests, "rank": a.rank, "rounds": a.rounds, "rows": rows}
    (a.out / f"results_{a.runner}.json").write_text(json.dumps(res, indent=1) + "\n")
    for row in rows:
        print(f"{a.runner} {row['shape']:9s} K={row['K']:>4s} ({row['distinct_tasks']:3d} "
              f"distinct) {row['requests_per_s']:8.2f} req/s  "
              f"{row['ratio_to_zero_shot']:.3f}× zero-shot")


if __name__ == "__main__":
    main()
