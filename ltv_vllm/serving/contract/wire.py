"""The wire format of a request's shift — which task vector, and which generated tokens it
shifts — as requests and `serve` spell it, the chat rule, and the gate's admission stamp.

Pure (no vLLM import), read in every process: the CLI checks `--shift-steps` with it before
any engine starts; in the API server the gate (`api_server.gate`) reads requests with it and
stamps what it admits; the engine's request check and row plan (`engine.steps`) admit and
read them with it. The tasks an API server serves at run time are its task registry's
(`api_server.registry`), not this module's.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# re-exported: the grammar of a step policy is the vector file's (`meta.shift_steps`)
from ltv_vllm.core.vector import ALL, parse_steps  # noqa: F401

STEPS_KEY = "ltv_steps"            # a request's `vllm_xargs` key: its step policy
TASK_KEY = "ltv_task"              # a request's `vllm_xargs` key: its task (multi-task serving)
DEFAULT_KEY = "ltv_shift_steps"    # the server's default, carried in `hf_overrides`
TASKS_CONFIG_KEY = "ltv_tasks"     # hf_overrides: JSON {task: {"path", "steps"}} (multi-task)
TASKS_ENV = "LTV_VLLM_TASKS"       # the served task names, for the frontend's request check
STORE_CONFIG_KEY = "ltv_task_store"  # hf_overrides: the task store's root (its tasks by key)
CHAT_KEY = "ltv_chat"              # a request's `vllm_xargs` key: "allow" a shifted chat request
CHAT_PATH = "/v1/chat/completions"
CHAT_TASKS_ENV = "LTV_VLLM_CHAT_TASKS"  # JSON {task: template sha256} of chat-fitted vectors
# ("" for a fused server's one vector)
TEMPLATE_ENV = "LTV_VLLM_CHAT_TEMPLATE"  # sha256 of the template the server renders chat with
SCALE_KEY = "ltv_scale"            # a request's `vllm_xargs` key: its layer task's scale
MIX_KEY = "ltv_mix"                # `vllm_xargs`: {task: scale}, additive layer tasks added
LAYER_TASKS_ENV = "LTV_VLLM_LAYER_TASKS"  # JSON {task key: {"positions", "additive"}}
# `vllm_xargs`: a task-store layer task's kind ("add" or "map"), written by the gate beside
# its engine key and explicit positions (`ltv_steps`), all three under the stamp
LAYER_KEY = "ltv_layer"
LAYER_KINDS = {"add": True, "map": False}  # LAYER_KEY → additive
MAX_SCALE = 100.0                  # |scale| a request may ask for
MAX_MIX = 16                       # layer tasks one request may combine with its own
READOUT_KEY = "ltv_readout"        # a request's `vllm_xargs` key: token ids its logits keep
MAX_READOUT = 1024                 # the most tokens a readout keeps (a task's labels)
ADMIT_KEY = "ltv_admit"            # a request's `vllm_xargs` key: the gate's stamp (`stamp`)
ADMIT_ENV = "LTV_VLLM_ADMIT"       # JSON {"key": hex, "every": bool}: a served engine's stamp key
# routes that render a chat template around the request's text (each vLLM's own)
CHAT_PATHS = (CHAT_PATH, "/v1/chat/completions/batch", "/v1/responses", "/v1/messages")

def task_key(name: str, digest: str) -> str:
    return f"{name}@{digest}"


def tasks_env(names: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The environment a multi-task engine's frontend needs: the task names a request may
    name. vLLM checks a request's parameters (`validate_params`) with a class method that sees
    only the request, in the process that admits it, so the names travel by environment."""
    return {TASKS_ENV: json.dumps(sorted(names))}


