"""ASGI plumbing the gate uses: one-line JSON errors, a response's `model` renamed, the
`/v1/models` answer with the task store's cards. Runs in vLLM's API-server process; no
vLLM import.
"""

from __future__ import annotations

import json
from typing import Any


def json_error(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": err_type, "param": param,
                                 "code": status}}).encode()


async def respond(send: Any, status: int, body: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def media_type(content_type: str) -> str:
    """A Content-Type header's media type, as HTTP defines it: case-insensitive, without its
    parameters (`APPLICATION/JSON; charset=utf-8` is `application/json`)."""
    return content_type.split(";", 1)[0].strip().lower()


def size_text(n: int) -> str:
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


MODELS_PATH = "/v1/models"
TASKS_PATH = "/v1/ltv/tasks"


def listed(body: bytes, cards: list[dict[str, Any]], keep: Any = None,
           notes: dict[str, dict[str, Any]] | None = None) -> bytes:
    """vLLM's `/v1/models` answer with the store's task cards: added, or (a LoRA adapter
    vLLM lists itself) merged into its card; `keep(card)`: the cards a caller sees (None:
    all); `notes`: fields merged into the `ltv` part of the card with that id, where there
    is one (no card is made for a note)."""
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
    for c in data:
        if isinstance(c, dict) and c.get("id") in (notes or {}):
            c["ltv"] = {**(c.get("ltv") if isinstance(c.get("ltv"), dict) else {}),
                        **(notes or {})[c["id"]]}
    if keep is not None:
        doc["data"] = [c for c in data if isinstance(c, dict) and keep(c)]
    return json.dumps(doc).encode()


def with_listing(send: Any, cards: list[dict[str, Any]], keep: Any = None,
                 notes: dict[str, dict[str, Any]] | None = None) -> Any:
    """`send` for `/v1/models`: the answer's body held, the store's cards added and those
    the caller may not see taken out (`listed`), and its length set again."""
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
                    body = listed(body, cards, keep, notes)
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


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> Any:
    """A route's one-line error, as vLLM's own errors read (FastAPI's JSONResponse)."""
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": err_type, "param": param, "code": status}})


def store_route(path: str) -> bool:
    """Whether `path` is one of the task store's own routes: /v1/ltv/tasks, or
    /v1/ltv/tasks/NAME with NAME a valid task name."""
    from ltv_vllm.serving.store.taskstore import NAME

    path = path.rstrip("/")
    name = path.removeprefix(TASKS_PATH + "/")
    return path == TASKS_PATH or (name != path and NAME.fullmatch(name) is not None)


# requests in flight per served model name (multi-task mode); read by the task endpoints
