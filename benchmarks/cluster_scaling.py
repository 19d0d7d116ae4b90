"""One `ltv-vllm evaluate` three ways — the local executor, and `--executor ray` on a Ray
cluster of one and of two worker nodes (`ray.cluster_utils.Cluster` on the loopback address,
each node with `--cpus-per-node` CPUs, one worker per CPU) — its wall time each way and
whether the three give the same rows.

    python benchmarks/cluster_scaling.py --model smollm2-135m \
        --tasks sst2,trec,subj,mr --runs 2 --k 10 --n 64 --n-test 100 \
        --methods zero-shot,icl,ltv,mean,tv,i2cl \
        --out benchmarks/results/cluster_scaling_smollm2-135m

On one machine the two "nodes" share its cores: the 2-node/1-node ratio says how the
executor spreads independent episodes over workers (each worker's torch uses its declared
CPUs), not what a cluster of real machines gains (there each node brings its own cores and
memory). Equality: accuracies equal, d_NTP to 1e-4 relative (a worker's torch reduces over
its one thread, the local driver's over all).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="sst2,trec,subj,mr")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--methods", default="zero-shot,icl,ltv,mean,tv,i2cl")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cpus-per-node", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "ltv_vllm.cli", "evaluate", "--model", a.model,
            "--tasks", a.tasks, "--runs", str(a.runs), "--k", str(a.k), "--n", str(a.n),
            "--n-test", str(a.n_test), "--methods", a.methods, "--cost-samples", "0",
            "--dtype", a.dtype, "--quiet"]
    work = a.out / "work"
    runs: dict[str, dict] = {}

    def timed(name: str, extra: list[str]) -> None:
        t0 = time.perf_counter()
        r = subprocess.run([*base, "--out", str(work / name), *extra], capture_output=True,
                           text=True)
        wall = time.perf_counter() - t0
        if r.returncode:
            sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
        doc = json.loads((work / name / "results.json").read_text())
        runs[name] = {"wall_seconds": wall, "records": doc["records"]}
        print(f"{name}: {wall:.1f} s", flush=True)

    timed("local", [])
    import ray
    from ray.cluster_utils import Cluster

    for nodes in (1, 2):
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": a.cpus_per_node})
        for _ in range(nodes - 1):
            c.add_node(num_cpus=a.cpus_per_node)
        c.wait_for_nodes()
        try:
            timed(f"ray-{nodes}-node", ["--executor", "ray", "--ray-address", c.address])
        finally:
            ray.shutdown()
            c.shutdown()

    def rows(name: str) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in ("extraction_seconds", "episode")}
                for r in runs[name]["records"]]

    equal = {}
    for name in ("ray-1-node", "ray-2-node"):
        same = len(rows(name)) == len(rows("local")) and all(
            {k: v for k, v in x.items() if k != "d_ntp"}
            == {k: v for k, v in y.items() if k != "d_ntp"}
            and abs(x["d_ntp"] - y["d_ntp"]) <= 1e-4 * max(abs(x["d_ntp"]), 1e-3)
            for x, y in zip(rows("local"), rows(name), strict=False))
        equal[name] = same
    nodes = {name: sorted({r["episode"].get("ray_node", "driver")
                           for r in runs[name]["records"]}) for name in runs}
    from ltv_vllm.models.hardware import hardware

    doc = {"command": " ".join(sys.argv),
           "machine": {**hardware(), "python": platform.python_version()},
           "ray": ray.__version__,
           "episodes": len({(r["task"], r["run"]) for r in runs["local"]["records"]}),
           "wall_seconds": {n: round(r["wall_seconds"], 1) for n, r in runs.items()},
           "ratio_2_over_1_node": round(runs["ray-2-node"]["wall_seconds"]
                                        / runs["ray-1-node"]["wall_seconds"], 3),
           "equal_to_local": equal, "nodes_used": {n: len(v) for n, v in nodes.items()}}
    (a.out / "results.json").write_text(json.dumps(doc, indent=1))
    w = doc["wall_seconds"]
    md = [f"# Sweeps on a Ray cluster: {a.model}", "", "```", doc["command"], "```", "",
          f"Machine: {doc['machine'].get('cpu')}, {doc['machine'].get('cpu_capability')}, "
          f"{doc['machine'].get('cores')} cores; Ray {doc['ray']}; {doc['episodes']} "
          "(task, run) episodes.", "",
          "| executor | wall (s) | rows equal to local | nodes used |", "|---|---|---|---|",
          f"| local (one process, all cores) | {w['local']} | – | – |",
          f"| ray, 1 worker node | {w['ray-1-node']} | {equal['ray-1-node']} | "
          f"{doc['nodes_used']['ray-1-node']} |",
          f"| ray, 2 worker nodes | {w['ray-2-node']} | {equal['ray-2-node']} | "
          f"{doc['nodes_used']['ray-2-node']} |", "",
          f"Wall time, 2 nodes / 1 node: {doc['ratio_2_over_1_node']}.", ""]
    (a.out / "results.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
