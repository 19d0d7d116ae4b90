"""What a JSON request asks of the shift (`Ask`), read as vLLM reads it, and the gate's
refusal messages. Runs in vLLM's API-server process (`api_server.gate`).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from ltv_vllm.serving.api_server.asgi import json_error
from ltv_vllm.serving.contract.wire import (
    ADMIT_KEY,
    CHAT_KEY,
    CHAT_PATH,
    CHAT_PATHS,
    LAYER_KEY,
    READOUT_KEY,
    STEPS_KEY,
    TASK_KEY,
    chat_fitted,
    parse_steps,
    rendering_refusal,
)

logger = logging.getLogger("ltv_vllm.serving.api_server.gate")

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
        return 400, json_error(400, "the request could not be read by the server's task gate",
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
    tenant: Any = None  # the caller's `contract.tenancy.Scope` (None: every task)

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
        # the gate's stamp and a store layer task's kind, live fidelity's readout
        for own in (ADMIT_KEY, LAYER_KEY, READOUT_KEY):
            if own in xargs:
                return (f"vllm_xargs.{own} is the server's own", "BadRequestError",
                        f"vllm_xargs.{own}")
        if CHAT_KEY in xargs and xargs[CHAT_KEY] != "allow":
            return (f'vllm_xargs.{CHAT_KEY} takes one value, "allow"', "BadRequestError",
                    f"vllm_xargs.{CHAT_KEY}")
        return None

    def rendering(self, key: str, task: str,
                  fitted: dict[str, str] | None = None) -> tuple[str, ...] | None:
        """A 400 for a request rendered otherwise than `task`'s vector was fitted (its
        chat-fitted digest under `key` in `fitted`: the task registry's `chat_fitted()`;
        None: the command line's, `wire.chat_fitted`), or None (`wire.rendering_refusal`)."""
        fitted = chat_fitted() if fitted is None else fitted
        why = rendering_refusal(task, fitted.get(key), self.view, chat=self.chat,
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
