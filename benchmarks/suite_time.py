"""Where the test suite's time goes: `pytest --durations=0` of a whole run, by file and by
phase (setup: fixtures, a module's shared server among them; call: the test bodies;
teardown), beside the vLLM servers and engine jobs each file started (the suite's own
start-up summary, `tests/conftest.py`).

    python benchmarks/suite_time.py --out benchmarks/results/suite_time
    python benchmarks/suite_time.py --log run.log --out ...   # a log of such a run

Without --log it runs the suite as `.ci/run` does (`python -m pytest -q`, two workers)
with `--durations=0`; its log (which names this machine's paths, so it is not committed)
goes to a temporary file whose name is printed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

DURATION = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+?)::(\S+)")
STARTS = re.compile(r"^  (\S+\.py): (\d+), (\d+) s$")
KIND = re.compile(r"^(server|engine job): (\d+) started, (\d+) s in all$")
SUMMARY = re.compile(r"(\d+) passed.* in ([0-9.]+)s")


def parse(text: str) -> dict:
    files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    tests: dict[str, int] = defaultdict(int)
    starts: dict[str, list[int]] = {}
    kinds: dict[str, list[int]] = {}
    for line in text.splitlines():
        if m := DURATION.match(line):
            secs, phase, path = float(m[1]), m[2], m[3]
            files[path][phase] += secs
            if phase == "call":
                tests[path] += 1
        elif m := STARTS.match(line):
            starts[m[1]] = [int(m[2]), int(m[3])]
        elif m := KIND.match(line):
            kinds[m[1]] = [int(m[2]), int(m[3])]
    summary = SUMMARY.search(text)
    rows = [{"file": f, "tests": tests[f], **{p: round(v[p], 1) for p in
                                               ("setup", "call", "teardown")},
             "total": round(sum(v.values()), 1),
             "starts": starts.get(f, [0, 0])[0], "start_seconds": starts.get(f, [0, 0])[1]}
            for f, v in files.items()]
    rows.sort(key=lambda r: -r["total"])
    return {"rows": rows, "start_kinds": kinds,
            "passed": int(summary[1]) if summary else None,
            "wall_seconds": float(summary[2]) if summary else None}


def markdown(doc: dict) -> str:
    from ltv_vllm.models.hardware import machine_line

    rows = doc["rows"]
    total = sum(r["total"] for r in rows)
    lines = ["# Where the suite's time goes", "", "```", doc["command"], "```", "",
             f"{doc['passed']} tests passed in {doc['wall_seconds'] / 60:.1f} min of wall time "
             f"on two workers; {total / 60:.1f} min of worker time in the tests' phases; "
             f"{machine_line(doc['machine'])}.", ""]
    for kind, (n, secs) in sorted(doc["start_kinds"].items()):
        lines.append(f"- {kind}: {n} started, {secs / 60:.1f} min in all "
                     f"({secs / max(total, 1) * 100:.0f} % of the worker time)")
    if doc.get("source"):
        lines += ["", doc["source"]]
    lines += ["", "(The suite's start-up count covers `test_server.start_server` and "
              "`conftest.run_worker`; engines started through the CLI or a benchmark's jobs "
              "are in their tests' time, not in it. Start-ups of one test that overlap — "
              "replicas started side by side — add up to more than the test's own time. "
              "pytest leaves out phases under 5 ms.)", "",
              "| file | tests | setup s | call s | teardown s | total s | servers/jobs "
              "started | their start-up s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['file']} | {r['tests']} | {r['setup']:.0f} | {r['call']:.0f} | "
                     f"{r['teardown']:.0f} | {r['total']:.0f} | {r['starts']} | "
                     f"{r['start_seconds']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, help="a log of `pytest -q --durations=0` to read")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--source", default="", help="what produced --log (a line for the page)")
    args = ap.parse_args()
    from ltv_vllm.bench.workload import machine

    args.out.mkdir(parents=True, exist_ok=True)
    command = ("python benchmarks/suite_time.py" + (f" --log {args.log}" if args.log else "")
               + f" --out {args.out}")
    if args.log is None:
        t0 = time.time()
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--durations=0",
                              "-p", "no:cacheprovider"], capture_output=True, text=True)
        text = run.stdout + run.stderr
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
            f.write(text)
        print(f"suite exit {run.returncode} after {time.time() - t0:.0f} s; log: {f.name}",
              flush=True)
    else:
        text = args.log.read_text()
    doc = {"command": command, "machine": machine(), "source": args.source, **parse(text)}
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    (args.out / "README.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
