"""Cost of layer tasks as the number of distinct ones in a batch grows: K per-request layer
tasks in flight, against zero-shot.

One round is R requests in one `generate` (every one in the same batches: max_num_seqs = R),
request i naming task i mod K: classify (one greedy token) and generate (16 greedy tokens,
EOS ignored). Two kinds of layer task, each at a real shape:
  map      LTV at one block (block 15 of SmolLM2's 30), rank 256 (a fit on N = 256), at
           every token-producing row (`ltv_steps: generated`);
  control  a control vector: an additive direction at blocks 1..29 (repeng's default span),
           at every position, prompt included (`ltv_steps: all`, as llama.cpp applies it).
The same prompts run on a stock engine (zero-shot, the baseline) and on one engine holding
K_max tasks of each kind (`recipe.task_engine`); on that engine also with no task named (the
hooks' own cost). Each engine in a fresh process, the fastest of --rounds rounds per cell,
cells interleaved round by round. Random tasks: their values do not change the cost.
Reported: requests per second and the ratio to zero-shot.

    python benchmarks/layer_tasks.py --out benchmarks/results/layer_tasks_smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from k_tasks import prompts  # noqa: E402

KS = (1, 16, 256)
KINDS = {"map": "generated", "control": "all"}


def make_tasks(model_dir: Path, k: int, rank: int, out: Path) -> dict[str, str]:
    """K random layer tasks of each kind (`KINDS`), files under `out`."""
    import torch

    from ltv_vllm.core.layer_task import LayerPolicy, LayerTask
    from ltv_vllm.models.checkpoint import identity_from_dir

    ident = identity_from_dir(model_dir)
    d, depth = ident.hidden_size, int(ident.num_layers or 0)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for t in range(k):
        g = torch.Generator().manual_seed(t)
        mid = depth // 2
        m = LayerTask((mid,), None, 0.01 * torch.randn(1, d, rank, generator=g),
                      torch.linalg.qr(torch.randn(d, rank, generator=g))[0][None], ident,
                      LayerPolicy.parse(KINDS["map"]), provenance={"task": {"name": f"m{t}"}})
        c = LayerTask(tuple(range(1, depth)), 0.05 * torch.randn(depth - 1, d, generator=g),
                      None, None, ident, LayerPolicy.parse(KINDS["control"]),
                      provenance={"task": {"name": f"c{t}"}})
        paths[f"m{t}"] = str(m.save(out / f"m{t}.safetensors"))
        paths[f"c{t}"] = str(c.save(out / f"c{t}.safetensors"))
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
    cells: list[tuple[str, int | None]] = [("zs", None)]
    if a.engine == "zs":
        llm = LLM(model=str(model_dir), **common)
    else:
        engine = task_engine(model_dir, json.loads(Path(a.vectors).read_text()))
        os.environ.update(engine.env)
        llm = LLM(**engine.kwargs, **common)
        cells = [("none", None), *((kind, k) for kind in KINDS for k in KS)]
    ps = prompts(a.requests)

    def params(kind: str, k: int | None, i: int, tokens: int):
        extra = None if k is None else {"ltv_task": f"{kind[0]}{i % k}",
                                        "ltv_steps": KINDS[kind]}
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                              extra_args=extra)

    def once(kind: str, k: int | None, tokens: int) -> float:
        ps_k = [params(kind, k, i, tokens) for i in range(a.requests)]
        t = time.perf_counter()
        outs = llm.generate(ps, ps_k, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return dt

    for kind, k in cells:  # warm-up: every task cast onto the device once
        once(kind, k, 2)
    best: dict[str, float] = {}
    for _ in range(a.rounds):
        for shape, tokens in (("classify", 1), ("generate", 16)):
            for kind, k in cells:
                cell = f"{shape}/{kind}/{'-' if k is None else k}"
                best[cell] = min(best.get(cell, float("inf")), once(kind, k, tokens))
    print("RESULT", json.dumps({"runner": llm.llm_engine.vllm_config.use_v2_model_runner,
                                "seconds": best}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=256, help="requests per round")
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/layer_tasks"))
    ap.add_argument("--engine", choices=["zs", "tasks"], help=argparse.SUPPRESS)
    ap.add_argument("--vectors", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        return worker(a)

    from ltv_vllm.bench.workload import machine
    from ltv_vllm.models.resolve import resolve_model

    a.out.mkdir(parents=True, exist_ok=True)
    scratch = a.out / "work"
    vectors = scratch / "tasks.json"
    if not vectors.exists():
        vectors.write_text(json.dumps(make_tasks(resolve_model(a.model), max(KS), a.rank,
                                                 scratch / "tasks")))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    seconds: dict[str, float] = {}
    for engine in ("zs", "tasks"):
        cmd = [sys.executable, __file__, "--engine", engine, "--vectors", str(vectors),
               "--model", a.model, "--dtype", a.dtype, "--requests", str(a.requests),
               "--rounds", str(a.rounds)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r.returncode or line is None:
            sys.exit(f"layer_tasks: the {engine} engine failed:\n{r.stderr[-3000:]}")
        seconds.update(json.loads(line[len("RESULT "):])["seconds"])
    rows = []
    for shape, tokens in (("classify", 1), ("generate", 16)):
        zs = seconds[f"{shape}/zs/-"]
        for cell in [c for c in seconds if c.startswith(shape + "/")]:
            _, kind, k = cell.split("/")
            s = seconds[cell]
            rows.append({"shape": shape, "kind": kind, "K": k, "seconds": round(s, 4),
                         "requests_per_s": round(a.requests / s, 2),
                         "ratio_to_zero_shot": round(zs / s, 3), "tokens": tokens})
    res = {"command": " ".join(["python", "benchmarks/layer_tasks.py", *sys.argv[1:]]),
           "machine": machine(), "runner": "v1", "dtype": a.dtype, "requests": a.requests,
           "rank": a.rank, "rounds": a.rounds, "kinds": KINDS, "rows": rows}
    (a.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    for row in rows:
        print(f"{row['shape']:9s} {row['kind']:8s} K={row['K']:>4s} "
              f"{row['requests_per_s']:8.2f} req/s  {row['ratio_to_zero_shot']:.3f}× zero-shot")


if __name__ == "__main__":
    main()
