"""`/v1/ltv/tasks`: the task store of a running server, as a vLLM endpoint plugin.

Registered under `vllm.endpoint_plugins` (name `ltv_tasks`); vLLM attaches an endpoint
plugin's routes to its own OpenAI app only when the plugin is named in `VLLM_PLUGINS`, which
`ltv-vllm serve --task-store` sets. The routes live under `/v1`, so vLLM's `--api-key`
guards them like its own. A task enters vLLM through its runtime LoRA loading
(`OpenAIServingModels.load_lora_adapter`, the handler behind `/v1/load_lora_adapter`),
called in process: vLLM's public load/unload routes stay off, so a client cannot make the
server load an arbitrary path.

    GET    /v1/ltv/tasks          every task in the store, and the compiles under way
    GET    /v1/ltv/tasks/{name}   one task (status: queued, compiling, ready, failed,
                                  deleting)
    POST   /v1/ltv/tasks          JSON: a compile request (`serving.compile`): checked, then
                                  202 and compiled by a worker process; served when ready
                                  multipart: `name` and a task-vector file `vector`
                                  → checked against the model, stored, served: 201
    DELETE /v1/ltv/tasks/{name}   unserved and removed (a compile: stopped): 200, the name
                                  free at once (per-request tasks: the requests in flight
                                  finish on the key's pin, removed after them); LoRA mode:
                                  200, or 202 when its requests outlast DRAIN_SECONDS

A compile runs in `python -m ltv_vllm.serving.compile JOB_DIR` (transformers on the served model's
directory, one thread, so the engine keeps the other cores), one at a time; the worker only
*stages* the entry in ROOT/.jobs/ID/entry. This process alone publishes entries (one rename)
and serves them, under one lock, so the store's invariants (docs/task-store.md) hold whatever
dies when:

- a published entry is served by this server, or rolled back (removed) before the request
  that made it is answered; a worker that dies leaves nothing in the store;
- until an entry is served its name is not: a request for it gets vLLM's 404, never another
  task's shift; DELETE unserves the name first; per-request tasks are loaded from a pin
  (`TaskStore.pin`, by engine key), removed only after the requests admitted with that key
  (`middleware.in_flight`, with no deadline) and a round trip through the engine; in LoRA
  mode DELETE waits for them, removes the adapter from the engine, then the files: no
  engine process reads a file after it is removed;
- a name is in one state only: queued / compiling / failed (a job), ready (an entry), or
  deleting.

Authentication and body limits come before this code (`middleware.Gate`). Error messages
name no server path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# module level: FastAPI resolves the handlers' (postponed) annotations in this namespace
from fastapi import APIRouter, Request

from ltv_vllm.serving.compile import ENTRY
from ltv_vllm.serving.settings import ServerSettings
from ltv_vllm.serving.shared_store import SCHEMES, SKIPS, StoreUnavailable, several_api_servers
from ltv_vllm.serving.step_policy import (
    RUNTIME,
    RUNTIME_CHAT,
    named_tasks,
    served_template,
    task_key,
)
from ltv_vllm.serving.vllm_ext import middleware
from ltv_vllm.serving.vllm_ext.metrics import store_operation
from ltv_vllm.serving.vllm_ext.middleware import TASKS_PATH, drained, in_flight, media_type

logger = logging.getLogger(__name__)
# a request naming a task this replica does not serve waits this long (seconds) for the
# shared store's index and the task's copy (LTV_VLLM_RESOLVE_WAIT), then is answered 503
RESOLVE_WAIT_ENV = "LTV_VLLM_RESOLVE_WAIT"
RESOLVE_SECONDS = 10.0
# DELETE answers within this long (seconds; LTV_VLLM_DELETE_WAIT): 200 when the task's
# requests in flight are done and its files removed, else 202 (removed when they are done,
# however long that takes)
DELETE_WAIT_ENV = "LTV_VLLM_DELETE_WAIT"
DRAIN_SECONDS = 120.0
# several API-server processes of one replica: how often each looks whether another changed
# the shared index (a local file's stat), so they serve the same tasks within about this long
NUDGE_SECONDS = 0.1


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
        self.lora = False  # store tasks as LoRA adapters (else by key, `step_policy.RUNTIME`)
        self.jobs: dict[str, dict[str, Any]] = {}  # name → compile job (until it is served)
        self.deleting: set[str] = set()  # names being drained and removed (taken meanwhile)
        self.removals: set[asyncio.Future] = set()  # their removals (held: never collected)
        self.worker = asyncio.Semaphore(1)  # one compile at a time
        self.tokenizer: Any = None
        self.max_model_len = 0
        # a store many replicas share (`serving.shared_store`), followed: None when the store
        # is this server's alone
        self.shared: Any = None
        self.replica = f"{socket.gethostname()}:{os.getpid()}"  # who wrote an index generation
        self.poll = 2.0
        self.seen = -1  # the shared index generation this replica serves
        self.listed: dict[str, dict[str, Any]] = {}  # ...and its tasks (name → digest, record)
        # ...and the index entries it does not serve (`Index.servable`): a valid name → why
        # (listed on /v1/models in the slots --max-tasks leaves), how many for each reason
        # (the metric), and the generation whose skips were logged (once each)
        self.skipped: dict[str, str] = {}
        self.skip_counts: dict[str, int] = dict.fromkeys(SKIPS, 0)
        self.skips_logged = -1
        self.bad_dirs: set[str] = set()  # entry directories of this server's that did not read
        self.digests: dict[str, str] = {}  # store tasks served here → their vector's sha256
        self.unservable: dict[str, tuple[str, str]] = {}  # name → (digest, why not served)
        self.following: asyncio.Future | None = None
        self.followed_at = 0.0
        self.outage: str | None = None  # the store's last failure, logged once
        self.audit: str | None = None  # the audit log's file ("-": stderr; None: none)
        # the other API-server processes of this replica (`shared_store.Siblings`), if any,
        # and the newest index generation this process wrote (they follow it before a
        # change of its is answered)
        self.siblings: Any = None
        self.published = -1

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from ltv_vllm.serving.deploy import required_problem
        from ltv_vllm.serving.taskstore import StoreError, TaskStore, vector_digest

        settings = ServerSettings.from_env()
        if settings.required and (problem := required_problem(args, settings.required)):
            # a launcher's flag replaced one of ltv-vllm's: tasks would be served unshifted
            logger.error("ltv-vllm: %s", problem)
            raise RuntimeError(f"ltv-vllm: {problem}")
        if engine_client is not None and (settings.selfcheck or settings.selfcheck_lora):
            await self._selfcheck(engine_client, args, settings.selfcheck_lora)
        if engine_client is not None and settings.task_metrics:
            # after the self-check: its probe requests are not traffic
            from ltv_vllm.serving.vllm_ext.metrics import instrument

            names = getattr(args, "served_model_name", None) or [args.model]
            instrument(engine_client, str(names[0]))
        root = settings.task_store
        if engine_client is None or not root:
            return  # not a task-store server: the routes answer 404
        if (getattr(args, "api_server_count", None) or 1) > 1:
            if problem := several_api_servers(bool(settings.shared_store),
                                              settings.store_lora):
                logger.error("ltv-vllm: %s", problem)
                raise RuntimeError(f"ltv-vllm: {problem}")
            # one of several API-server processes: entries of its own, pins shared with
            # the others (their one engine loads them), each following the shared store
            from ltv_vllm.serving.shared_store import Siblings
            from ltv_vllm.serving.taskstore import PINS

            self.store = TaskStore(Path(root) / f".api-{os.getpid()}", pins=Path(root) / PINS)
            self.siblings = Siblings(Path(root))
        else:
            self.store = TaskStore(root)
        self.model_dir = Path(args.model)
        self.models = state.openai_serving_models
        self.engine = engine_client
        self.max_tasks = settings.max_tasks
        self.max_rank = settings.task_rank
        self.lora = settings.store_lora
        self.threads = settings.compile_threads
        self.audit = settings.audit_log
        self.max_model_len = int(self.models.model_config.max_model_len)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if settings.shared_store:
            from ltv_vllm.serving.shared_store import SharedStore

            self.shared = SharedStore(settings.shared_store, create=False)
            self.poll = settings.store_poll
        # compiles do not outlive their server: what a previous one left is dropped
        shutil.rmtree(self.store.root / ".jobs", ignore_errors=True)
        (self.store.root / ".jobs").mkdir()
        for entry in self.store.readable():  # what `serve` kept
            if not self.lora:  # per-request tasks: served by key, from its pin
                key = task_key(entry.name, vector_digest(entry.vector_path))
                self.store.pin(entry, key)
                RUNTIME[entry.name] = key
            if (digest := entry.chat_template()) is not None:
                RUNTIME_CHAT[entry.name] = digest  # the gate shifts its chat requests
        if self.shared is not None:
            # the store's tasks served before the server answers anything; then followed
            try:
                await self._follow()
            except StoreError as e:
                self._outage(e)
            except Exception:  # noqa: BLE001 - a replica always starts (it serves what it
                # holds, and follows again at its next poll); logged
                logger.exception("ltv-vllm: following the task store failed")
            self.poller = asyncio.create_task(self._poll())
            middleware.resolver = self.resolve
        middleware.listing = self.listing
        if self.audit:
            middleware.auditor = self._audit_refusal
        _register_residency(self)

    async def _selfcheck(self, engine_client: Any, args: Any,
                         lora: dict[str, str] | None) -> None:
        """Before the server answers anything: the probe tasks the engine holds (or, `lora`,
        the probe adapters), mixed with bare rows, each row checked (`serving.selfcheck`); a
        wrong row stops the start with its one line (SelfCheckFailed)."""
        from ltv_vllm.serving.probes import PROBES, SERVED_PREFIX
        from ltv_vllm.serving.selfcheck import engine_selfcheck

        names = {p: SERVED_PREFIX + p for p in PROBES}
        out = await engine_selfcheck(engine_client, args.model, names, lora)
        # vLLM configures its own loggers only: printed, as the start-up line it is
        print(f"ltv-vllm: selfcheck passed on {out['where']}: {out['rows']} rows, "
              f"{out['tokens']} tokens, in {out['check_seconds']:.2f} s", file=sys.stderr,
              flush=True)

    def attach_router(self, app: Any) -> None:
        router = APIRouter()

        @router.get("/v1/ltv/tasks")
        async def list_tasks() -> Any:
            if (off := self._off()) is not None:
                return off
            entries = await asyncio.to_thread(self._entries)
            # an entry being deleted is listed as such; one being published is still its job
            return {"object": "list", "data": [self._view(e) for e in entries
                                               if e.name not in self.deleting
                                               and e.name not in self.jobs]
                    + [self._job_view(n) for n in sorted(self.jobs)]
                    + [self._deleting_view(n) for n in sorted(self.deleting)]}

        @router.get("/v1/ltv/tasks/{name}")
        async def get_task(name: str) -> Any:
            if (off := self._off(name)) is not None:
                return off
            return await self._entry_or_error(name)

        @router.delete("/v1/ltv/tasks/{name}")
        async def delete_task(name: str, request: Request) -> Any:
            if (off := self._off(name)) is not None:
                return off
            t0 = time.perf_counter()
            answer = await self._delete(name)
            await self._siblings_follow()
            store_operation("delete", _result(answer), time.perf_counter() - t0)
            return await self._audit(request, "delete", name, answer)

        @router.post("/v1/ltv/tasks")
        async def add_task(request: Request) -> Any:
            if (off := self._off()) is not None:
                return off
            if media_type(request.headers.get("content-type", "")) == "application/json":
                return await self._audit(request, "compile", None,
                                         await self._compile(request))
            t0 = time.perf_counter()
            answer = await self._upload(request)
            await self._siblings_follow()
            store_operation("upload", _result(answer), time.perf_counter() - t0)
            return await self._audit(request, "upload", None, answer)

        app.include_router(router)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            _multiprocess_metrics(app, self)

    # -- the audit log --------------------------------------------------------------------
    async def _audit(self, request: Any, op: str, name: str | None, answer: Any) -> Any:
        """One JSON line for a store operation (`--audit-log`): when, what, which task and
        vector, who (the key's id, never the key) from where, and how it ended; `answer`
        handed back as it is."""
        if not self.audit:
            return answer
        status = getattr(answer, "status_code", 200)
        body: dict[str, Any] = answer if isinstance(answer, dict) else {}
        if not body and hasattr(answer, "body"):
            try:
                body = json.loads(answer.body)
            except ValueError:
                body = {}
        name = name or body.get("name")
        await self._log(op, name, getattr(request.state, middleware.KEY_STATE, None),
                        request.client.host if request.client else None, status=status,
                        digest=self._held(name) if isinstance(name, str) else None,
                        bytes=int(request.headers.get("content-length") or 0) or None,
                        **({"error": (body.get("error") or {}).get("message")}
                           if status >= 400 else {}))
        return answer

    async def _log(self, op: str, name: str | None, key: str | None, client: str | None,
                   **fields: Any) -> None:
        """Write one audit line: when, what, which task, who from where, and `fields`."""
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "op": op, "name": name,
                **fields, "key": key, "client": client, "replica": self.replica}
        await asyncio.to_thread(self._write_audit, json.dumps(line))

    async def _audit_refusal(self, scope: dict[str, Any], key: str, status: int) -> None:
        """A store change the gate refused (a key without the admin role)."""
        path = str(scope.get("path", ""))
        client = scope.get("client")
        await self._log({"DELETE": "delete"}.get(str(scope.get("method")), "add"),
                        path.rstrip("/").removeprefix(TASKS_PATH).strip("/") or None, key,
                        client[0] if client else None, status=status,
                        error="forbidden: not an admin key")

    def _write_audit(self, text: str) -> None:
        if self.audit == "-":
            print(text, file=sys.stderr, flush=True)
            return
        # appended and synced line by line: a restart (or a kill) loses no answered operation
        with open(self.audit, "a") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())

    # -- helpers -----------------------------------------------------------------------------
    def _served(self, name: str) -> bool:
        """Whether requests for `name` get its task now (a store task or a command-line one)."""
        if self.lora:
            return name in self.models.lora_requests
        return name in RUNTIME or name in named_tasks()

    def _off(self, name: str | None = None) -> Any:
        from ltv_vllm.errors import UserError
        from ltv_vllm.serving.taskstore import check_name

        if self.store is None:
            return _error(404, "this server has no task store (start it with "
                               "`ltv-vllm serve --task-store`)", "NotFoundError")
        if name is not None:
            try:
                check_name(name)
            except UserError as e:
                return _error(400, str(e), "BadRequestError", "name")
        return None

    def _entries(self) -> list[Any]:
        """This server's entries that read; one that does not is skipped (never a failed
        listing, count or scrape) and logged once."""
        entries = self.store.readable()
        bad = self.store.unreadable
        for name in sorted(set(bad) - self.bad_dirs):
            logger.warning("ltv-vllm: %s; not listed or served", self._public(bad[name]))
        self.bad_dirs = set(bad)
        return entries

    def _public(self, message: str) -> str:
        """`message` without the server's paths: an upload's staging file is "the upload",
        the store's (this server's, and a shared one's path or URL) and the model's
        directories are named by what they are."""
        import re

        root = re.escape(str(self.store.root))
        message = re.sub(root + r"/\.(?:up|tmp)-[^/\s:'\"]*/[^\s:'\"]*", "the upload",
                         message)
        shown: list[tuple[Any, str]] = []
        if self.shared is not None:
            # its URL as given (file://DIR, s3://…) before the directory it names
            if self.shared.url.startswith(SCHEMES):
                shown.append((self.shared.url, "<task store>"))
            shown.append((self.shared, "<task store>"))
        shown += [(self.store.root, "<task store>"), (self.model_dir, "<model>")]
        for path, name in shown:
            message = message.replace(str(path), name)
        return message

    def _fail(self, status: int, e: Exception | str, err_type: str,
              param: str | None = None) -> Any:
        return _error(status, self._public(str(e)), err_type, param)

    def _full(self, e: Exception) -> Any:
        # 507 Insufficient Storage: the request was fine, the server's disk was not
        return self._fail(507, e, "InsufficientStorageError")

    def _view(self, entry: Any) -> dict[str, Any]:
        record = dict(entry.record)
        if isinstance(record.get("model"), dict):  # its name is often the model's path here
            record["model"] = {**record["model"],
                               "name": self._public(str(record["model"].get("name")))}
        return {**record, "object": "ltv.task", "status": "ready",
                "served": self._served(entry.name)}

    def _job_view(self, name: str) -> dict[str, Any]:
        job = self.jobs[name]
        st = _read_status(job["dir"])
        state = job["state"]
        phase = st.get("state") if state == "compiling" else None
        error = job.get("error")
        return {"object": "ltv.task", "name": name, "status": state, "phase": phase,
                "source": "compiled", "served": False,
                "error": self._public(error) if error else None,
                "seconds": round(time.time() - job["t0"], 1),
                "k": len(job["request"]["demos"]), "n": len(job["request"]["queries"])}

    def _deleting_view(self, name: str) -> dict[str, Any]:
        """A task DELETE has unserved: its files go once its requests are done."""
        return {"object": "ltv.task", "name": name, "status": "deleting", "served": False,
                "in_flight": in_flight.get(name, 0)}

    async def _entry_or_error(self, name: str) -> Any:
        from ltv_vllm.serving.taskstore import StoreError

        if name in self.jobs:
            return self._job_view(name)
        if name in self.deleting:
            return self._deleting_view(name)
        try:
            entry = await asyncio.to_thread(self.store.get, name)
        except StoreError as e:
            return self._fail(404, e, "NotFoundError", "name")
        return self._view(entry)

    def _taken(self, name: str) -> Any:
        """409 when the name is in use or the server is full (call under the lock)."""
        if self.models.is_base_model(name):
            return _error(409, f"{name!r} is the served base model's name; choose another",
                          "ConflictError", "name")
        if (self._served(name) or name in self.jobs or name in self.deleting
                or (self.store.root / name).exists() or name in self.listed):
            return _error(409, f"task {name!r} exists; DELETE it first", "ConflictError",
                          "name")
        # a shared store's tasks count wherever they were added
        held = len({e.name for e in self._entries() if e.name not in self.deleting}
                   | set(self.listed)) + len(self.jobs)
        if held >= self.max_tasks:
            return _error(409, f"the server holds {self.max_tasks} tasks (--max-tasks); "
                               "DELETE one first", "ConflictError")
        return None

    # -- DELETE ------------------------------------------------------------------------------
    async def _delete(self, name: str) -> Any:
        from ltv_vllm.serving.taskstore import StoreError

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
                "status": "deleting", "in_flight": in_flight.get(name, 0)})
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
        key = RUNTIME.pop(name, None)  # per-request tasks: likewise
        RUNTIME_CHAT.pop(name, None)
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
            await drained(name)
            # then one round trip through the engine core and every worker, behind each abort
            # and each step already sent to them: no step after it can load the task
            await self._barrier()
            if lora is not None:
                # vLLM's unload only forgets the name: the engine keeps the adapter
                try:
                    await self.engine.remove_lora(lora.lora_int_id)
                except Exception as e:  # noqa: BLE001 - the name is unserved already; an
                    # adapter left in the engine is never used again (vllm_ext.fixes)
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
            await drained(key)
            await self._barrier()
            async with self.lock:
                if key not in RUNTIME.values() and in_flight.get(key, 0) == 0:
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

    # -- a shared store: followed ------------------------------------------------------------
    async def _poll(self) -> None:
        """Follow the shared index every `poll` seconds, for the server's life."""
        from ltv_vllm.serving.taskstore import StoreError

        while True:
            await self._next_poll()
            try:
                await self._follow_soon()
            except StoreError as e:
                self._outage(e)
            except Exception:  # noqa: BLE001 - never stops following (the engine is not
                # touched here: a failure costs this round, logged)
                logger.exception("ltv-vllm: following the task store failed")

    async def _next_poll(self) -> None:
        """Sleep until the next poll, or until a sibling API-server process says it changed
        the index (checked every NUDGE_SECONDS: a local file's stat)."""
        if self.siblings is None:
            await asyncio.sleep(self.poll)
            return
        end = time.monotonic() + self.poll
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(NUDGE_SECONDS, left))
            if await asyncio.to_thread(self.siblings.nudged):
                return

    async def _siblings_follow(self) -> None:
        """After a change this process made to the shared index: tell its sibling API-server
        processes, and wait (at most LTV_VLLM_RESOLVE_WAIT seconds) until each serves that
        generation, so the answer holds whichever process a client reaches next."""
        if self.siblings is None or self.published < 0:
            return
        await asyncio.to_thread(self.siblings.nudge)
        end = time.monotonic() + float(os.environ.get(RESOLVE_WAIT_ENV) or RESOLVE_SECONDS)
        while behind := await asyncio.to_thread(self.siblings.behind, self.published):
            if time.monotonic() > end:
                logger.warning("ltv-vllm: API-server processes %s have not followed the task "
                               "store's generation %d yet", ", ".join(behind), self.published)
                return
            await asyncio.sleep(NUDGE_SECONDS / 2)

    def _outage(self, e: Exception) -> None:
        text = self._public(str(e))
        if text != self.outage:  # once per outage, not once per poll
            logger.warning("ltv-vllm: %s; serving the tasks this replica holds", text)
            self.outage = text

    async def _follow_soon(self) -> None:
        """A follow of the index that read it after this call began: the one under way, if
        it had not read the index yet, else the next (one at a time, shared by every caller
        meanwhile)."""
        asked = time.monotonic()
        for _ in range(2):
            if self.following is None or self.following.done():
                self.following = asyncio.ensure_future(self._follow())
            await asyncio.shield(self.following)
            if self.followed_at >= asked:
                return

    async def _follow(self) -> None:
        """Serve exactly the shared index (under the lock, read inside it, so no upload or
        DELETE of this replica's interleaves): names gone or holding another vector are
        unserved as a DELETE does (requests admitted before finish on their own pins); names
        new here are copied (outside the engine: the engine only ever loads a local pin),
        checked and served. The index is untrusted input: only entries in the shape this
        release writes are served, at most --max-tasks of them (`Index.servable`), the others
        skipped and reported (one line per generation, the metric, their cards). A name
        this replica cannot serve is logged once and skipped."""
        from ltv_vllm.serving.taskstore import EntryExists, StoreError

        async with self.lock:
            read_at = time.monotonic()
            idx = await asyncio.to_thread(self.shared.index)
            whole = True  # every name settled: this generation need not be looked at again
            if self.outage is not None:
                logger.warning("ltv-vllm: the task store answers again")
                self.outage = None
            self.followed_at = read_at
            await asyncio.to_thread(self._tidy)  # every follow: one local listing
            if idx.generation == self.seen:
                self._followed(idx.generation)
                return
            tasks, skipped = idx.servable(self.max_tasks)
            self._skipping(idx.generation, skipped)
            for name in sorted(self.digests):
                if name in self.jobs or name in self.deleting:
                    whole = False
                    continue
                if (tasks.get(name) or {}).get("digest") != self.digests[name]:
                    await self._unserve(name)
            for name, item in sorted(tasks.items()):
                digest = item["digest"]
                if name in self.jobs or name in self.deleting:
                    whole = False  # settled when its compile or its removal is done
                    continue
                if name in self.digests or self.unservable.get(name, ("",))[0] == digest:
                    continue
                if self._served(name) or (self.store.root / name).exists():
                    self.unservable[name] = (digest, "its name is taken on this replica")
                    logger.warning("ltv-vllm: task store task %r is not served here: its name "
                                   "is taken (a --task-vector?)", name)
                    continue
                t0 = time.perf_counter()
                try:
                    data = await asyncio.to_thread(self.shared.vector, digest)
                    staged = await asyncio.to_thread(
                        self.store.adopt, name, data, item["record"], self.model_dir,
                        base_model=str(self.model_dir), max_rank=self.max_rank,
                        adapter=self.lora)
                    entry = await asyncio.to_thread(self.store.publish, staged, name)
                except StoreUnavailable:
                    store_operation("load", "error", time.perf_counter() - t0)
                    raise  # the next follow tries again
                except EntryExists as e:  # its name is still held here (being removed)
                    whole = False
                    logger.warning("ltv-vllm: task store task %r waits: %s", name,
                                   self._public(str(e)))
                    continue
                except StoreError as e:  # nothing of it is left here (`adopt`, `publish`)
                    store_operation("load", "refused", time.perf_counter() - t0)
                    self.unservable[name] = (digest, self._public(str(e)))
                    logger.warning("ltv-vllm: task store task %r is not served here: %s",
                                   name, self._public(str(e)))
                    continue
                failed = await self._serve(entry)
                store_operation("load", "ok" if failed is None else "error",
                                time.perf_counter() - t0)
                if failed is not None:
                    why = json.loads(failed.body)["error"]["message"]
                    self.unservable[name] = (digest, why)
                    logger.warning("ltv-vllm: task store task %r is not served here: %s",
                                   name, why)
                    continue
                self.digests[name] = digest
                self.unservable.pop(name, None)
            self.listed = dict(tasks)
            # as bounded as the listing: why a name was not served, for names still listed
            self.unservable = {n: v for n, v in self.unservable.items() if n in tasks}
            self.seen = idx.generation if whole else -1
            self._followed(idx.generation)

    def _skipping(self, generation: int, skipped: dict[str, tuple[str, str]]) -> None:
        """The index entries this replica does not serve, kept for its listing and metric
        and logged in one line, once per generation (not once per poll)."""
        from ltv_vllm.serving.taskstore import NAME

        self.skipped = {n: why for n, (_, why) in skipped.items() if NAME.fullmatch(n)}
        self.skip_counts = dict.fromkeys(SKIPS, 0)
        for reason, _ in skipped.values():
            self.skip_counts[reason] += 1
        if not skipped or generation == self.skips_logged:
            return
        self.skips_logged = generation
        counts = ", ".join(f"{c} {r}" for r, c in self.skip_counts.items() if c)
        # the broken entries first (past --max-tasks, each says the same)
        shown = ([(n, why) for n, (r, why) in skipped.items() if r != "max_tasks"][:3]
                 or [(n, why) for n, (_, why) in skipped.items()][:1])
        # names as repr, cut: an index's names are anyone's text (newlines, any length)
        examples = "; ".join(f"{n[:40]!r}: {why}" for n, why in shown)
        logger.warning("ltv-vllm: task store index generation %d: %d entries not served here "
                       "(by reason: %s), e.g. %s", generation, len(skipped), counts, examples)

    def _tidy(self) -> None:
        """This replica's copy holds only what it serves (under the lock): an entry
        directory no served task, compile or removal holds (a removal that failed, a record
        that does not read, anything else put there) is removed, so nothing in the copy
        takes a name or stops a route; the index's tasks are copied again as it follows."""
        from ltv_vllm.serving.taskstore import NAME

        for p in sorted(self.store.root.iterdir()):
            name = p.name
            if (not NAME.fullmatch(name) or not p.is_dir() or name in self.digests
                    or name in self.jobs or name in self.deleting or self._served(name)):
                continue
            self.store.discard(name)
            self.bad_dirs.discard(name)
            logger.warning("ltv-vllm: %r removed from this replica's copy of the task store: "
                           "it serves no such task", name)

    def _followed(self, generation: int) -> None:
        if self.siblings is not None:
            self.siblings.followed(generation)

    async def _fresh(self) -> Any:
        """Before a change: this replica follows the shared index first, so a name deleted
        or added on another replica is judged as the store holds it; a 503 answer when the
        store does not answer (None: go on, or no shared store)."""
        from ltv_vllm.serving.taskstore import StoreError

        if self.shared is None:
            return None
        try:
            await self._follow_soon()
        except StoreError as e:
            self._outage(e)
            return self._fail(503, e, "ServiceUnavailableError")
        return None

    async def resolve(self, name: str) -> str | None:
        """The gate's hook for a request naming `name` where this replica serves no such
        model: follow the shared index now (waiting at most LTV_VLLM_RESOLVE_WAIT seconds);
        None: answer it as it stands (served now, or no such task: vLLM's 404), else why
        it gets a 503 (the store did not answer, or the task cannot be served here)."""
        from ltv_vllm.serving.taskstore import NAME, StoreError

        if (self._served(name) or not NAME.fullmatch(name)
                or self.models.is_base_model(name)):
            return None
        wait = float(os.environ.get(RESOLVE_WAIT_ENV) or RESOLVE_SECONDS)
        # one index read per follow, shared by the requests that wait on it: a burst of
        # requests for names the store does not hold costs a read at a time, not one each
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._follow_soon(), wait)
        except TimeoutError:
            store_operation("resolve", "error", time.perf_counter() - t0)
            return f"task {name!r}: the task store did not answer within {wait:g} s; retry"
        except StoreError as e:
            store_operation("resolve", "error", time.perf_counter() - t0)
            return f"task {name!r} could not be resolved: {self._public(str(e))}"
        store_operation("resolve", "ok" if self._served(name) or (
            name not in self.listed and name not in self.skipped) else "refused",
                        time.perf_counter() - t0)
        if self._served(name) or (name not in self.listed and name not in self.skipped):
            return None
        why = self.skipped.get(name) or self.unservable.get(name, ("", "it is being updated"))[1]
        return f"task {name!r} is in the task store but not served by this replica: {why}"

    def _held(self, name: str) -> str | None:
        """The digest (16 hex, the engine key's) of the vector this replica serves a store
        task's name with now, or None (LoRA mode without a shared store: not kept)."""
        if name in self.digests:
            return self.digests[name][:16]
        return RUNTIME[name].partition("@")[2] if name in RUNTIME else None

    def listing(self) -> list[dict[str, Any]]:
        """The store's tasks as `/v1/models` cards (the gate adds them): each with its
        digest (the vector's sha256, first 16 hex digits: the engine key's) and whether this
        replica serves it now; one it does not serve, with why (`error`). With a shared
        store, at most --max-tasks of them (the index's entries this replica skips are
        listed in the slots its served ones leave)."""
        tasks: dict[str, str | None] = {}
        errors: dict[str, str] = {}
        if self.shared is not None:
            tasks = {n: item["digest"][:16] for n, item in self.listed.items()}
            errors = {n: why for n, (digest, why) in self.unservable.items()
                      if n in self.listed and self.listed[n]["digest"] == digest}
            for name, why in list(self.skipped.items())[:max(0, self.max_tasks - len(tasks))]:
                tasks.setdefault(name, None)
                errors.setdefault(name, why)
        for name, key in RUNTIME.items():
            tasks.setdefault(name, key.partition("@")[2])
        if self.lora:  # adapters: vLLM lists them, the gate adds this to their cards
            tasks.update({e.name: None for e in self._entries()
                          if self._served(e.name) and e.name not in tasks})
        def loaded(name: str, digest: str | None) -> bool:
            # this replica answers the name with this very vector (not an older copy)
            held = self._held(name) if self.shared is not None or not self.lora else digest
            return self._served(name) and name not in self.deleting and held == digest

        return [{"id": name, "object": "model", "owned_by": "ltv-vllm",
                 "ltv": {"task_store": True, "digest": digest, "loaded": loaded(name, digest),
                         **({"error": errors[name]} if name in errors
                            and not loaded(name, digest) else {})}}
                for name, digest in sorted(tasks.items())]

    # -- POST: an upload ---------------------------------------------------------------------
    async def _upload(self, request: Any) -> Any:
        from ltv_vllm.errors import UserError
        from ltv_vllm.serving.taskstore import StoreFull, check_name

        if media_type(request.headers.get("content-type", "")) != "multipart/form-data":
            return _error(415, "POST /v1/ltv/tasks takes a compile request (application/json) "
                               "or multipart/form-data with a `name` and a task-vector file "
                               "`vector`", "BadRequestError")
        try:  # the body is whole and within the upload limit (middleware.Gate)
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
        from ltv_vllm.core.vector import VectorError, load_task_vector, sniff_suffix
        from ltv_vllm.serving.lora import VLLM_LORA_RANKS
        from ltv_vllm.serving.taskstore import chat_template_of, full_disk

        with tempfile.TemporaryDirectory(dir=self.store.root, prefix=".up-") as d:
            path = Path(d) / f"upload{sniff_suffix(data)}"
            try:
                path.write_bytes(data)
            except OSError as e:
                if (full := full_disk(e, "the upload was not read", self.store.root)) is None:
                    raise
                raise full from e
            tv = load_task_vector(path)
        fitted, served = chat_template_of(tv), served_template()
        if fitted is not None and fitted != served:
            raise VectorError(f"a chat-fitted vector: fitted through chat template sha256 "
                              f"{fitted[:12]}, and this server renders chat with "
                              f"{served[:12] or 'no template'}; extract it with --chat-template "
                              "set to the server's")
        if tv.rank > VLLM_LORA_RANKS[-1]:
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
        from ltv_vllm.serving.taskstore import VECTOR, StoreError

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
        from ltv_vllm.serving.taskstore import StoreError

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
        from ltv_vllm.serving.taskstore import vector_digest

        try:
            chat = await asyncio.to_thread(entry.chat_template)
            digest = (await asyncio.to_thread(vector_digest, entry.vector_path)
                      if not self.lora else "")
        except (OSError, UserError) as e:
            await asyncio.to_thread(self.store.remove, entry.name)
            return self._fail(500, f"task {entry.name!r} does not read: {e}",
                              "InternalServerError")
        if chat is not None:  # known to the gate before any request can name the task
            RUNTIME_CHAT[entry.name] = chat
        else:
            RUNTIME_CHAT.pop(entry.name, None)
        if not self.lora:
            key = task_key(entry.name, digest)
            try:  # the engines load the key's pin, made before any request can name it
                await asyncio.to_thread(self.store.pin, entry, key)
            except (OSError, UserError) as e:
                RUNTIME_CHAT.pop(entry.name, None)
                await asyncio.to_thread(self.store.remove, entry.name)
                return self._fail(500, f"task {entry.name!r} could not be pinned: {e}",
                                  "InternalServerError")
            RUNTIME[entry.name] = key
            return None
        try:
            res = await self.models.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=entry.name, lora_path=str(entry.path)))
        except Exception as e:  # noqa: BLE001 - rolled back and reported, the server stays up
            res = e
        if isinstance(res, str):
            return None
        RUNTIME_CHAT.pop(entry.name, None)
        await asyncio.to_thread(self.store.remove, entry.name)
        message = getattr(getattr(res, "error", None), "message", str(res))
        return self._fail(500, f"vLLM could not load task {entry.name!r}: {message}",
                          "InternalServerError")

    # -- POST: a compile ---------------------------------------------------------------------
    async def _compile(self, request: Any) -> Any:
        from fastapi.responses import JSONResponse

        from ltv_vllm.errors import UserError
        from ltv_vllm.serving.compile import parse_request
        from ltv_vllm.serving.taskstore import full_disk

        try:  # whole and within the compile limit (middleware.Gate)
            body = json.loads(await request.body())
        except RecursionError:
            return _error(400, "malformed JSON: nested too deeply", "BadRequestError")
        except ValueError as e:
            return _error(400, f"malformed JSON: {e}", "BadRequestError")
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
                       "key": getattr(request.state, middleware.KEY_STATE, None),
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
                sys.executable, "-m", "ltv_vllm.serving.compile", str(job["dir"]), env=env,
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


