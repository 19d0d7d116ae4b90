"""Online: vLLM's OpenAI server under a fixed number of requests in flight.

The load generator is ours, not `vllm bench serve`: each request must go to its own task
(the `model` field picks the LoRA adapter, and prompts are ordered task by task) and carry
that task's `allowed_token_ids`, and we score the answers; vLLM's client assigns LoRA names
at random or round-robin over a shuffled dataset and keeps no logprobs. Latency is measured
per request from send to full response (for one output token, time to first token).
While a level runs, the server's process tree RSS and its `vllm:kv_cache_usage_perc` gauge
are sampled for their peaks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

import httpx

from ltv_vllm.bench import BenchError
from ltv_vllm.serving.client import classification, token_logprobs
from ltv_vllm.serving.launcher.serve import SERVER_MODULE

KV_GAUGE = "vllm:kv_cache_usage_perc"


def _kv_usage(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(s.value for fam in text_string_to_metric_families(text)
               if fam.name == KV_GAUGE for s in fam.samples)


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class Server:
    """vLLM's OpenAI server in its own session; `with server.sampling():` tracks peaks."""

    def __init__(self, args: list[str], *, url: str, env: dict[str, str], log_path: Path,
                 startup_timeout_s: float = 900) -> None:
        self.args, self.url, self.env, self.log_path = args, url, env, log_path
        self.startup_timeout_s = startup_timeout_s
        self.peak_rss, self.peak_kv = 0, 0.0
        self._on, self._stop = threading.Event(), threading.Event()

    def __enter__(self) -> Self:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, *self.args],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env},
                                     start_new_session=True)
        t0 = time.time()
        try:
            while True:
                if self.proc.poll() is not None:
                    raise BenchError(f"server exited during start-up; see {self.log_path}")
                if time.time() - t0 > self.startup_timeout_s:
                    raise BenchError(f"server not up after {self.startup_timeout_s:.0f} s; "
                                     f"see {self.log_path}")
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
        except BaseException:
            self.__exit__()
            raise
        self.startup_s = time.time() - t0
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            if self._on.wait(0.2):
                self.peak_rss = max(self.peak_rss, _tree_rss(self.proc.pid))
                try:
                    self.peak_kv = max(self.peak_kv, _kv_usage(self.url))
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)

    def sampling(self) -> _Sampling:
        return _Sampling(self)

    def reset_prefix_cache(self) -> None:
        # dev-mode endpoint (VLLM_SERVER_DEV_MODE=1): every level starts with a cold cache
        r = httpx.post(f"{self.url}/reset_prefix_cache", timeout=60)
        if r.status_code != 200:
            raise BenchError(f"/reset_prefix_cache failed ({r.status_code}); is "
                             "VLLM_SERVER_DEV_MODE=1 set?")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()


class _Sampling:
    def __init__(self, server: Server) -> None:
        self.server = server

    def __enter__(self) -> Server:
        self.server.peak_rss, self.server.peak_kv = 0, 0.0
        self.server._on.set()
        return self.server

    def __exit__(self, *exc: object) -> None:
        self.server._on.clear()
        time.sleep(0.3)  # let a sample in progress land


async def _drive(url: str, requests: list[dict[str, Any]], concurrency: int
                 ) -> tuple[float, list[dict[str, Any]]]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4,
                          max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:

        async def one(r: dict[str, Any]) -> dict[str, Any]:
            body = {"model": r["model"], "prompt": r["prompt"], "max_tokens": 1,
                    "temperature": 0.0, "logprobs": len(r["label_ids"]),
                    "allowed_token_ids": r["label_ids"], "return_tokens_as_token_ids": True}
            async with sem:
                t = time.perf_counter()
                resp = await client.post("/v1/completions", json=body)
                latency = time.perf_counter() - t
            if resp.status_code != 200:
                raise BenchError(f"request for {r['model']!r} refused ({resp.status_code}): "
                                 f"{resp.text[:200]}")
            lp = token_logprobs(resp.json()["choices"][0]["logprobs"]["top_logprobs"][0])
            c = classification(lp, r["label_ids"], r["labels"])
            return {"qid": r["qid"], "task": r["task"], "gold": r["gold"], "latency": latency,
                    "pred": r["labels"].index(c.label),
                    "probs": [round(c.probs[lab], 7) for lab in r["labels"]]}

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        return time.perf_counter() - t0, list(results)


def drive(url: str, requests: list[dict[str, Any]], concurrency: int
          ) -> tuple[float, list[dict[str, Any]]]:
    """Send every request with at most `concurrency` in flight; (wall seconds, per-request)."""
    return asyncio.run(_drive(url, requests, concurrency))
