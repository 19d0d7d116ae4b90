"""One job protocol for work that needs a fresh process: `python -m MODULE JOB OUT`.

vLLM keeps global state per process (and an engine's memory is only measured honestly in a
process of its own), so an offline engine job runs in a child: the parent writes JOB (JSON),
the child's `job_main` reads it, runs the work and writes OUT (JSON) atomically; the child's
output goes to a log beside them, and a failure is one line naming the log. Used by the
offline generation jobs (`offline`) and the serving benchmark's engine jobs (`bench.engine`).
The task store's compile worker is the one exception: it runs asynchronously under the
server, reports its progress while it runs and can be stopped, so it keeps its own protocol
(`compile`, `vllm_ext.endpoints`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ltv_vllm.errors import UserError


def job_paths(work: Path, name: str) -> tuple[Path, Path, Path]:
    """(job, result, log) files of job `name` under `work`."""
    return work / f"{name}.job.json", work / f"{name}.result.json", work / f"{name}.log"


def run_job(module: str, job: dict[str, Any] | str, work: Path, name: str, *,
            env: Mapping[str, str] | None = None, what: str = "job",
            error: type[UserError] = UserError) -> dict[str, Any]:
    """Run `python -m module JOB OUT` in a fresh process and return OUT. `job` is the job's
    JSON (a dict, or its text already dumped); `env` is added to this process's environment;
    a failure raises `error` naming the log's last line and its path."""
    work.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = job_paths(work, name)
    job_path.write_text(job if isinstance(job, str) else json.dumps(job))
    out_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        rc = subprocess.run([sys.executable, "-m", module, str(job_path), str(out_path)],
                            stdout=log, stderr=subprocess.STDOUT, check=False,
                            env={**os.environ, **(env or {})}).returncode
    if rc != 0 or not out_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["empty log"]
        raise error(f"{what} failed ({tail[0][:200]}); see {log_path}")
    return json.loads(out_path.read_text())


def job_main(work: Callable[[dict[str, Any]], dict[str, Any]],
             argv: list[str] | None = None) -> None:
    """The child's side: JOB → work(job) → OUT, written whole or not at all."""
    job_arg, out_arg = (sys.argv[1:] if argv is None else argv)[:2]
    out = work(json.loads(Path(job_arg).read_text()))
    tmp = Path(out_arg + ".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, out_arg)
