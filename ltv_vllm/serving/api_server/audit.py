"""The task store's audit log (`serve --audit-log`): one JSON line per store operation.
Runs in vLLM's API-server process (a part of `endpoints.TaskEndpoints`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

from ltv_vllm.serving.api_server.gate import KEY_STATE, TASKS_PATH

logger = logging.getLogger("ltv_vllm.serving.api_server.endpoints")


class AuditLog:
    """The audit log's part of the task endpoints."""

    async def _audit(self, request: Any, op: str, name: str | None, answer: Any,
                     digest: str | None = None) -> Any:
        """One JSON line for a store operation (`--audit-log`): when, what, which task and
        vector, who (the key's id, never the key) from where, and how it ended; `answer`
        handed back as it is. `digest`: the vector's, read before the operation (a DELETE:
        once it is done the name holds none)."""
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
        await self._log(op, name, getattr(request.state, KEY_STATE, None),
                        request.client.host if request.client else None, status=status,
                        digest=digest or (self._held(name) if isinstance(name, str) else None),
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

    async def _audit_refusal(self, scope: dict[str, Any], key: str, status: int,
                             op: str | None = None, name: str | None = None,
                             error: str = "forbidden: not an admin key") -> None:
        """A request the gate refused: a store change without the admin role, or (`op`
        "use", `name`) a model outside the key's scope."""
        path = str(scope.get("path", ""))
        client = scope.get("client")
        if op is None:
            op = {"DELETE": "delete"}.get(str(scope.get("method")), "add")
            name = path.rstrip("/").removeprefix(TASKS_PATH).strip("/") or None
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        # the fields of every other line (`_audit`): one schema for a log reader
        await self._log(op, name, key, client[0] if client else None, status=status,
                        digest=self._held(name) if isinstance(name, str) else None,
                        bytes=int(length) if length.isdigit() and int(length) else None,
                        error=error)

    def _write_audit(self, text: str) -> None:
        if self.audit == "-":
            print(text, file=sys.stderr, flush=True)
            return
        # appended and synced line by line: a restart (or a kill) loses no answered operation
        with open(self.audit, "a") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