def named_tasks(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The command-line tasks' names this process's engine serves."""
    raw = (os.environ if environ is None else environ).get(TASKS_ENV)
    return _names(raw) if raw else frozenset()


def engine_tasks(args: Mapping[str, Any], adm: Any) -> frozenset[str]:
    """What the engine's request check admits as `ltv_task`: the command-line tasks' names
    (offline engines, and a server's own); on a served engine, also a task-store task's engine
    key "NAME@DIGEST" on a request the gate stamped (`admitted` checked the stamp). Only the
    gate writes such a key (`TaskGate`, from its task registry: a client's `ltv_task` with an
    "@" is refused before anything reads it), so the API server's check needs no table of the
    store's keys. Any other name the gate stamped is checked here as before: a fused server's
    gate hands a client's `ltv_task` on as given."""
    static = named_tasks()
    task = args.get(TASK_KEY)
    if (adm is not None and ADMIT_KEY in args and isinstance(task, str)
            and task.partition("@")[0] and "@" in task):
        return static | {task}
    return static


def layer_tasks_env(tasks: Mapping[str, tuple[str, bool]]) -> dict[str, str]:
    """The environment entry naming an engine's layer tasks: key → (default positions,
    additive). Read by the engine's request check (`check_request`), its prefix-cache keys
    (`engine.prefix_keys`) and its worker, which refuses layer tasks it does not list."""
    return {LAYER_TASKS_ENV: json.dumps(
        {k: {"positions": p, "additive": a} for k, (p, a) in sorted(tasks.items())})}


def layer_tasks(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, bool]]:
    """key → (default positions, additive) of this process's engine's layer tasks."""
    raw = (os.environ if environ is None else environ).get(LAYER_TASKS_ENV)
    return dict(_layers(raw)) if raw else {}


@functools.lru_cache(maxsize=4)
def _layers(raw: str) -> tuple[tuple[str, tuple[str, bool]], ...]:
    return tuple(sorted((k, (str(v["positions"]), bool(v["additive"])))
                        for k, v in json.loads(raw).items()))


def request_layers(args: Mapping[str, Any], adm: Admission | None = None,
                   static: Mapping[str, tuple[str, bool]] | None = None
                   ) -> Mapping[str, tuple[str, bool]]:
    """The layer tasks a request is read against: the engine's command-line ones (`static`,
    default `layer_tasks()`), and a task-store layer task the request names, as the gate
    stamped it (its engine key, `ltv_layer` and `ltv_steps`: no table of the store's tasks
    travels to the engine). ValueError where `ltv_layer` is not the gate's: unstamped
    (`adm` given), not a store key, no positions, an unknown kind."""
    layers = layer_tasks() if static is None else static
    if LAYER_KEY not in args:
        return layers
    kind, task = args[LAYER_KEY], args.get(TASK_KEY)
    if (kind not in LAYER_KINDS or not isinstance(task, str) or "@" not in task
            or STEPS_KEY not in args or (adm is not None and not admitted(args, adm))):
        raise ValueError(f"vllm_xargs.{LAYER_KEY} is the server's own")
    return {**layers, task: (str(args[STEPS_KEY]), LAYER_KINDS[kind])}


def parse_scale(value: Any, key: str = SCALE_KEY) -> float:
    """A layer task's scale: a finite number within ±MAX_SCALE (ValueError naming `key`)."""
    import math

    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(float(value)) or abs(float(value)) > MAX_SCALE:
        shown = repr(value)[:40]
        raise ValueError(f"{key} must be a finite number from {-MAX_SCALE:g} to "
                         f"{MAX_SCALE:g}, got {shown}")
    return float(value)


def parse_mix(value: Any) -> dict[str, Any]:
    """`ltv_mix` as {task: scale}: an object (offline `SamplingParams`), or the text
    "NAME=SCALE,NAME=SCALE" (vLLM's OpenAI server takes no object in `vllm_xargs`)."""
    if isinstance(value, str) and 0 < len(value) <= 4096:
        out: dict[str, Any] = {}
        for item in value.split(","):
            name, sep, num = (x.strip() for x in item.partition("="))
            if not sep or name in out:
                raise ValueError(f"{MIX_KEY} is NAME=SCALE,NAME=SCALE (each name once); "
                                 f"got {item.strip()[:40]!r}")
            try:
                out[name] = float(num)
            except ValueError:
                out[name] = num  # refused by its scale's check, which names it
        value = out
    if not isinstance(value, dict) or not 0 < len(value) <= MAX_MIX:
        raise ValueError(f"{MIX_KEY} must name 1 to {MAX_MIX} layer tasks and their scales "
                         "(NAME=SCALE,NAME=SCALE)")
    return value


def layer_parts(args: Mapping[str, Any], layers: Mapping[str, tuple[str, bool]]
                ) -> tuple[tuple[str, float], ...] | None:
    """What a request's layer shift is made of: ((task key, scale), ...) — its own layer
    task times `ltv_scale`, then each `ltv_mix` task with its scale — or None when its task
    is not a layer task. ValueError (a 400) for what cannot be applied: a scale or a mix
    on a task that is not a layer task, a mix with a map, or tasks shifting different
    positions without an `ltv_steps` that names them for all."""
    task = args.get(TASK_KEY, "")
    scale, mix = args.get(SCALE_KEY), args.get(MIX_KEY)
    if not isinstance(task, str) or task not in layers:
        if scale is not None or mix is not None:
            raise ValueError(f"{SCALE_KEY} and {MIX_KEY} apply to a layer task; "
                             f"{(task or 'the bare model')!s:.40} is not one")
        return None
    parts = [(task, parse_scale(scale) if scale is not None else 1.0)]
    if mix is None:
        return tuple(parts)
    mix = parse_mix(mix)
    for name, s in mix.items():
        if name not in layers or "@" in str(name):
            raise ValueError(f"{MIX_KEY}: {str(name)[:40]!r} is not a layer task this "
                             "server serves")
        parts.append((name, parse_scale(s, f"{MIX_KEY}.{str(name)[:40]}")))
    names = [n for n, _ in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"{MIX_KEY} names the request's own task again")
    if maps := [n for n in names if not layers[n][1]]:
        raise ValueError(f"layer task {maps[0]!r} is a map (U, V), which does not combine "
                         "with other tasks; only additive layer tasks combine")
    if STEPS_KEY not in args and len({layers[n][0] for n in names}) > 1:
        raise ValueError(f"the tasks in {MIX_KEY} shift different positions; name them "
                         f"for all with {STEPS_KEY}")
    return tuple(parts)


@functools.lru_cache(maxsize=4)
def _names(raw: str) -> frozenset[str]:
    # parsed once: every request's check reads it
    return frozenset(json.loads(raw))


def parse_readout(value: Any) -> tuple[int, ...]:
    """A readout (`READOUT_KEY`): 1..MAX_READOUT distinct non-negative token ids, as a tuple;
    ValueError naming the key otherwise. (The engine keeps only ids inside its vocabulary;
    the server's sampler sends a vector's label tokens, checked against the model.)"""
    if (not isinstance(value, (list, tuple)) or not 0 < len(value) <= MAX_READOUT
            or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 31
                   for t in value) or len(set(value)) != len(value)):
        raise ValueError(f"{READOUT_KEY} must be a list of 1 to {MAX_READOUT} distinct token ids")
    return tuple(value)


