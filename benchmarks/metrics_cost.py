"""What the per-task metrics cost per-request serving: the same server with them and without
them (`serve --no-task-metrics`), side by side in one run.

One server at a time: `ltv-vllm serve` of the packaged model with K named per-request tasks
(random vectors at the rank and shape of a real fit; their values do not change the cost).
Against each, C clients keep C requests in flight: R requests naming a task (each its task
i mod K, the vector's policy: every step) and R requests to the bare model (zero-shot, the
baseline on the same server), for classify (1 greedy token) and generate (16, EOS ignored).
The servers alternate, on → off, then off → on, ... (--rounds each, neither always first); a
cell's figure is its fastest round, and the spread between a mode's rounds is the noise the
difference is read against.
After each metrics-on round the server's own counters are checked against what was sent.

    python benchmarks/metrics_cost.py --out benchmarks/results/metrics_cost_smollm2-135m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {"classify": 1, "generate": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, vectors: dict[str, str], metrics: bool, dtype: str, log: Path,
          cache: Path, extra: tuple[str, ...] = (),
          max_model_len: int = 512) -> tuple[subprocess.Popen, str]:
    """`ltv-vllm serve` of `model` with `vectors` by name (`extra`: more serve flags)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "ltv_vllm.cli", "serve", "--model", model, "--port",
           str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), "--skip-selfcheck",
           *[a for n, p in vectors.items() for a in ("--task-vector", f"{n}={p}")],
           *([] if metrics else ["--no-task-metrics"]), *extra,
           "--", "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(256 << 20)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ,
                                                         "LTV_VLLM_CACHE": str(cache)})
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            sys.exit(f"metrics_cost: the server exited; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() - t0 > 600:
            sys.exit(f"metrics_cost: the server did not start; see {log}")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def load(url: str, model: str, tasks: list[str] | None, tokens: int, requests: int,
               clients: int, prompts: list[str]) -> float:
    """Seconds for `requests` completions, `clients` in flight; each answer's length checked."""
    import httpx

    queue = list(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            r = await http.post(f"{url}/v1/completions", json={
                "model": tasks[i % len(tasks)] if tasks else model,
                "prompt": prompts[i % len(prompts)], "max_tokens": tokens,
                "temperature": 0.0, "ignore_eos": True})
            r.raise_for_status()
            assert r.json()["usage"]["completion_tokens"] == tokens

    async with httpx.AsyncClient(timeout=300) as http:
        t = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return time.perf_counter() - t


def totals(url: str, names: tuple[str, ...], by: str | None = None) -> dict[str, float]:
    """The server's samples of the metrics `names`, summed over their labels (but `by`, whose
    value then keys the sums)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name in names:
                key = s.labels[by] if by else s.name
                out[key] = out.get(key, 0.0) + s.value
    return out


def counted(url: str) -> dict[str, float]:
    """The server's per-task request and shifted-token totals (all tasks)."""
    return totals(url, ("ltv_vllm:task_requests_total", "ltv_vllm:task_shifted_tokens_total"))


def load_args(doc: str, out: str, rounds: str) -> argparse.ArgumentParser:
    """The options of a side-by-side serving cost benchmark (this one's, fidelity_cost's)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--requests", type=int, default=256, help="requests per cell and round")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help=rounds)
    ap.add_argument("--out", type=Path, default=Path(out))
    return ap


def main() -> None:
    a = load_args(__doc__, "benchmarks/results/metrics_cost",
                  "servers per mode, alternating").parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from k_tasks import make_vectors, prompts

    from ltv_vllm.bench.workload import machine
    from ltv_vllm.models.resolve import resolve_model

    a.out.mkdir(parents=True, exist_ok=True)
    scratch = a.out / "work"
    scratch.mkdir(exist_ok=True)
    vectors = make_vectors(resolve_model(a.model), a.tasks, a.rank, scratch / "vectors")
    names = list(vectors)
    ps = prompts(64)
    seconds: dict[str, list[float]] = {}
    checks = []
    for r in range(a.rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):  # neither always first
            proc, url = start(a.model, vectors, mode == "on", a.dtype,
                              scratch / f"server-{mode}-{r}.log", scratch / "cache")
            try:
                asyncio.run(load(url, a.model, names, 2, 32, a.clients, ps))  # warm-up
                before = counted(url) if mode == "on" else {}
                for shape, tokens in SHAPES.items():
                    for who, tasks in (("task", names), ("zero-shot", None)):
                        s = asyncio.run(load(url, a.model, tasks, tokens, a.requests,
                                             a.clients, ps))
                        seconds.setdefault(f"{mode}/{shape}/{who}", []).append(s)
                        print(f"round {r} metrics {mode:3s} {shape:8s} {who:9s} "
                              f"{a.requests / s:7.2f} req/s", flush=True)
                if mode == "on":  # the counters count exactly what was sent
                    after = counted(url)
                    got = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                    want = {"ltv_vllm:task_requests_total": 2 * a.requests,
                            "ltv_vllm:task_shifted_tokens_total": a.requests * sum(
                                SHAPES.values())}
                    checks.append(got == want)
                    if got != want:
                        sys.exit(f"metrics_cost: the server counted {got}, sent {want}")
            finally:
                stop(proc)
    rows = []
    for shape in SHAPES:
        for who in ("task", "zero-shot"):
            on, off = seconds[f"on/{shape}/{who}"], seconds[f"off/{shape}/{who}"]
            rows.append({
                "shape": shape, "requests": who,
                "req_per_s_metrics_on": round(a.requests / min(on), 2),
                "req_per_s_metrics_off": round(a.requests / min(off), 2),
                "on_over_off": round(min(off) / min(on), 3),
                # the noise: how far a mode's own rounds are apart
                "spread_on": round(max(on) / min(on) - 1, 3),
                "spread_off": round(max(off) / min(off) - 1, 3)})
    res = {"command": " ".join(["python", "benchmarks/metrics_cost.py", *sys.argv[1:]]),
           "machine": machine(), "model": a.model, "dtype": a.dtype, "tasks": a.tasks,
           "rank": a.rank, "requests": a.requests, "clients": a.clients, "rounds": a.rounds,
           "counters_checked": checks, "rows": rows,
           "seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()}}
    (a.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["| shape | requests | req/s metrics on | req/s off | on / off | spread on | "
             "spread off |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {x['shape']} | {x['requests']} | {x['req_per_s_metrics_on']} | "
              f"{x['req_per_s_metrics_off']} | {x['on_over_off']} | {x['spread_on']:.1%} | "
              f"{x['spread_off']:.1%} |" for x in rows]
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
