"""Compiling tasks on a running server: how soon a task is served, and what a compile costs
the classification traffic the server carries meanwhile.

    python benchmarks/compile_serving.py --model smollm2-135m --tasks sst2,trec \
        --out benchmarks/results/compile_serving_smollm2-135m

1. Offline reference: `ltv-vllm extract` of each task's episode (k, N, seed), timed end to end
   (model load included, one test query scored, all cores, nothing else running).
2. `ltv-vllm serve --task-store` (empty store) with one command-line task, `traffic` (the
   first task's offline vector), and a closed loop of `--concurrency` clients classifying
   that task's test texts without pause.
3. Windows of that traffic: `undisturbed` (no compile), then per task `during` (from the
   POST of the same episode's demos and queries until the task is ready) and `after`
   (`--window` seconds once it is served). Per window: requests, throughput, p50 / p99
   latency, errors. POST → first served answer is timed per task.
4. Each compiled task then labels the test texts; the first one is compared with the
   offline vector of the same episode (served as `traffic`).

Targets (issue 14): a task served within 2x its offline extract time; traffic during a
compile at >= 0.5x its undisturbed throughput.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ltv_vllm.bench.online import Server
from ltv_vllm.models.hardware import hardware, machine_line
from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
from ltv_vllm.serving.client import classify
from ltv_vllm.serving.launcher.serve import ServeOptions, plan_server
from ltv_vllm.serving.store.compile import CompileRequest
from ltv_vllm.tasks.specs import get_task

HOST = "127.0.0.1"


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Traffic:
    """`concurrency` clients, each sending the next classification as soon as it has its
    answer; every request is logged as (start, seconds, ok)."""

    def __init__(self, url: str, model: str, task, texts: list[str], concurrency: int):
        from ltv_vllm.serving.client import label_ids_from_server

        ids = label_ids_from_server(url, model, task)
        self.bodies = [{"model": model, "prompt": task.query(t), "max_tokens": 1,
                        "temperature": 0.0, "logprobs": len(ids), "allowed_token_ids": ids}
                       for t in texts]
        self.url, self.log, self.errors = url, [], []
        self._stop = threading.Event()
        self._next = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True)
                        for _ in range(concurrency)]

    def _loop(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                with self._lock:
                    body = self.bodies[self._next % len(self.bodies)]
                    self._next += 1
                t0 = time.time()
                try:
                    r = http.post(f"{self.url}/v1/completions", json=body)
                    ok = r.status_code == 200
                    if not ok:
                        self.errors.append(f"{r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as e:
                    ok = False
                    self.errors.append(repr(e))
                self.log.append((t0, time.time() - t0, ok))

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self.threads:
            t.join()

    def window(self, name: str, t0: float, t1: float) -> dict:
        got = [(lat, ok) for s, lat, ok in self.log if t0 <= s and s + lat <= t1]
        lats = [lat for lat, ok in got if ok]
        return {"window": name, "seconds": t1 - t0, "requests": len(got),
                "errors": sum(not ok for _, ok in got),
                "throughput": len(lats) / (t1 - t0) if t1 > t0 else float("nan"),
                "p50_ms": 1000 * _quantile(lats, 0.5), "p99_ms": 1000 * _quantile(lats, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="sst2,trec")
    ap.add_argument("--k", type=int, default=30)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--compile-threads", type=int, default=1,
                    help="`serve --compile-threads`: torch threads of the compile worker")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per measured window")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compile_serving"))
    a = ap.parse_args()
    names = a.tasks.split(",")
    work = Path(tempfile.mkdtemp(prefix="compile-serving-"))
    episodes = {t: plan_episode(get_task(t), ExtractOptions(k=a.k, n=a.n, n_test=a.n_test,
                                                            seed=a.seed, n_val=0))
                for t in names}
    res: dict = {"model": a.model, "dtype": a.dtype, "k": a.k, "n": a.n, "seed": a.seed,
                 "compile_threads": a.compile_threads,
                 "concurrency": a.concurrency, "window_seconds": a.window,
                 "machine": hardware(), "offline": {}, "compiles": {}, "windows": []}

    # 1. the offline reference, alone on the machine
    for t in names:
        cmd = [sys.executable, "-m", "ltv_vllm.cli", "extract", "--model", a.model, "--task", t,
               "--k", str(a.k), "--n", str(a.n), "--seed", str(a.seed), "--n-test", "1",
               "--dtype", a.dtype, "--quiet", "-o", str(work / f"{t}.pt")]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        res["offline"][t] = {"extract_seconds": time.perf_counter() - t0}
        print(f"offline extract {t}: {res['offline'][t]['extract_seconds']:.1f} s", flush=True)

    # 2. the server: an empty store, and the first task's offline vector as the traffic task
    port = 8000 + (hash(str(work)) % 1000)
    plan = plan_server(ServeOptions(a.model, (f"traffic={work / (names[0] + '.pt')}",),
                                    host=HOST, port=port, dtype=a.dtype,
                                    task_store=str(work / "store"), max_tasks=len(names) + 1,
                                    compile_threads=a.compile_threads))
    plan.prepare()
    url = f"http://{HOST}:{port}"
    test_texts = [e.text for e in episodes[names[0]].test]
    with Server(plan.argv[3:], url=url, env={**plan.env, "TOKENIZERS_PARALLELISM": "false"},
                log_path=work / "server.log") as srv:
        res["server_startup_seconds"] = srv.startup_s
        with Traffic(url, "traffic", get_task(names[0]), test_texts, a.concurrency) as tr:
            time.sleep(10)  # warm-up, not counted
            t0 = time.time()
            time.sleep(a.window)
            res["windows"].append(tr.window("undisturbed", t0, time.time()))
            for t in names:
                live = f"{t}-live"
                t_post = time.time()
                body = CompileRequest.from_episode(live, episodes[t], test=False).to_dict()
                r = httpx.post(f"{url}/v1/ltv/tasks", json=body, timeout=120)
                assert r.status_code == 202, r.text
                phases = []
                while (view := httpx.get(f"{url}/v1/ltv/tasks/{live}", timeout=60).json()
                       )["status"] != "ready":
                    if view["status"] == "failed":
                        raise SystemExit(f"compile of {live} failed: {view['error']}")
                    if not phases or phases[-1][0] != view.get("phase"):
                        phases.append((view.get("phase"), time.time() - t_post))
                    time.sleep(0.2)
                t_ready = time.time()
                r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                    "model": live, "prompt": get_task(t).query(episodes[t].test[0].text),
                    "max_tokens": 1, "temperature": 0.0})
                assert r.status_code == 200, r.text
                t_first = time.time()
                res["windows"].append(tr.window(f"during {t}", t_post, t_ready))
                res["compiles"][t] = {"post_to_ready_seconds": t_ready - t_post,
                                      "worker_seconds": view.get("compile_seconds"),
                                      "post_to_first_answer_seconds": t_first - t_post,
                                      "phases": phases}
                print(f"{t}: served {t_first - t_post:.1f} s after the POST", flush=True)
                t0 = time.time()
                time.sleep(a.window)
                res["windows"].append(tr.window(f"after {t}", t0, time.time()))
        res["traffic_errors"] = tr.errors[:5]
        res["traffic_requests"] = len(tr.log)
        # 4. the compiled tasks on the test texts; the first against its offline vector
        for t in names:
            task, ep = get_task(t), episodes[t]
            got = classify(url, task, [e.text for e in ep.test], model=f"{t}-live")
            res["compiles"][t]["accuracy"] = sum(
                task.labels[e.label] == g.label for e, g in zip(ep.test, got, strict=True)
            ) / len(ep.test)
            if t == names[0]:
                off = classify(url, task, [e.text for e in ep.test], model="traffic")
                res["compiles"][t]["same_label_as_offline"] = sum(
                    x.label == y.label for x, y in zip(got, off, strict=True)) / len(got)
                res["compiles"][t]["max_prob_diff_vs_offline"] = max(
                    abs(x.probs[lab] - y.probs[lab]) for x, y in zip(got, off, strict=True)
                    for lab in task.labels)
    write(res, a)


def write(res: dict, a: argparse.Namespace) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/compile_serving.py " + shlex.join(
        [f"--model={a.model}", f"--tasks={a.tasks}", f"--k={a.k}", f"--n={a.n}",
         f"--concurrency={a.concurrency}", f"--compile-threads={a.compile_threads}",
         f"--window={a.window:g}", f"--out={a.out}"])
    res["command"] = cmd
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    und = res["windows"][0]["throughput"] or float("nan")  # --concurrency 0: no traffic
    md = ["# Compiling tasks on a running server\n", f"```\n{cmd}\n```\n",
          f"{machine_line(res['machine'])}; {res['dtype']}; k = {res['k']}, N = {res['n']}, "
          f"seed {res['seed']}; compile worker {res['compile_threads']} thread(s); "
          + (f"{res['concurrency']} closed-loop clients classify `traffic` throughout"
             if res["concurrency"] else "no other traffic (an idle server)")
          + f"; server start-up {res['server_startup_seconds']:.0f} s.\n",
          "| task | offline extract (s) | POST → ready (s) | POST → first answer (s) | "
          "ratio to offline | accuracy (test) |", "|---|---|---|---|---|---|"]
    for t, c in res["compiles"].items():
        off = res["offline"][t]["extract_seconds"]
        md.append(f"| {t} | {off:.1f} | {c['post_to_ready_seconds']:.1f} | "
                  f"{c['post_to_first_answer_seconds']:.1f} | "
                  f"{c['post_to_first_answer_seconds'] / off:.2f}x | "
                  f"{100 * c['accuracy']:.1f} % |")
    if res["concurrency"]:
        md += ["", "| traffic window | seconds | requests | errors | req/s | vs undisturbed | "
                   "p50 (ms) | p99 (ms) |", "|---|---|---|---|---|---|---|---|"]
    for w in res["windows"] if res["concurrency"] else []:
        md.append(f"| {w['window']} | {w['seconds']:.0f} | {w['requests']} | {w['errors']} | "
                  f"{w['throughput']:.2f} | {w['throughput'] / und:.2f}x | {w['p50_ms']:.0f} | "
                  f"{w['p99_ms']:.0f} |")
    md += ["", "Where a compile's time goes (seconds after the POST at which the worker "
               "reported each phase; before the first, the worker process starts and imports):",
           ""]
    for t, c in res["compiles"].items():
        md.append(f"- {t}: " + ", ".join(f"{p or 'starting'} {s:.1f}" for p, s in c["phases"])
                  + f", served {c['post_to_ready_seconds']:.1f}")
    first = next(iter(res["compiles"].values()))
    if "same_label_as_offline" in first:
        md.append(f"\nThe first compiled task against the offline vector of the same episode "
                  f"(both served): same label on {100 * first['same_label_as_offline']:.1f} % "
                  f"of the test texts, largest label-probability difference "
                  f"{first['max_prob_diff_vs_offline']:.2e}.")
    (a.out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