def check_request(args: Mapping[str, Any], *, prompt_logprobs: bool,
                  tasks: frozenset[str]) -> None:
    """A request's `vllm_xargs` as the engine admits them (ValueError: an HTTP 400)."""
    if STEPS_KEY in args:
        parse_steps(args[STEPS_KEY])
    layer_parts(args, request_layers(args, admission()))
    if READOUT_KEY in args:
        parse_readout(args[READOUT_KEY])
        if prompt_logprobs:  # they are computed outside the step's plan: not restricted
            raise ValueError(f"{READOUT_KEY} cannot be combined with prompt_logprobs")
    if TASK_KEY not in args:
        return
    task = args[TASK_KEY]
    if not isinstance(task, str) or task not in tasks:
        raise ValueError(unknown_task(task, tasks))
    if prompt_logprobs:
        raise ValueError(task_prompt_logprobs())


def task_prompt_logprobs() -> str:
    # vLLM computes prompt logprobs one request at a time after sampling, through a call
    # the engine cannot tell apart: with a per-request task they would be the bare model's
    return (f"prompt_logprobs (or echo, which asks for them) cannot be combined with a task "
            f"({TASK_KEY}); serve the task alone (one fused vector) for prompt logprobs")


LORA_PROMPT_LOGPROBS = ("prompt_logprobs (or echo with logprobs) is not available in "
                        "multi-task (LoRA) mode; serve a single task vector (fused) for "
                        "prompt logprobs")


