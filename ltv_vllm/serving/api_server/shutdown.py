"""A clean stop on SIGTERM, to the server's main process or to its whole process group: the
requests still open end, their streams close, the server exits with no traceback. Runs in
vLLM's API-server process.

What vLLM (0.32) does alone, with a stream open: on SIGTERM its launcher stops the engine
client, which stops the engine-core process and then cancels the task that reads its
outputs; that task hands an `EngineDeadError` to vLLM's output handler, which logs it with a
traceback and fails every open request with it (another traceback per stream). When the whole
process group gets the signal (systemd's default), the engine core may exit first; vLLM's
monitor then finds it gone and runs the same stop.

Here the core client's `shutdown` (the one both paths call) is wrapped. Before the engine
stops — and only where its stop is expected: vLLM's default `--shutdown-timeout 0` (abort;
with a drain timeout the engine finishes what it runs first, and what is left is ended
after it) and an engine core that exited cleanly (exit status 0, as on SIGTERM) — every
request vLLM's output processor still holds gets its final output, finish reason "abort"
(vLLM's own `OutputProcessor.abort_requests`), and the output handler is cancelled, on the
event loop that owns the streams' queues. An engine core that died any other way is left to
vLLM's error path: its requests fail with the error, as they should.

`stopping(engine)` tells this process's background readers (the shift-size reader) that the
engine is going away, so they stop instead of logging its absence as a failure.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)
_MARK = "_ltv_stopping"  # on the engine client: False (wrapped, running), True (stopping)
END_SECONDS = 10.0  # the longest a shutdown waits for the loop to end the open requests


def stopping(engine: Any) -> bool:
    """Whether this engine client's shutdown has begun."""
    return getattr(engine, _MARK, False) is True


def end_open_requests_on_shutdown(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Wrap `engine.engine_core.shutdown` (once; vLLM's AsyncLLM) so that the requests still
    open end quietly when the engine is stopped on purpose. Another engine client (no core
    client, no output processor) is left as it is."""
    core = getattr(engine, "engine_core", None)
    if hasattr(engine, _MARK) or core is None or not hasattr(engine, "output_processor"):
        return
    inner = core.shutdown

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        setattr(engine, _MARK, True)
        timeout = kwargs.get("timeout", args[0] if args else None)
        if not timeout and _stopped_on_purpose(core):
            _on_loop(loop, lambda: _end_open(engine))
        try:
            return inner(*args, **kwargs)
        finally:  # a drain that outlasted its timeout: what it left is ended now
            if _stopped_on_purpose(core):
                _on_loop(loop, lambda: _end_open(engine))

    core.shutdown = shutdown
    setattr(engine, _MARK, False)


def _stopped_on_purpose(core: Any) -> bool:
    """No engine-core process has exited with a failure (still running, or exit status 0:
    it stopped on a signal, as vLLM's engine core does on SIGTERM)."""
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    procs = getattr(manager, "processes", None) or []
    return all(p.exitcode in (None, 0) for p in procs)


def _end_open(engine: Any) -> None:
    """On the loop: each open request's final output (abort), then the output handler
    cancelled — the engine is going, nothing more will come from it."""
    processor = engine.output_processor
    ids = list(processor.request_states)
    if ids:
        processor.abort_requests(ids, internal=True)
        logger.info("ltv-vllm: %d request(s) still open as the engine stops were ended "
                    "(finish reason abort)", len(ids))
    handler = getattr(engine, "output_handler", None)
    if handler is not None and not handler.done():
        handler.cancel()


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Any) -> None:
    """Run `fn` on `loop` and wait for it: vLLM calls shutdown from an executor thread (its
    launcher) or its monitor thread while the loop runs on."""
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        fn()
        return
    if loop.is_closed():
        return

    async def call() -> None:
        fn()

    try:
        asyncio.run_coroutine_threadsafe(call(), loop).result(END_SECONDS)
    except Exception as e:  # noqa: BLE001 - a shutdown goes on whatever this could not do
        logger.warning("ltv-vllm: the requests still open at shutdown could not be ended: %s",
                       e)
