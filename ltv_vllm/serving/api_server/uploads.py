"""POST /v1/ltv/tasks with a task-vector file: checked, staged, published (a shared store
first) and served, or rolled back with nothing left behind. Runs in vLLM's API-server
process (a part of `endpoints.TaskEndpoints`)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ltv_vllm.serving.api_server.asgi import error_response as _error
from ltv_vllm.serving.api_server.asgi import media_type
from ltv_vllm.serving.api_server.tenancy import outside
from ltv_vllm.serving.contract.wire import served_template, task_key
from ltv_vllm.serving.store.shared_store import (
    StoreUnavailable,
)

logger = logging.getLogger("ltv_vllm.serving.api_server.endpoints")


class Uploads:
    """Uploads and publishing: their part of the task endpoints."""

    async def _upload(self, request: Any) -> Any:
        from ltv_vllm.errors import UserError
        from ltv_vllm.serving.store.taskstore import StoreFull, check_name

        if media_type(request.headers.get("content-type", "")) != "multipart/form-data":
            return _error(415, "POST /v1/ltv/tasks takes a compile request (application/json) "
                               "or multipart/form-data with a `name` and a task-vector file "
                               "`vector`", "BadRequestError")
        try:  # the body is whole and within the upload limit (api_server.gate)
            form = await request.form(max_files=1, max_fields=4)
        except Exception as e:  # noqa: BLE001 - starlette's parser: malformed multipart
            return self._fail(400, f"malformed multipart body: {e}", "BadRequestError")
        unknown = sorted(set(form) - {"name", "vector"})
        if unknown:
            return _error(400, f"unknown field {unknown[0][:64]!r}; send `name` and `vector`",
                          "BadRequestError", unknown[0][:64])
        name, upload = form.get("name"), form.get("vector")
        if not isinstance(name, str) or upload is None or isinstance(upload, str):
            return _error(400, "send a `name` field and a task-vector file `vector`",
                          "BadRequestError")
        if (out := outside(request, name)) is not None:
            return out
        try:
            check_name(name)
        except UserError as e:
            return _error(400, str(e), "BadRequestError", "name")
        if (stale := await self._fresh()) is not None:
            return stale
        async with self.lock:  # a cheap early answer; checked again before publishing
            if (taken := self._taken(name)) is not None:
                return taken
        data = await upload.read()
        try:  # heavy work (parse, rank cut, adapter export) outside the lock
            staged = await asyncio.to_thread(self._stage_upload, name, data)
        except StoreFull as e:
            return self._full(e)
        except UserError as e:
            return self._fail(422, e, "UnprocessableEntityError", "vector")
        return await self._publish_and_serve(name, staged, created=True)

    def _stage_upload(self, name: str, data: bytes) -> Path:
        """The uploaded bytes as a staged entry (never unpickled: safetensors, or torch.load
        with weights_only); `stage` checks it against the served model."""
        from ltv_vllm.core.layer_task import LayerTask, load_any
        from ltv_vllm.core.vector import TaskVector, VectorError
        from ltv_vllm.core.vector_files import sniff_suffix
        from ltv_vllm.serving.store.lora import VLLM_LORA_RANKS
        from ltv_vllm.serving.store.taskstore import chat_template_of, full_disk

        with tempfile.TemporaryDirectory(dir=self.store.root, prefix=".up-") as d:
            path = Path(d) / f"upload{sniff_suffix(data)}"
            try:
                path.write_bytes(data)
            except OSError as e:
                if (full := full_disk(e, "the upload was not read", self.store.root)) is None:
                    raise
                raise full from e
            tv = load_any(path)
        if isinstance(tv, LayerTask) and not self.layers:
            raise VectorError("a layer task: this server's engine was started without the "
                              "hooks layer tasks shift through; start it with "
                              "--layer-uploads (per-request tasks, --multi-task shift)")
        fitted, served = chat_template_of(tv), served_template()
        if fitted is not None and fitted != served:
            raise VectorError(f"a chat-fitted vector: fitted through chat template sha256 "
                              f"{fitted[:12]}, and this server renders chat with "
                              f"{served[:12] or 'no template'}; extract it with --chat-template "
                              "set to the server's")
        if isinstance(tv, TaskVector) and tv.rank > VLLM_LORA_RANKS[-1]:
            raise VectorError(f"rank {tv.rank}: an upload may have rank {VLLM_LORA_RANKS[-1]} "
                              f"at most (vLLM's largest LoRA rank); this server serves rank "
                              f"{self.max_rank} (higher ranks are cut to it)")
        return self.store.stage(name, tv, self.model_dir, source="uploaded",
                                rank=self.max_rank, base_model=str(self.model_dir))

    async def _publish_and_serve(self, name: str, staged: Path, *, created: bool) -> Any:
        """Publish a staged entry and serve it, or roll both back (under the lock)."""
        from fastapi.responses import JSONResponse

        async with self.lock:
            if (taken := self._taken(name)) is not None:
                shutil.rmtree(staged, ignore_errors=True)
                return taken
            entry, failed = await self._publish(name, staged)
            if failed is not None:
                return failed
            view = self._view(entry)
        return JSONResponse(status_code=201 if created else 200, content=view)

    async def _publish(self, name: str, staged: Path) -> tuple[Any, Any]:
        """(entry, None) when the staged entry is published and served, else (None, the error
        answer), nothing left behind (under the lock). With a shared store the name is
        published there first (its one winner among the replicas), then here; a failure here
        takes it out of the shared index again."""
        from ltv_vllm.serving.store.taskstore import VECTOR, StoreError

        digest = None
        if self.shared is not None:
            try:
                data = await asyncio.to_thread((staged / VECTOR).read_bytes)
                record = json.loads(await asyncio.to_thread((staged / "entry.json").read_text))
                digest = await asyncio.to_thread(self.shared.put_vector, data)
                idx = await asyncio.to_thread(self.shared.add, name, digest, record,
                                              self.replica)
                self.published = max(self.published, idx.generation)
            except StoreError as e:
                shutil.rmtree(staged, ignore_errors=True)
                if isinstance(e, StoreUnavailable):
                    return None, self._fail(503, e, "ServiceUnavailableError")
                return None, self._fail(409, e, "ConflictError", "name")
        try:
            entry = await asyncio.to_thread(self.store.publish, staged, name)
        except StoreError as e:
            await self._unpublish(name, digest)
            return None, self._fail(409, e, "ConflictError", "name")
        if (failed := await self._serve(entry)) is not None:
            await self._unpublish(name, digest)
            return None, failed
        if digest is not None:
            self.digests[name] = digest
        return entry, None

    async def _unpublish(self, name: str, digest: str | None) -> None:
        """A rollback: NAME out of the shared index, if it still holds this vector."""
        from ltv_vllm.serving.store.taskstore import StoreError

        if digest is None:
            return
        try:
            await asyncio.to_thread(self.shared.remove, name, self.replica, digest)
        except StoreError as e:
            logger.error("ltv-vllm: task %r could not be taken back out of the task store: "
                         "%s", name, self._public(str(e)))

    async def _serve(self, entry: Any) -> Any:
        """Serve the entry: by key (per-request tasks; the engine loads it on first use), or
        its adapter loaded into the engine; on failure the entry is removed again (call under
        the lock)."""
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        from ltv_vllm.errors import UserError
        from ltv_vllm.serving.store.taskstore import vector_digest

        try:
            chat = await asyncio.to_thread(entry.chat_template)
            digest = (await asyncio.to_thread(vector_digest, entry.vector_path)
                      if not self.lora else "")
        except (OSError, UserError) as e:
            await asyncio.to_thread(self.store.remove, entry.name)
            return self._fail(500, f"task {entry.name!r} does not read: {e}",
                              "InternalServerError")
        self.registry.fitted_chat(entry.name, chat)  # known to the gate before any request
        if not self.lora:
            key = task_key(entry.name, digest)
            try:  # the engines load the key's pin, made before any request can name it
                await asyncio.to_thread(self.store.pin, entry, key)
            except (OSError, UserError) as e:
                self.registry.fitted_chat(entry.name, None)
                await asyncio.to_thread(self.store.remove, entry.name)
                return self._fail(500, f"task {entry.name!r} could not be pinned: {e}",
                                  "InternalServerError")
            self.registry.serve(entry.name, key, entry.layer)
            return None
        try:
            res = await self.models.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=entry.name, lora_path=str(entry.path)))
        except Exception as e:  # noqa: BLE001 - rolled back and reported, the server stays up
            res = e
        if isinstance(res, str):
            return None
        self.registry.fitted_chat(entry.name, None)
        await asyncio.to_thread(self.store.remove, entry.name)
        message = getattr(getattr(res, "error", None), "message", str(res))
        return self._fail(500, f"vLLM could not load task {entry.name!r}: {message}",
                          "InternalServerError")