def unknown_task(task: Any, tasks: frozenset[str] | set[str]) -> str:
    """The 400 for a task a server does not serve: the served tasks by name (a store task's
    engine key `NAME@DIGEST` is the server's business, not the client's)."""
    names = sorted({t.partition("@")[0] for t in tasks})
    known = ", ".join(names) or "none (this server serves no named tasks)"
    if isinstance(task, str) and "@" in task:  # an engine key: not echoed, not taken
        return f"{TASK_KEY} names a task by its name; served tasks: {known}"
    shown = task[:80] if isinstance(task, str) else task
    return f"unknown {TASK_KEY} {shown!r}; served tasks: {known}"


def chat_refusal(task: str) -> str:
    """Why a chat request that a vector would shift is refused (measured in
    `benchmarks/chat_classify.py`)."""
    return (f"task {task!r}: its vector was fitted on the task's completion prompt, and a chat "
            "template changes the state it shifts (measured on SmolLM2: 15-90 % of labels "
            "kept, accuracy moved either way); send the prompt to /v1/completions, or set "
            f'vllm_xargs.{CHAT_KEY} to "allow" to shift the chat request anyway')


def shifts_chat(xargs: Any) -> bool:
    """Whether a chat request with these `vllm_xargs` would be shifted without consent: not
    when it opts in (`ltv_chat: "allow"`) or asks for no shifted step (`ltv_steps: 0`)."""
    if not isinstance(xargs, dict):
        return True
    if xargs.get(CHAT_KEY) == "allow":
        return False
    try:
        return parse_steps(xargs[STEPS_KEY]) != 0 if STEPS_KEY in xargs else True
    except ValueError:
        return True  # refused anyway, as a bad policy


def chat_env(fitted: dict[str, str], served_digest: str | None) -> dict[str, str]:
    """What the gate needs of chat-fitted vectors (`tasks.chat`): each command-line one's
    template digest (name → sha256; "" for a fused server's vector) and the server's own
    template's (a task store's uploads are checked against it too)."""
    return {CHAT_TASKS_ENV: json.dumps(fitted, sort_keys=True),
            TEMPLATE_ENV: served_digest or ""}


