"""POST /v1/ltv/tasks with a compile request: checked, queued, compiled by a worker process
(`store.compile`, one at a time), then published and served. Runs in vLLM's API-server
process (a part of `endpoints.TaskEndpoints`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ltv_vllm.serving.api_server.asgi import error_response as _error
from ltv_vllm.serving.api_server.gate import KEY_STATE
from ltv_vllm.serving.api_server.metrics import store_operation
from ltv_vllm.serving.api_server.tenancy import outside
from ltv_vllm.serving.contract.names import COMPILE_WORKER
from ltv_vllm.serving.store.compile import ENTRY

logger = logging.getLogger("ltv_vllm.serving.api_server.endpoints")


class Compiles:
    """Compile jobs: their part of the task endpoints."""

    async def _compile(self, request: Any) -> Any:
        from fastapi.responses import JSONResponse

        from ltv_vllm.errors import UserError
        from ltv_vllm.serving.store.compile import parse_request
        from ltv_vllm.serving.store.taskstore import full_disk

        try:  # whole and within the compile limit (api_server.gate)
            body = json.loads(await request.body())
        except RecursionError:
            return _error(400, "malformed JSON: nested too deeply", "BadRequestError")
        except ValueError as e:
            return _error(400, f"malformed JSON: {e}", "BadRequestError")
        if (out := outside(request, body.get("name") if isinstance(body, dict) else None)
                ) is not None:
            return out
        try:
            req = await asyncio.to_thread(parse_request, body, tokenizer=self.tokenizer,
                                          max_model_len=self.max_model_len)
        except UserError as e:
            return self._fail(400, e, "BadRequestError")
        if (stale := await self._fresh()) is not None:
            return stale
        async with self.lock:
            if (taken := self._taken(req.name)) is not None:
                return taken
            job_dir = None
            try:
                job_dir = Path(tempfile.mkdtemp(prefix=f"{req.name}-",
                                                dir=self.store.root / ".jobs"))
                job = {"dir": job_dir, "state": "queued", "t0": time.time(),
                       "request": req.to_dict(), "id": job_dir.name,
                       "key": getattr(request.state, KEY_STATE, None),
                       "client": request.client.host if request.client else None}
                (job_dir / "job.json").write_text(json.dumps({
                    "request": job["request"], "model_dir": str(self.model_dir),
                    "store": str(self.store.root), "base_model": str(self.model_dir),
                    "max_model_len": self.max_model_len, "max_rank": self.max_rank,
                    "threads": self.threads}))
            except OSError as e:
                if job_dir is not None:
                    shutil.rmtree(job_dir, ignore_errors=True)
                if (full := full_disk(e, f"task {req.name!r} was not queued",
                                      self.store.root)) is not None:
                    return self._full(full)
                raise
            self.jobs[req.name] = job
        job["task"] = asyncio.create_task(self._run_job(req.name, job))
        return JSONResponse(status_code=202, content=self._job_view(req.name))

    async def _run_job(self, name: str, job: dict[str, Any]) -> None:
        """Run the worker, then publish and serve what it staged; a failure stays listed
        with its error until it is DELETEd. Its end in the audit log, under the key that
        asked for it."""
        await self._run_worker(name, job)
        await self._siblings_follow()
        result = ("failed" if job.get("state") == "failed"
                  else "served" if self.jobs.get(name) is not job and self._served(name)
                  else "deleted")
        store_operation("compile", {"served": "ok"}.get(result, result),
                        time.time() - job["t0"])
        if self.audit:
            await self._log("compiled", name, job.get("key"), job.get("client"),
                            result=result,
                            digest=self._held(name) if result == "served" else None,
                            seconds=round(time.time() - job["t0"], 1),
                            **({"error": self._public(str(job.get("error")))}
                               if result == "failed" else {}))

    async def _run_worker(self, name: str, job: dict[str, Any]) -> None:
        async with self.worker:
            if self.jobs.get(name) is not job:
                return  # deleted while queued (DELETE removed its files)
            job["state"] = "compiling"
            threads = str(self.threads)
            env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                   "TOKENIZERS_PARALLELISM": "false"}
            job["proc"] = proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", COMPILE_WORKER, str(job["dir"]), env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            await proc.wait()
        st = _read_status(job["dir"])
        staged = Path(job["dir"]) / ENTRY
        async with self.lock:
            if self.jobs.get(name) is not job:  # deleted while compiling: nothing published
                shutil.rmtree(job["dir"], ignore_errors=True)
                return
            if st.get("state") != "done" or not (staged / "entry.json").is_file():
                job["state"] = "failed"
                job["error"] = (st.get("error")
                                or f"the compile worker died (exit {proc.returncode})")
                shutil.rmtree(staged, ignore_errors=True)
                return
            try:  # the job stays listed until its entry is served: the name is never free
                _, failed = await self._publish(name, staged)
            except Exception as e:  # noqa: BLE001 - reported on the job, never half-served
                job["state"], job["error"] = "failed", f"could not publish: {e}"
                return
            if failed is not None:
                job["state"] = "failed"
                job["error"] = json.loads(failed.body)["error"]["message"]
                return
            del self.jobs[name]
        shutil.rmtree(job["dir"], ignore_errors=True)




def _read_status(job_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(job_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
