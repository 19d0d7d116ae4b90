"""Serve start-up: seconds from `ltv-vllm serve` to a 200 on /health, eager against compiled.

    python benchmarks/startup.py --vector trec.pt --out benchmarks/results/startup

Each configuration starts a fresh server, waits for /health, stops it. "compiled" passes
`--no-enforce-eager` (vLLM's default compile warm-up); its first start fills vLLM's compile
cache (~/.cache/vllm), the second start of the same configuration shows what a cache hit
saves. Results: results.json and results.md with the hardware they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ltv_vllm.models.hardware import hardware, machine_line


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def time_to_health(args: list[str], log: Path, timeout_s: float = 600) -> float:
    port = _port()
    cmd = [sys.executable, "-m", "ltv_vllm.cli", "serve", *args, "--port", str(port)]
    with open(log, "w") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited; see {log}")
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"not up after {timeout_s} s; see {log}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vector", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/startup"))
    ap.add_argument("--configs", default="fused,folded,multi,fused-compiled,fused-compiled")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    base = ["--model", a.model]
    configs = {
        "fused": ["--task-vector", a.vector],
        "folded": ["--task-vector", a.vector, "--fold"],
        "multi": ["--task-vector", f"a={a.vector}", "--task-vector", f"b={a.vector}"],
        "fused-compiled": ["--task-vector", a.vector, "--no-enforce-eager"],
        "folded-compiled": ["--task-vector", a.vector, "--fold", "--no-enforce-eager"],
        "multi-compiled": ["--task-vector", f"a={a.vector}", "--task-vector", f"b={a.vector}",
                           "--no-enforce-eager"],
        # the start-up self-check (`offline.selfcheck`) left out: what it adds to a start
        "fused-noselfcheck": ["--task-vector", a.vector, "--skip-selfcheck"],
        "multi-noselfcheck": ["--task-vector", f"a={a.vector}", "--task-vector",
                              f"b={a.vector}", "--skip-selfcheck"],
    }
    rows = []
    for i, name in enumerate(a.configs.split(",")):
        log = a.out / f"{i}-{name}.log"
        s = time_to_health([*base, *configs[name]], log)
        seen = sum(r["config"] == name for r in rows)
        # the probe batch's own time, as the server printed it
        check = re.search(r"selfcheck passed on .* in ([0-9.]+) s", log.read_text())
        rows.append({"config": name, "start": seen + 1, "seconds": round(s, 1),
                     "selfcheck_seconds": float(check[1]) if check else None})
        print(f"{name} (start {seen + 1}): {s:.1f} s"
              + (f" (selfcheck {check[1]} s)" if check else ""), flush=True)
    hw = hardware()
    doc = {"command": " ".join(["python", "benchmarks/startup.py", *sys.argv[1:]]),
           "machine": hw, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows}
    (a.out / "results.json").write_text(json.dumps(doc, indent=1))
    md = ["# Serve start-up: time to /health", "", "```", doc["command"], "```", "",
          f"{machine_line(hw)}; {doc['measured_at']}.", "",
          "| configuration | start | seconds to /health | of which the self-check |",
          "|---|---|---|---|"]
    md += [f"| {r['config']} | {r['start']} | {r['seconds']} | "
           f"{r.get('selfcheck_seconds') if r.get('selfcheck_seconds') is not None else '–'} |"
           for r in rows]
    (a.out / "results.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