def chat_fitted(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """name → template sha256 of every chat-fitted command-line task (a task store's are the
    task registry's: `api_server.registry`)."""
    raw = (os.environ if environ is None else environ).get(CHAT_TASKS_ENV)
    return dict(_digests(raw)) if raw else {}


def served_template(environ: Mapping[str, str] | None = None) -> str:
    """sha256 of the template this server renders chat with ("" if none or not told)."""
    return (os.environ if environ is None else environ).get(TEMPLATE_ENV) or ""


@functools.lru_cache(maxsize=4)
def _digests(raw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(json.loads(raw).items()))


def rendering_refusal(task: str, fitted: str | None, payload: Mapping[str, Any], *,
                      chat: bool, chat_path: bool,
                      environ: Mapping[str, str] | None = None) -> str | None:
    """Why a request a vector would shift is refused for how it is rendered, or None.

    A completion-fitted vector (`fitted` None) shifts completion requests; a chat request is
    refused unless it opts in. A chat-fitted vector (`fitted`: its template's sha256) shifts
    chat completions rendered as it was fitted: the server's template the same, the request
    not overriding it, the generation prompt on (the state it was fitted at); a completion
    request, or a chat on another route, is refused unless it opts in. The opt-in
    (`ltv_chat: "allow"`) and `ltv_steps: 0` (nothing shifted) are never refused."""
    if not shifts_chat(payload.get("vllm_xargs")):
        return None
    if fitted is None:
        return chat_refusal(task) if chat else None
    opt_in = f'set vllm_xargs.{CHAT_KEY} to "allow" to shift it anyway'
    if not chat:
        return (f"task {task!r}: its vector was fitted through the model's chat template; send "
                f"the request to {CHAT_PATH} (or {opt_in})")
    if not chat_path:
        return (f"task {task!r}: its chat-fitted vector is served on {CHAT_PATH}; {opt_in}")
    if payload.get("chat_template") is not None:
        return (f"task {task!r}: its vector was fitted through the server's chat template; a "
                f"request's own chat_template renders another prompt ({opt_in})")
    if payload.get("add_generation_prompt") is False or payload.get("continue_final_message"):
        return (f"task {task!r}: its vector shifts the assistant's first token after the "
                "generation prompt; add_generation_prompt false or continue_final_message "
                f"renders another prompt ({opt_in})")
    served = served_template(environ)
    if served != fitted:
        return (f"task {task!r}: its vector was fitted through chat template sha256 "
                f"{fitted[:12]}, and this server renders chat with "
                f"{served[:12] or 'no template'} (started with another --chat-template?); "
                f"{opt_in}")
    return None


# -- admission: the gate's stamp, checked where every route's request enters the engine -------
# A task (or a fused vector) shifts only a request the gate admitted: the gate reads the
# request as vLLM parsed it on a route whose path through vLLM is proven, and writes an HMAC of
# what it admitted (task and step policy) into `vllm_xargs`. The engine's request check
# (`engine.steps`), which vLLM runs for every request of every route (present or added by a
# vLLM upgrade: `/inference/v1/generate`, scoring, background responses...), refuses a request
# that carries a task without a valid stamp, and the engine shifts no row without one. The key
# is made by `serve` for each start and lives only in the server's environment; a client never
# sees a stamp (vLLM does not echo `vllm_xargs`).
TASK_ROUTES_TEXT = "/v1/completions, /v1/chat/completions, /invocations"


@dataclass(frozen=True)
class Admission:
    key: bytes     # the HMAC key
    every: bool    # every request needs a stamp (a fused server: its vector shifts them all)


def new_admission(every: bool) -> dict[str, str]:
    """The environment that makes a server's engine check stamps (a fresh key per start)."""
    import secrets

    return {ADMIT_ENV: json.dumps({"key": secrets.token_hex(32), "every": every})}


def admission(environ: Mapping[str, str] | None = None) -> Admission | None:
    """This process's stamp key (None: not a served engine — offline engines admit all)."""
    raw = (os.environ if environ is None else environ).get(ADMIT_ENV)
    return _admission(raw) if raw else None


@functools.lru_cache(maxsize=4)
def _admission(raw: str) -> Admission:
    d = json.loads(raw)
    return Admission(bytes.fromhex(d["key"]), bool(d["every"]))


LAYER_WORDS = ("last", "prompt", "generated")  # a layer task's positions (`core.layer_task`)


def canonical_steps(value: Any) -> str | int:
    """A valid `ltv_steps` as the gate hands it on: "all", a count, or a layer task's word,
    which says more than its count (ValueError: invalid)."""
    n = parse_steps(value)
    if isinstance(value, str) and value in LAYER_WORDS:
        return value
    return "all" if n is ALL else int(n)


def stamp(adm: Admission, task: str, steps: Any, layer: Any = None) -> str:
    """The stamp of an admitted request: its task key ("" for a fused vector), its
    `ltv_steps` as handed on (None: not given) and a store layer task's `ltv_layer`."""
    msg = json.dumps([task, steps] if layer is None else [task, steps, layer],
                     separators=(",", ":")).encode()
    return hmac.new(adm.key, msg, hashlib.sha256).hexdigest()[:32]


def not_admitted() -> str:
    return ("this request was not admitted by the server's task gate: a task vector shifts "
            f"requests on {TASK_ROUTES_TEXT} only, as the gate reads them")


def admitted(args: Mapping[str, Any], adm: Admission | None) -> bool:
    """Whether a request's `vllm_xargs` may be shifted: not a served engine (`adm` None); or
    it names no task on a server where only tasks need a stamp; or it carries a valid stamp."""
    if adm is None:
        return True
    given = args.get(ADMIT_KEY)
    if given is None:
        return not adm.every and TASK_KEY not in args
    want = stamp(adm, args.get(TASK_KEY, ""), args.get(STEPS_KEY), args.get(LAYER_KEY))
    # a stamp is ASCII hex; compare_digest raises (TypeError) on other text, not False
    return isinstance(given, str) and given.isascii() and hmac.compare_digest(given, want)
