"""One job protocol for work that needs a fresh process: `python -m MODULE JOB OUT`.

vLLM keeps global state per process (and an engine's memory is only measured honestly in a
process of its own), so an offline engine job runs in a child: the parent writes JOB (JSON),
the child's `job_main` reads it, runs the work and writes OUT (JSON) atomically; the child's
output goes to a log beside them, and a failure is one line naming the log. Used by the
offline generation jobs (`offline`) and the serving benchmark's engine jobs (`bench.engine`).
The task store's compile worker is the one exception: it runs asynchronously under the
server, reports its progress while it runs and can be stopped, so it keeps its own protocol
(`compile`, `api_server.endpoints`).

A fresh interpreter spends most of an engine job importing vLLM (about 17 s of a 24 s job on
a 2-core AVX2 EPYC, tiny model), so jobs are forked from a multiprocessing *forkserver* that
has imported vLLM once, ahead of the first job: each child is still a process of its own
(its own engine, caches and peak RSS), it only skips the import. The forkserver only imports
and fills torch inductor's per-process probe caches (`preload`: no engine built, no CUDA
context made, no parallel torch op run: what makes forking it safe, as forking a DataLoader
worker after `import torch` is); vLLM itself still starts its own workers (tensor
parallelism) as it always does.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import multiprocessing
import os
import runpy
import sys
from collections.abc import Callable, Mapping
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

from ltv_vllm.errors import UserError


def job_paths(work: Path, name: str) -> tuple[Path, Path, Path]:
    """(job, result, log) files of job `name` under `work`."""
    return work / f"{name}.job.json", work / f"{name}.result.json", work / f"{name}.log"


# imported once by the forkserver, before any job forks from it (`preload`: what every engine
# job would otherwise import and probe for itself)
PRELOAD = ("ltv_vllm.serving.offline.jobs", "vllm.entrypoints.llm",
           "ltv_vllm.serving.offline.preload")


@functools.cache
def _job_context() -> multiprocessing.context.BaseContext:
    """The forkserver context (the server itself starts, and imports vLLM, on first use)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def prestart() -> None:
    """Start the forkserver now, so its vLLM import overlaps the caller's own work."""
    _job_context()
    forkserver.ensure_running()


def _child(module: str, job_path: str, out_path: str, log_path: str,
           env: dict[str, str]) -> None:
    """In the forked child: output to the log, the job's environment, then `python -m module
    JOB OUT` as the module's own `__main__` would run it."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    # what the forkserver imported is long-lived: out of the collector's sight, vLLM's own
    # full collections (several per engine start) skip it — about 3 s of a job's 8 here
    gc.freeze()
    sys.argv = [module, job_path, out_path]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        # a multiprocessing child leaves by os._exit; run what a normal exit would (vLLM
        # registers its engine shutdown with atexit)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def run_job(module: str, job: dict[str, Any] | str, work: Path, name: str, *,
            env: Mapping[str, str] | None = None, what: str = "job",
            error: type[UserError] = UserError) -> dict[str, Any]:
    """Run `python -m module JOB OUT` in a fresh process (forked from the forkserver) and
    return OUT. `job` is the job's JSON (a dict, or its text already dumped); `env` is added
    to the child's environment; a failure raises `error` naming the log's last line and its
    path."""
    work.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = job_paths(work, name)
    job_path.write_text(job if isinstance(job, str) else json.dumps(job))
    out_path.unlink(missing_ok=True)
    proc = _job_context().Process(
        target=_child, args=(module, str(job_path), str(out_path), str(log_path),
                             dict(env or {})), name=f"ltv-vllm job {name}")
    proc.start()
    try:
        proc.join()
    except BaseException:  # interrupted: the child goes too, its half-run result with it
        proc.kill()
        proc.join()
        raise
    if proc.exitcode != 0 or not out_path.is_file():
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
