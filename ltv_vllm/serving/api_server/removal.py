"""DELETE /v1/ltv/tasks/NAME: a task unserved at once, its files removed once no request
that can still load them is queued or running. Runs in vLLM's API-server process (a part of
`endpoints.TaskEndpoints`)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from typing import Any

from ltv_vllm.serving.api_server.asgi import error_response as _error
from ltv_vllm.serving.store.shared_store import (
    StoreUnavailable,
)

logger = logging.getLogger("ltv_vllm.serving.api_server.endpoints")

# DELETE answers within this long (seconds; LTV_VLLM_DELETE_WAIT): 200 when the task's
# requests in flight are done and its files removed, else 202 (removed when they are done,
# however long that takes)
DELETE_WAIT_ENV = "LTV_VLLM_DELETE_WAIT"
DRAIN_SECONDS = 120.0

class Removal:
    """DELETE's part of the task endpoints."""

    async def _delete(self, name: str) -> Any:
        from ltv_vllm.serving.store.taskstore import StoreError

        async with self.lock:
            if name in self.jobs:  # a compile: stopped, and its files removed
                job = self.jobs.pop(name)
                if (proc := job.get("proc")) is not None and proc.returncode is None:
                    proc.kill()  # _run_job removes what it leaves
                else:  # queued (its runner returns at once) or failed: nothing else has it
                    shutil.rmtree(job["dir"], ignore_errors=True)
                return {"object": "ltv.task.deleted", "name": name, "deleted": True}
            if name in self.deleting:
                return _error(404, f"task {name!r} is being deleted", "NotFoundError", "name")
            unlisted = False  # taken out of the shared index by this DELETE
            if self.shared is not None:
                # the store first: every replica unserves it when it follows the index
                try:
                    idx = await asyncio.to_thread(self.shared.remove, name, self.replica)
                    self.published = max(self.published, idx.generation)
                    unlisted = True
                except StoreUnavailable as e:
                    return self._fail(503, e, "ServiceUnavailableError")
                except StoreError:
                    pass  # not in the store: this replica's copy decides below (another
                    # replica deleted it first: unserved here now, as it follows)
            try:
                await asyncio.to_thread(self.store.get, name)
            except StoreError as e:
                served = self._served(name)
                if unlisted and not served:
                    # in the store, not copied here (not yet, or skipped: an entry this
                    # replica cannot use): deleted all the same
                    return {"object": "ltv.task.deleted", "name": name, "deleted": True}
                why = (f"task {name!r} was given on the command line (--task-vector), not "
                       "compiled into the task store; restart without it" if served else e)
                return self._fail(409 if served else 404, why,
                                  "ConflictError" if served else "NotFoundError", "name")
            finish = await self._unserve(name)
            if not isinstance(finish, asyncio.Future):
                return finish or {"object": "ltv.task.deleted", "name": name, "deleted": True}
        # The removal runs to its end whatever happens to this request (a client that gives
        # up, a proxy's timeout): the name stays taken until the files are gone.
        try:
            await asyncio.wait_for(asyncio.shield(finish),
                                   float(os.environ.get(DELETE_WAIT_ENV) or DRAIN_SECONDS))
        except TimeoutError:
            # requests for it are still queued or running: it is unserved already, and its
            # files go when they are done (GET shows it as "deleting" until then)
            from fastapi.responses import JSONResponse

            return JSONResponse(status_code=202, content={
                "object": "ltv.task.deleted", "name": name, "deleted": False,
                "status": "deleting", "in_flight": self.registry.held(name)})
        return {"object": "ltv.task.deleted", "name": name, "deleted": True}

    async def _unserve(self, name: str) -> Any:
        """Stop serving the store entry NAME and remove it (under the lock): None when done
        (per-request tasks: the name is free at once; requests admitted with its key finish
        on its pin, removed after them); an error answer; or (LoRA mode) the future of the
        removal, which waits for the task's requests (the name is taken until it is done)."""
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        lora = self.models.lora_requests.get(name) if self.lora else None
        if lora is not None:  # no new request gets the task from here on
            await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        key = self.registry.unserve(name)  # per-request tasks: likewise
        self.digests.pop(name, None)
        if key is not None:
            # per-request tasks: the name is free at once (a new upload may take it), as
            # the entry goes now; requests admitted with the key finish on its pin, which
            # goes when they are done — a client that never reads its stream holds the
            # pin's few MB, not the name
            try:
                await asyncio.to_thread(self.store.remove, name)
            except Exception as e:  # noqa: BLE001 - unserved already; reported
                logger.error("ltv-vllm: task %r was unserved but its entry was not "
                             "removed: %s", name, self._public(str(e)))
                return self._fail(500, f"task {name!r} is no longer served, but its "
                                  f"files were not removed: {e}", "InternalServerError")
            unpin = asyncio.ensure_future(self._unpin_drained(key))
            self.removals.add(unpin)
            unpin.add_done_callback(self.removals.discard)
            return None
        self.deleting.add(name)
        finish = asyncio.ensure_future(self._remove_drained(name, lora))
        self.removals.add(finish)
        finish.add_done_callback(self.removals.discard)
        return finish

    async def _remove_drained(self, name: str, lora: Any) -> None:
        """Remove an unserved task's adapter and files once no request that can still load
        them is queued or running: no deadline, since an engine that reads a removed file
        dies (docs/task-store.md, "No request can stop the engine")."""
        try:
            # every request admitted with the task is counted by the gate until its handler
            # returns (a cancelled one has sent its abort to the engine by then)
            await self.registry.drained(name)
            # then one round trip through the engine core and every worker, behind each abort
            # and each step already sent to them: no step after it can load the task
            await self._barrier()
            if lora is not None:
                # vLLM's unload only forgets the name: the engine keeps the adapter
                try:
                    await self.engine.remove_lora(lora.lora_int_id)
                except Exception as e:  # noqa: BLE001 - the name is unserved already; an
                    # adapter left in the engine is never used again (engine.fixes)
                    logger.warning("ltv-vllm: adapter of deleted task %r stays in the "
                                   "engine: %s", name, e)
            await asyncio.to_thread(self.store.remove, name)
        except Exception as e:  # noqa: BLE001 - logged; the entry stays unserved until restart
            logger.error("ltv-vllm: task %r was unserved but its files were not removed: %s",
                         name, self._public(str(e)))
        finally:
            self.deleting.discard(name)

    async def _unpin_drained(self, key: str) -> None:
        """Remove a deleted task's pin once no request admitted with its key is queued or
        running (the gate counts them by key), after a round trip through the engine (no
        step sent before can load it later); kept if the same key is served again
        meanwhile (the same name and bytes uploaded again)."""
        try:
            await self.registry.drained(key)
            await self._barrier()
            async with self.lock:
                if key not in self.registry.keys.values() and self.registry.held(key) == 0:
                    await asyncio.to_thread(self.store.unpin, key)
        except Exception as e:  # noqa: BLE001 - logged; a restart sweeps pins
            logger.error("ltv-vllm: the pin of a deleted task was not removed: %s",
                         self._public(str(e)))

    async def _barrier(self) -> None:
        """Wait until the engine core and its workers have done everything sent before."""
        try:
            await self.engine.collective_rpc("check_health")
        except Exception as e:  # noqa: BLE001 - a dead engine loads nothing either
            logger.warning("ltv-vllm: engine barrier failed: %s", e)
