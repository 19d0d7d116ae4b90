"""`/v1/ltv/tasks`: the task store of a running server, as a vLLM endpoint plugin.

Registered under `vllm.endpoint_plugins` (name `ltv_tasks`); vLLM attaches an endpoint
plugin's routes to its own OpenAI app only when the plugin is named in `VLLM_PLUGINS`, which
`ltv-vllm serve --task-store` sets. The routes live under `/v1`, so vLLM's `--api-key`
guards them like its own. A task enters vLLM through its runtime LoRA loading
(`OpenAIServingModels.load_lora_adapter`, the handler behind `/v1/load_lora_adapter`),
called in process: vLLM's public load/unload routes stay off, so a client cannot make the
server load an arbitrary path.

    GET    /v1/ltv/tasks          every task in the store, and the compiles under way
    GET    /v1/ltv/tasks/{name}   one task (status: queued, compiling, ready, failed)
    POST   /v1/ltv/tasks          JSON: a compile request (`ltv_vllm.compile`): checked, then
                                  202 and compiled by a worker process; served when ready
                                  multipart: `name` and a task-vector file `vector`
                                  → checked against the model, stored, served: 201
    DELETE /v1/ltv/tasks/{name}   unserved and removed (a compile: stopped): 200

A compile runs in `python -m ltv_vllm.compile JOB_DIR` (transformers on the served model's
directory, one thread, so the engine keeps the other cores), one at a time; the job's files
live in ROOT/.jobs/ and the entry appears only when complete (`taskstore`). Until then the
task's name is not served: a request for it gets vLLM's 404, never another task's shift.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# module level: FastAPI resolves the handlers' (postponed) annotations in this namespace
from fastapi import APIRouter, Request

MAX_UPLOAD = 1 << 30  # bytes: a float32 vector of rank 256 on an 8k model is ~16 MiB


def _error(status: int, message: str, err_type: str, param: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": err_type, "param": param, "code": status}})


def _full(e: Exception) -> Any:
    # 507 Insufficient Storage: the request was fine, the server's disk was not
    return _error(507, str(e), "InsufficientStorageError")


class TaskEndpoints:
    """The endpoint plugin (vLLM instantiates it with no arguments)."""

    name = "ltv_tasks"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.store: Any = None
        self.model_dir: Path | None = None
        self.models: Any = None  # vLLM's OpenAIServingModels
        self.max_tasks = 8
        self.max_rank = 256
        self.lock = asyncio.Lock()  # one store change at a time
        self.jobs: dict[str, dict[str, Any]] = {}  # name → compile job (until it is served)
        self.worker = asyncio.Semaphore(1)  # one compile at a time
        self.tokenizer: Any = None
        self.max_model_len = 0

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from ..taskstore import TaskStore

        root = os.environ.get("LTV_VLLM_TASK_STORE")
        if engine_client is None or not root:
            return  # not a task-store server: the routes answer 404
        self.store = TaskStore(root)
        self.model_dir = Path(args.model)
        self.models = state.openai_serving_models
        self.max_tasks = int(os.environ.get("LTV_VLLM_MAX_TASKS", "8"))
        self.max_rank = int(os.environ.get("LTV_VLLM_TASK_RANK", "256"))
        self.threads = int(os.environ.get("LTV_VLLM_COMPILE_THREADS", "1"))
        self.max_model_len = int(self.models.model_config.max_model_len)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        # compiles do not outlive their server: what a previous one left is dropped
        shutil.rmtree(self.store.root / ".jobs", ignore_errors=True)
        (self.store.root / ".jobs").mkdir()

    def attach_router(self, app: Any) -> None:
        router = APIRouter()

        @router.get("/v1/ltv/tasks")
        async def list_tasks() -> Any:
            if (off := self._off()) is not None:
                return off
            entries = await asyncio.to_thread(self.store.entries)
            return {"object": "list", "data": [self._view(e) for e in entries]
                    + [self._job_view(n) for n in sorted(self.jobs)]}

        @router.get("/v1/ltv/tasks/{name}")
        async def get_task(name: str) -> Any:
            if (off := self._off()) is not None:
                return off
            return await self._entry_or_error(name)

        @router.delete("/v1/ltv/tasks/{name}")
        async def delete_task(name: str) -> Any:
            if (off := self._off()) is not None:
                return off
            return await self._delete(name)

        @router.post("/v1/ltv/tasks")
        async def add_task(request: Request) -> Any:
            if (off := self._off()) is not None:
                return off
            if request.headers.get("content-type", "").startswith("application/json"):
                return await self._compile(request)
            return await self._upload(request)

        app.include_router(router)

    # -- handlers ----------------------------------------------------------------------------
    def _off(self) -> Any:
        if self.store is None:
            return _error(404, "this server has no task store (start it with "
                               "`ltv-vllm serve --task-store`)", "NotFoundError")
        return None

    def _view(self, entry: Any) -> dict[str, Any]:
        return {**entry.record, "object": "ltv.task", "status": "ready",
                "served": entry.name in self.models.lora_requests}

    def _job_view(self, name: str) -> dict[str, Any]:
        job = self.jobs[name]
        st = _read_status(job["dir"])
        state = job["state"]
        phase = st.get("state") if state == "compiling" else None
        return {"object": "ltv.task", "name": name, "status": state, "phase": phase,
                "source": "compiled", "served": False, "error": job.get("error"),
                "seconds": round(time.time() - job["t0"], 1),
                "k": len(job["request"]["demos"]), "n": len(job["request"]["queries"])}

    async def _entry_or_error(self, name: str) -> Any:
        from ..taskstore import StoreError

        if name in self.jobs:
            return self._job_view(name)
        try:
            entry = await asyncio.to_thread(self.store.get, name)
        except StoreError as e:
            return _error(404, str(e), "NotFoundError", "name")
        return self._view(entry)

    async def _delete(self, name: str) -> Any:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        from ..taskstore import StoreError

        async with self.lock:
            if name in self.jobs:  # a compile: stopped, and its files removed
                job = self.jobs.pop(name)
                if (proc := job.get("proc")) is not None and proc.returncode is None:
                    proc.kill()  # _run_job removes what it leaves
                elif job["state"] == "failed":
                    shutil.rmtree(job["dir"], ignore_errors=True)
                return {"object": "ltv.task.deleted", "name": name, "deleted": True}
            try:
                await asyncio.to_thread(self.store.get, name)
            except StoreError as e:
                served = name in self.models.lora_requests
                why = (f"task {name!r} was given on the command line (--task-vector), not "
                       "compiled into the task store; restart without it" if served else str(e))
                return _error(409 if served else 404, why,
                              "ConflictError" if served else "NotFoundError", "name")
            if name in self.models.lora_requests:
                await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
            await asyncio.to_thread(self.store.remove, name)
        return {"object": "ltv.task.deleted", "name": name, "deleted": True}

    async def _upload(self, request: Any) -> Any:
        from ..errors import UserError
        from ..taskstore import StoreFull, check_name

        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            return _error(415, "POST /v1/ltv/tasks takes a compile request (application/json) "
                               "or multipart/form-data with a `name` and a task-vector file "
                               "`vector`", "BadRequestError")
        if int(request.headers.get("content-length") or 0) > MAX_UPLOAD:
            return _error(413, f"upload over {MAX_UPLOAD >> 20} MiB", "BadRequestError",
                          "vector")
        try:
            form = await request.form(max_files=1, max_fields=4)
        except Exception as e:  # starlette's parser: malformed multipart bodies
            return _error(400, f"malformed multipart body: {e}", "BadRequestError")
        unknown = sorted(set(form) - {"name", "vector"})
        if unknown:
            return _error(400, f"unknown field {unknown[0]!r}; send `name` and `vector`",
                          "BadRequestError", unknown[0])
        name, upload = form.get("name"), form.get("vector")
        if not isinstance(name, str) or upload is None or isinstance(upload, str):
            return _error(400, "send a `name` field and a task-vector file `vector`",
                          "BadRequestError")
        try:
            check_name(name)
        except UserError as e:
            return _error(400, str(e), "BadRequestError", "name")
        data = await upload.read()
        try:
            tv = await asyncio.to_thread(self._parse_upload, data)
        except StoreFull as e:
            return _full(e)
        except UserError as e:
            return _error(422, str(e), "UnprocessableEntityError", "vector")
        async with self.lock:
            if (taken := self._taken(name)) is not None:
                return taken
            rank = self.max_rank if tv.rank > self.max_rank else None  # vLLM's rank is fixed
            try:
                entry = await asyncio.to_thread(
                    self.store.add, name, tv, self.model_dir, source="uploaded", rank=rank,
                    base_model=str(self.model_dir))
            except StoreFull as e:
                return _full(e)
            except UserError as e:
                return _error(409 if "exists" in str(e) else 422, str(e), "BadRequestError")
            if (failed := await self._serve(entry)) is not None:
                return failed
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=201, content=self._view(entry))

    def _taken(self, name: str) -> Any:
        """409 when the name is in use or the server is full (call under the lock)."""
        if (name in self.models.lora_requests or name in self.jobs
                or (self.store.root / name).exists()):
            return _error(409, f"task {name!r} exists; DELETE it first", "ConflictError",
                          "name")
        if len(self.store.names()) + len(self.jobs) >= self.max_tasks:
            return _error(409, f"the server holds {self.max_tasks} tasks (--max-tasks); "
                               "DELETE one first", "ConflictError")
        return None

    async def _compile(self, request: Any) -> Any:
        from ..compile import parse_request
        from ..errors import UserError
        from ..taskstore import full_disk

        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return _error(400, f"malformed JSON: {e}", "BadRequestError")
        try:
            req = await asyncio.to_thread(parse_request, body, tokenizer=self.tokenizer,
                                          max_model_len=self.max_model_len)
        except UserError as e:
            return _error(400, str(e), "BadRequestError")
        async with self.lock:
            if (taken := self._taken(req.name)) is not None:
                return taken
            job_dir = None
            try:
                job_dir = Path(tempfile.mkdtemp(prefix=f"{req.name}-",
                                                dir=self.store.root / ".jobs"))
                job = {"dir": job_dir, "state": "queued", "t0": time.time(),
                       "request": req.to_dict(), "id": job_dir.name}
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
                    return _full(full)
                raise
            self.jobs[req.name] = job
        job["task"] = asyncio.create_task(self._run_job(req.name, job))
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=202, content=self._job_view(req.name))

    async def _run_job(self, name: str, job: dict[str, Any]) -> None:
        """Run the worker, then serve what it stored; a failure stays listed with its error
        until it is DELETEd."""
        async with self.worker:
            if self.jobs.get(name) is not job:
                return  # deleted while queued
            job["state"] = "compiling"
            threads = str(self.threads)
            env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                   "TOKENIZERS_PARALLELISM": "false"}
            job["proc"] = proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ltv_vllm.compile", str(job["dir"]), env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            await proc.wait()
        st = _read_status(job["dir"])
        async with self.lock:
            if self.jobs.get(name) is not job:  # deleted while compiling: remove any entry
                if st.get("state") == "done":
                    await asyncio.to_thread(self.store.remove, name)
                shutil.rmtree(job["dir"], ignore_errors=True)
                return
            if st.get("state") != "done":
                job["state"] = "failed"
                job["error"] = (st.get("error")
                                or f"the compile worker died (exit {proc.returncode})")
                return
            entry = await asyncio.to_thread(self.store.get, name)
            if (failed := await self._serve(entry)) is not None:
                job["state"] = "failed"
                job["error"] = json.loads(failed.body)["error"]["message"]
                return
            del self.jobs[name]
        shutil.rmtree(job["dir"], ignore_errors=True)

    def _parse_upload(self, data: bytes) -> Any:
        """The uploaded bytes as a task-vector file (never unpickled: safetensors, or
        torch.load with weights_only), checked against the served model."""
        from ..checkpoint import identity_from_dir
        from ..taskstore import full_disk
        from ..vector import load_task_vector
        from .lora import refuse_non_lora

        suffix = ".pt" if data[:2] == b"PK" else ".safetensors"  # a .pt file is a zip
        with tempfile.TemporaryDirectory(dir=self.store.root, prefix=".up-") as d:
            path = Path(d) / f"upload{suffix}"
            try:
                path.write_bytes(data)
            except OSError as e:
                if (full := full_disk(e, "the upload was not read", self.store.root)) is None:
                    raise
                raise full from e
            tv = load_task_vector(path)
        tv.check_model(identity_from_dir(self.model_dir))
        refuse_non_lora(tv)
        return tv

    async def _serve(self, entry: Any) -> Any:
        """Load the entry's adapter into the engine; on failure the entry is removed again."""
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        res = await self.models.load_lora_adapter(
            LoadLoRAAdapterRequest(lora_name=entry.name, lora_path=str(entry.path)))
        if isinstance(res, str):
            return None
        await asyncio.to_thread(self.store.remove, entry.name)
        message = getattr(getattr(res, "error", None), "message", str(res))
        return _error(500, f"vLLM could not load task {entry.name!r}: {message}",
                      "InternalServerError")


def _read_status(job_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(job_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