def _result(answer: Any) -> str:
    """An answer as a store operation's result label: ok, refused (4xx) or error (5xx)."""
    status = getattr(answer, "status_code", 200)
    return "ok" if status < 400 else "refused" if status < 500 else "error"


def _read_status(job_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(job_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}


class Residency:
    """What this replica holds, for vLLM's `/metrics` (read at each scrape, so a task gone
    from the store is gone from the metrics): `ltv_vllm:task_loaded{task, digest}` 1 when
    this replica answers the task with that vector, 0 when the store lists it and this
    replica does not (yet); each served store task's rank and file size; with a shared store,
    the index generation it follows, whether the store answered its last read, and how many
    of the index's entries it skips, by reason. At most `--max-tasks` task series."""

    def __init__(self, endpoints: TaskEndpoints) -> None:
        self.endpoints = endpoints

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        ep = self.endpoints
        loaded = GaugeMetricFamily("ltv_vllm:task_loaded", "A task-store task this replica "
                                   "serves with the store's vector (1) or not yet (0)",
                                   labels=["task", "digest"])
        for card in ep.listing():
            loaded.add_metric([card["id"], card["ltv"]["digest"] or ""],
                              1.0 if card["ltv"]["loaded"] else 0.0)
        yield loaded
        rank = GaugeMetricFamily("ltv_vllm:task_rank", "The rank of a task this replica "
                                 "serves (its vector's, as stored)", labels=["task"])
        size = GaugeMetricFamily("ltv_vllm:task_bytes", "The size of a task's vector file on "
                                 "this replica", labels=["task"])
        for entry in ep._entries() if ep.store is not None else []:
            if ep._served(entry.name) and entry.name not in ep.deleting:
                try:
                    nbytes = entry.vector_path.stat().st_size
                except OSError:
                    continue  # removed meanwhile
                r = entry.record.get("rank")
                rank.add_metric([entry.name], float(r) if isinstance(r, int) else 0.0)
                size.add_metric([entry.name], float(nbytes))
        yield rank
        yield size
        if ep.shared is not None:
            yield GaugeMetricFamily("ltv_vllm:task_store_generation", "The shared task "
                                    "store's index generation this replica serves (-1: "
                                    "following)", value=ep.seen)
            yield GaugeMetricFamily("ltv_vllm:task_store_reachable", "Whether the shared "
                                    "task store answered this replica's last read",
                                    value=0.0 if ep.outage else 1.0)
            skipped = GaugeMetricFamily(
                "ltv_vllm:task_store_skipped_records", "Entries of the shared task store's "
                "index this replica does not serve: not in the shape this release writes "
                "(name, entry, digest, record, format), or past --max-tasks (max_tasks)",
                labels=["reason"])
            for reason in SKIPS:
                skipped.add_metric([reason], float(ep.skip_counts.get(reason, 0)))
            yield skipped


def _multiprocess_metrics(app: Any, endpoints: TaskEndpoints) -> None:
    """`/metrics` where several API-server processes serve (vLLM's multiprocess mode): vLLM
    answers it from prometheus_client's multiprocess files only, a registry made per scrape,
    which a collector cannot join; residency is a collector (its series come and go with the
    store), so this route, put first, answers the same files plus the residency of the
    process that answers (each follows the store; they agree within NUDGE_SECONDS of a change
    made by one of them, within the poll of another replica's)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from starlette.responses import Response
    from starlette.routing import Route

    async def metrics(request: Any) -> Any:  # noqa: ARG001
        from ltv_vllm.serving.vllm_ext.metrics import SHIFT_SIZES

        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(Residency(endpoints))
        if SHIFT_SIZES.task is not None:
            registry.register(SHIFT_SIZES)
        text = await asyncio.to_thread(generate_latest, registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    app.router.routes.insert(0, Route("/metrics", metrics, methods=["GET"]))


def _register_residency(endpoints: TaskEndpoints) -> None:
    """Residency on vLLM's `/metrics` (its registry: prometheus_client's default one, where
    one API-server process serves; a task store allows only one)."""
    from prometheus_client import REGISTRY

    try:
        REGISTRY.register(Residency(endpoints))
    except ValueError:  # registered already (a second init in one process)
        pass

