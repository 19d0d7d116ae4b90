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
    POST   /v1/ltv/tasks          JSON: a compile request (`store.compile`): checked, then
                                  202 and compiled by a worker process; served when ready
                                  multipart: `name` and a task-vector file `vector`
                                  → checked against the model, stored, served: 201
    DELETE /v1/ltv/tasks/{name}   unserved and removed (a compile: stopped): 200, the name
                                  free at once (per-request tasks: the requests in flight
                                  finish on the key's pin, removed after them); LoRA mode:
                                  200, or 202 when its requests outlast DRAIN_SECONDS

A compile runs in `python -m ltv_vllm.serving.store.compile JOB_DIR` (transformers on the
served model's
directory, one thread, so the engine keeps the other cores), one at a time; the worker only
*stages* the entry in ROOT/.jobs/ID/entry. This process alone publishes entries (one rename)
and serves them, under one lock, so the store's invariants (docs/task-store.md) hold whatever
dies when:

- a published entry is served by this server, or rolled back (removed) before the request
  that made it is answered; a worker that dies leaves nothing in the store;
- until an entry is served its name is not: a request for it gets vLLM's 404, never another
  task's shift; DELETE unserves the name first; per-request tasks are loaded from a pin
  (`TaskStore.pin`, by engine key), removed only after the requests admitted with that key
  (the task registry's `in_flight`, with no deadline) and a round trip through the engine; in LoRA
  mode DELETE waits for them, removes the adapter from the engine, then the files: no
  engine process reads a file after it is removed;
- a name is in one state only: queued / compiling / failed (a job), ready (an entry), or
  deleting.

Authentication and body limits come before this code (`api_server.gate`). Error messages
name no server path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

# module level: FastAPI resolves the handlers' (postponed) annotations in this namespace
from fastapi import APIRouter, Request

from ltv_vllm.serving.api_server.asgi import error_response as _error
from ltv_vllm.serving.api_server.asgi import media_type
from ltv_vllm.serving.api_server.audit import AuditLog
from ltv_vllm.serving.api_server.compiles import Compiles, _read_status
from ltv_vllm.serving.api_server.follower import Follower
from ltv_vllm.serving.api_server.metrics import store_operation
from ltv_vllm.serving.api_server.registry import StoreHooks, TaskRegistry
from ltv_vllm.serving.api_server.removal import Removal
from ltv_vllm.serving.api_server.residency import _multiprocess_metrics, _register_residency
from ltv_vllm.serving.api_server.tenancy import tenant_of as _tenant
from ltv_vllm.serving.api_server.uploads import Uploads
from ltv_vllm.serving.contract.settings import ServerSettings
from ltv_vllm.serving.contract.wire import named_tasks, task_key
from ltv_vllm.serving.store.shared_store import (
    SCHEMES,
    SKIPS,
    several_api_servers,
)

logger = logging.getLogger(__name__)


class TaskEndpoints(AuditLog, Removal, Follower, Uploads, Compiles):
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
        self.lora = False  # store tasks as LoRA adapters (else by key: `registry.keys`)
        self.layers = False  # layer tasks may be uploaded (`serve --layer-uploads`)
        self.jobs: dict[str, dict[str, Any]] = {}  # name → compile job (until it is served)
        self.deleting: set[str] = set()  # names being drained and removed (taken meanwhile)
        self.removals: set[asyncio.Future] = set()  # their removals (held: never collected)
        self.worker = asyncio.Semaphore(1)  # one compile at a time
        self.tokenizer: Any = None
        self.max_model_len = 0
        # a store many replicas share (`store.shared_store`), followed: None when the store
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
        self.registry = TaskRegistry()  # the app's, once vLLM hands its state (`init_state`)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """vLLM's call once its app state is built, before the server answers anything: what
        vLLM parsed checked, the self-check run, the metrics wrapped, live fidelity's sampler
        made, then the task store opened and its tasks served (`_open_store`)."""
        from ltv_vllm.serving.contract.deploy import required_problem

        settings = ServerSettings.from_env()
        if settings.required and (problem := required_problem(args, settings.required)):
            # a launcher's flag replaced one of ltv-vllm's: tasks would be served unshifted
            logger.error("ltv-vllm: %s", problem)
            raise RuntimeError(f"ltv-vllm: {problem}")
        if engine_client is not None:  # SIGTERM with a stream open: it ends, the server exits
            from ltv_vllm.serving.api_server.shutdown import end_open_requests_on_shutdown

            end_open_requests_on_shutdown(engine_client, asyncio.get_running_loop())
        if engine_client is not None and (settings.selfcheck or settings.selfcheck_lora):
            await self._selfcheck(engine_client, args, settings.selfcheck_lora,
                                  settings.selfcheck_layer)
        if engine_client is not None and settings.task_metrics:
            # after the self-check: its probe requests are not traffic
            from ltv_vllm.serving.api_server.metrics import instrument

            names = getattr(args, "served_model_name", None) or [args.model]
            instrument(engine_client, str(names[0]), TaskRegistry.of(state))
        if engine_client is not None and settings.fidelity_sample > 0:
            from ltv_vllm.serving.api_server.fidelity import STATE, LiveFidelity

            sampler = LiveFidelity(engine_client, TaskRegistry.of(state),
                                   settings.fidelity_sample)
            await sampler.warm()
            setattr(state, STATE, sampler)
        if engine_client is None or not settings.task_store:
            return  # not a task-store server: the routes answer 404
        self._open_store(settings, args)
        self.models = state.openai_serving_models
        self.registry = TaskRegistry.of(state)  # the gate's too (the app's)
        self.engine = engine_client
        self._configure(settings)
        self._serve_kept()
        if self.shared is not None:
            await self._start_following()
        # the gate's hooks into the store (the registry is the app's, so the gate's too)
        self.registry.store = StoreHooks(
            listing=self.listing, resolve=self.resolve if self.shared is not None else None,
            audit_refusal=self._audit_refusal if self.audit else None)
        _register_residency(self)

    def _open_store(self, settings: ServerSettings, args: Any) -> None:
        """This process's task store: the server's, or (one of several API-server processes)
        entries of its own with pins shared with the others (their one engine loads them),
        each following the shared store."""
        from ltv_vllm.serving.store.taskstore import TaskStore

        root = settings.task_store
        if (getattr(args, "api_server_count", None) or 1) > 1:
            if problem := several_api_servers(bool(settings.shared_store),
                                              settings.store_lora):
                logger.error("ltv-vllm: %s", problem)
                raise RuntimeError(f"ltv-vllm: {problem}")
            from ltv_vllm.serving.store.shared_store import Siblings
            from ltv_vllm.serving.store.taskstore import PINS

            self.store = TaskStore(Path(root) / f".api-{os.getpid()}", pins=Path(root) / PINS)
            self.siblings = Siblings(Path(root))
        else:
            self.store = TaskStore(root)
        self.model_dir = Path(args.model)

    def _configure(self, settings: ServerSettings) -> None:
        """The settings this server's store follows, its tokenizer and its shared store."""
        self.max_tasks = settings.max_tasks
        self.max_rank = settings.task_rank
        self.lora = settings.store_lora
        self.layers = settings.store_layers  # layer tasks may be uploaded (hooks at start)
        self.threads = settings.compile_threads
        self.audit = settings.audit_log
        self.max_model_len = int(self.models.model_config.max_model_len)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if settings.shared_store:
            from ltv_vllm.serving.store.shared_store import SharedStore

            self.shared = SharedStore(settings.shared_store, create=False)
            self.poll = settings.store_poll

    def _serve_kept(self) -> None:
        """What `serve` kept in the store, served (compiles do not outlive their server:
        what a previous one left is dropped)."""
        from ltv_vllm.serving.store.taskstore import vector_digest

        shutil.rmtree(self.store.root / ".jobs", ignore_errors=True)
        (self.store.root / ".jobs").mkdir()
        for entry in self.store.readable():
            if not self.lora:  # per-request tasks: served by key, from its pin
                key = task_key(entry.name, vector_digest(entry.vector_path))
                self.store.pin(entry, key)
                self.registry.serve(entry.name, key, entry.layer)
            # the gate shifts its chat requests
            self.registry.fitted_chat(entry.name, entry.chat_template())

    async def _start_following(self) -> None:
        """The shared store's tasks served before the server answers anything; then
        followed every poll."""
        from ltv_vllm.serving.store.taskstore import StoreError

        try:
            await self._follow()
        except StoreError as e:
            self._outage(e)
        except Exception:  # noqa: BLE001 - a replica always starts (it serves what it
            # holds, and follows again at its next poll); logged
            logger.exception("ltv-vllm: following the task store failed")
        self.poller = asyncio.create_task(self._poll())

    async def _selfcheck(self, engine_client: Any, args: Any, lora: dict[str, str] | None,
                         layer: dict[str, list[float]] | None = None) -> None:
        """Before the server answers anything: the probe tasks the engine holds (or, `lora`,
        the probe adapters; `layer`: the layer probes' signatures, by served name), mixed
        with bare rows, each row checked (`offline.selfcheck`); a wrong row stops the start
        with its one line (SelfCheckFailed)."""
        from ltv_vllm.serving.api_server.selfcheck import engine_selfcheck
        from ltv_vllm.serving.store.probes import LAYER_PROBES, PROBES, SERVED_PREFIX, Signature

        names = {p: SERVED_PREFIX + p for p in (*PROBES, *(LAYER_PROBES if layer else ()))}
        signatures = {p: Signature.from_record(layer[SERVED_PREFIX + p])
                      for p in LAYER_PROBES} if layer else None
        out = await engine_selfcheck(engine_client, args.model, names, lora, signatures)
        # vLLM configures its own loggers only: printed, as the start-up line it is
        print(f"ltv-vllm: selfcheck passed on {out['where']}: {out['rows']} rows, "
              f"{out['tokens']} tokens, in {out['check_seconds']:.2f} s", file=sys.stderr,
              flush=True)

    def attach_router(self, app: Any) -> None:
        router = APIRouter()

        @router.get("/v1/ltv/tasks")
        async def list_tasks(request: Request) -> Any:
            if (off := self._off()) is not None:
                return off
            entries = await asyncio.to_thread(self._entries)
            # an entry being deleted is listed as such; one being published is still its job
            data = ([self._view(e) for e in entries
                     if e.name not in self.deleting and e.name not in self.jobs]
                    + [self._job_view(n) for n in sorted(self.jobs)]
                    + [self._deleting_view(n) for n in sorted(self.deleting)])
            tenant = _tenant(request)  # a scoped key lists its own tasks only
            return {"object": "list", "data": [t for t in data if tenant is None
                                               or tenant.covers(t["name"])]}

        @router.get("/v1/ltv/tasks/{name}")
        async def get_task(name: str, request: Request) -> Any:
            if (off := self._off(name)) is not None:
                return off
            if (hidden := self._hidden(request, name)) is not None:
                return await self._audit(request, "read", name, hidden)
            return await self._entry_orerror_response(name)

        @router.delete("/v1/ltv/tasks/{name}")
        async def delete_task(name: str, request: Request) -> Any:
            if (off := self._off(name)) is not None:
                return off
            if (hidden := self._hidden(request, name)) is not None:
                return await self._audit(request, "delete", name, hidden)
            t0 = time.perf_counter()
            held = self._held(name)  # the vector deleted: gone from the name once done
            answer = await self._delete(name)
            await self._siblings_follow()
            store_operation("delete", _result(answer), time.perf_counter() - t0)
            return await self._audit(request, "delete", name, answer, digest=held)

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

    # -- helpers -----------------------------------------------------------------------------
    def _served(self, name: str) -> bool:
        """Whether requests for `name` get its task now (a store task or a command-line one)."""
        if self.lora:
            return name in self.models.lora_requests
        return name in self.registry.keys or name in named_tasks()

    def _off(self, name: str | None = None) -> Any:
        from ltv_vllm.errors import UserError
        from ltv_vllm.serving.store.taskstore import check_name

        if self.store is None:
            return _error(404, "this server has no task store (start it with "
                               "`ltv-vllm serve --task-store`)", "NotFoundError")
        if name is not None:
            try:
                check_name(name)
            except UserError as e:
                return _error(400, str(e), "BadRequestError", "name")
        return None

    def _hidden(self, request: Any, name: str) -> Any:
        """A scoped key's 404 for a task outside its scope: the answer a name no store holds
        gets, whether this one exists or not (None: in scope)."""
        tenant = _tenant(request)
        if tenant is None or tenant.covers(name):
            return None
        return self._fail(404, f"no task {name!r} in {self.store.root}", "NotFoundError",
                          "name")

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
                "in_flight": self.registry.held(name)}

    async def _entry_orerror_response(self, name: str) -> Any:
        from ltv_vllm.serving.store.taskstore import StoreError

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

    def _held(self, name: str) -> str | None:
        """The digest (16 hex, the engine key's) of the vector this replica serves a store
        task's name with now, or None (LoRA mode without a shared store: not kept)."""
        if name in self.digests:
            return self.digests[name][:16]
        key = self.registry.keys.get(name)
        return key.partition("@")[2] if key is not None else None

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
        for name, key in self.registry.keys.items():
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



def _result(answer: Any) -> str:
    """An answer as a store operation's result label: ok, refused (4xx) or error (5xx)."""
    status = getattr(answer, "status_code", 200)
    return "ok" if status < 400 else "refused" if status < 500 else "error"
