"""What live fidelity sampling costs per-request serving: the same server with
`--fidelity-sample` 0 (off), 0.01 and 0.1, side by side in one run.

One server at a time: `ltv-vllm serve` of the packaged model with K named per-request tasks.
Each vector is random (at the rank and shape of a real fit: its values do not change the
cost) and records a real TREC episode's k = 30 demonstrations, so each re-ask runs the
bare model on that ICL prompt as a served task's would (vLLM's prefix cache keeps the
demonstrations after the first). Against each server, C clients keep C requests in flight:
R requests naming a task (i mod K; TREC zero-shot prompts) and R to the bare model, for
classify (1 greedy token) and generate (16, EOS ignored). The servers rotate through the
three rates, each round in another order; a cell's figure is its fastest round, and the
spread between a rate's own rounds is the noise the difference is read against. After each
round the server's re-asks by outcome are read from its /metrics.

    python benchmarks/fidelity_cost.py --out benchmarks/results/fidelity_cost_smollm2-135m
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

RATES = (0.0, 0.01, 0.1)
SHAPES = {"classify": 1, "generate": 16}


def episode_vectors(model_dir: Path, k: int, rank: int, out: Path
                    ) -> tuple[dict[str, str], list[str]]:
    """K random vectors (`k_tasks.make_vectors`) recording the TREC episode's task and
    demonstrations; the episode's test queries' zero-shot prompts."""
    from k_tasks import make_vectors

    from ltv_vllm.models.loading import load_tokenizer
    from ltv_vllm.pipeline.extract import ExtractOptions, demonstrations, plan_episode
    from ltv_vllm.tasks.specs import get_task, label_token_ids

    task = get_task("trec")
    episode = plan_episode(task, ExtractOptions(k=30, n=16, n_test=128))
    labels = tuple(label_token_ids(task, load_tokenizer(str(model_dir))))
    paths = make_vectors(model_dir, k, rank, out, labels, task.to_dict(),
                         {"demonstrations": demonstrations(episode.demo_sets)})
    return paths, [task.zero_shot(e.text) for e in episode.test]


def outcomes(url: str) -> dict[str, float]:
    """The server's re-asks by outcome, all tasks."""
    from metrics_cost import totals

    return totals(url, ("ltv_vllm:task_fidelity_samples_total",), by="outcome")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from metrics_cost import load, load_args, start, stop

    ap = load_args(__doc__, "benchmarks/results/fidelity_cost", "servers per rate, rotating")
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="the served context: it must hold the ICL prompt (k = 30 TREC "
                         "demonstrations and a query)")
    a = ap.parse_args()

    from ltv_vllm.bench.workload import machine
    from ltv_vllm.models.resolve import resolve_model

    a.out.mkdir(parents=True, exist_ok=True)
    scratch = a.out / "work"
    scratch.mkdir(exist_ok=True)
    vectors, ps = episode_vectors(resolve_model(a.model), a.tasks, a.rank, scratch / "vectors")
    names = list(vectors)
    seconds: dict[str, list[float]] = {}
    asked: dict[str, list[dict[str, float]]] = {}
    for r in range(a.rounds):
        order = RATES[r % len(RATES):] + RATES[:r % len(RATES)]  # each round starts elsewhere
        for rate in order:
            proc, url = start(a.model, vectors, True, a.dtype,
                              scratch / f"server-{rate}-{r}.log", scratch / "cache",
                              ("--fidelity-sample", str(rate)), a.max_model_len)
            try:
                asyncio.run(load(url, a.model, names, 2, 32, a.clients, ps))  # warm-up
                before = outcomes(url)
                for shape, tokens in SHAPES.items():
                    for who, tasks in (("task", names), ("zero-shot", None)):
                        s = asyncio.run(load(url, a.model, tasks, tokens, a.requests,
                                             a.clients, ps))
                        seconds.setdefault(f"{rate}/{shape}/{who}", []).append(s)
                        print(f"round {r} sample {rate:<5} {shape:8s} {who:9s} "
                              f"{a.requests / s:7.2f} req/s", flush=True)
                after = outcomes(url)
                asked.setdefault(str(rate), []).append(
                    {k: v - before.get(k, 0.0) for k, v in after.items()})
            finally:
                stop(proc)
    rows = []
    for shape in SHAPES:
        for who in ("task", "zero-shot"):
            off = seconds[f"0.0/{shape}/{who}"]
            row = {"shape": shape, "requests": who,
                   "req_per_s_off": round(a.requests / min(off), 2),
                   "spread_off": round(max(off) / min(off) - 1, 3)}
            for rate in RATES[1:]:
                on = seconds[f"{rate}/{shape}/{who}"]
                row[f"req_per_s_{rate}"] = round(a.requests / min(on), 2)
                row[f"ratio_{rate}"] = round(min(off) / min(on), 3)
                row[f"spread_{rate}"] = round(max(on) / min(on) - 1, 3)
            rows.append(row)
    res = {"command": " ".join(["python", "benchmarks/fidelity_cost.py", *sys.argv[1:]]),
           "machine": machine(), "model": a.model, "dtype": a.dtype, "tasks": a.tasks,
           "rank": a.rank, "requests": a.requests, "clients": a.clients, "rounds": a.rounds,
           "max_model_len": a.max_model_len, "re_asks": asked, "rows": rows,
           "seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()}}
    (a.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["| shape | requests | req/s off | 1 % | 10 % | 1 % / off | 10 % / off | spread "
             "off / 1 % / 10 % |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {x['shape']} | {x['requests']} | {x['req_per_s_off']} | "
              f"{x['req_per_s_0.01']} | {x['req_per_s_0.1']} | {x['ratio_0.01']} | "
              f"{x['ratio_0.1']} | {x['spread_off']:.1%} / {x['spread_0.01']:.1%} / "
              f"{x['spread_0.1']:.1%} |" for x in rows]
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(asked))


if __name__ == "__main__":
    main()
