"""`/v1/ltv/tasks`: the task store of a running server, as a vLLM endpoint plugin.

Registered under `vllm.endpoint_plugins` (name `ltv_tasks`); vLLM attaches an endpoint
plugin's routes to its own OpenAI app only when the plugin is named in `VLLM_PLUGINS`, which
`ltv-vllm serve --task-store` sets. The routes live under `/v1`, so vLLM's `--api-key`
guards them like its own. A task enters vLLM through its runtime LoRA loading
(`OpenAIServingModels.load_lora_adapter`, the handler behind `/v1/load_lora_adapter`),
called in process: vLLM's public load/unload routes stay off, so a client cannot make the
server load an arbitrary path.

    GET    /v1/ltv/tasks          every task in the store (and whether it is served)
    GET    /v1/ltv/tasks/{name}   one task
    POST   /v1/ltv/tasks          multipart: `name` and a task-vector file `vector`
                                  → checked against the model, stored, served: 201
    DELETE /v1/ltv/tasks/{name}   unserved and removed: 200
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

# module level: FastAPI resolves the handlers' (postponed) annotations in this namespace
from fastapi import APIRouter, Request

MAX_UPLOAD = 1 << 30  # bytes: a float32 vector of rank 256 on an 8k model is ~16 MiB


def _error(status: int, message: str, err_type: str, param: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": err_type, "param": param, "code": status}})


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

    def attach_router(self, app: Any) -> None:
        router = APIRouter()

        @router.get("/v1/ltv/tasks")
        async def list_tasks() -> Any:
            if (off := self._off()) is not None:
                return off
            entries = await asyncio.to_thread(self.store.entries)
            return {"object": "list", "data": [self._view(e) for e in entries]}

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

    async def _entry_or_error(self, name: str) -> Any:
        from ..taskstore import StoreError

        try:
            entry = await asyncio.to_thread(self.store.get, name)
        except StoreError as e:
            return _error(404, str(e), "NotFoundError", "name")
        return self._view(entry)

    async def _delete(self, name: str) -> Any:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        from ..taskstore import StoreError

        async with self.lock:
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
        from ..taskstore import check_name

        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            return _error(415, "POST /v1/ltv/tasks takes multipart/form-data with a `name` and "
                               "a task-vector file `vector`", "BadRequestError")
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
        except UserError as e:
            return _error(422, str(e), "UnprocessableEntityError", "vector")
        async with self.lock:
            if name in self.models.lora_requests or (self.store.root / name).exists():
                return _error(409, f"task {name!r} exists; DELETE it first", "ConflictError",
                              "name")
            if len(self.store.names()) >= self.max_tasks:
                return _error(409, f"the server holds {self.max_tasks} tasks (--max-tasks); "
                                   "DELETE one first", "ConflictError")
            rank = self.max_rank if tv.rank > self.max_rank else None  # vLLM's rank is fixed
            try:
                entry = await asyncio.to_thread(
                    self.store.add, name, tv, self.model_dir, source="uploaded", rank=rank,
                    base_model=str(self.model_dir))
            except UserError as e:
                return _error(409 if "exists" in str(e) else 422, str(e), "BadRequestError")
            if (failed := await self._serve(entry)) is not None:
                return failed
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=201, content=self._view(entry))

    def _parse_upload(self, data: bytes) -> Any:
        """The uploaded bytes as a task-vector file (never unpickled: safetensors, or
        torch.load with weights_only), checked against the served model."""
        from ..checkpoint import identity_from_dir
        from ..vector import load_task_vector
        from .lora import refuse_bias

        suffix = ".pt" if data[:2] == b"PK" else ".safetensors"  # a .pt file is a zip
        with tempfile.TemporaryDirectory(dir=self.store.root, prefix=".up-") as d:
            path = Path(d) / f"upload{suffix}"
            path.write_bytes(data)
            tv = load_task_vector(path)
        tv.check_model(identity_from_dir(self.model_dir))
        refuse_bias(tv)
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
