"""A request's shift — which task vector, and which generated tokens it shifts — as requests
and `serve` spell it. Pure (no vLLM import): the CLI checks `--shift-steps` with it before any
engine starts, the gate middleware and the engine's request check (`vllm_ext.steps`) read the
served task names with it; the engine side is `vllm_ext.steps`."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import Any

STEPS_KEY = "ltv_steps"            # a request's `vllm_xargs` key: its step policy
TASK_KEY = "ltv_task"              # a request's `vllm_xargs` key: its task (multi-task serving)
DEFAULT_KEY = "ltv_shift_steps"    # the server's default, carried in `hf_overrides`
TASKS_CONFIG_KEY = "ltv_tasks"     # hf_overrides: JSON {task: {"path", "steps"}} (multi-task)
TASKS_ENV = "LTV_VLLM_TASKS"       # the served task names, for the frontend's request check
STORE_CONFIG_KEY = "ltv_task_store"  # hf_overrides: the task store's root (its tasks by key)
CHAT_KEY = "ltv_chat"              # a request's `vllm_xargs` key: "allow" a shifted chat request
CHAT_PATH = "/v1/chat/completions"
# routes that render a chat template around the request's text (each vLLM's own)
CHAT_PATHS = (CHAT_PATH, "/v1/responses", "/v1/messages")
ALL = None                         # the policy "every step"

# This process's task-store tasks: name → engine key "NAME@DIGEST" (the task endpoints add
# and remove them; the gate maps a request's task to its key; the request check admits the
# keys). The digest names the vector file's content, so a name deleted and added again with
# another vector is another key: an engine never answers it with the old vector.
RUNTIME: dict[str, str] = {}


def task_key(name: str, digest: str) -> str:
    return f"{name}@{digest}"


def parse_steps(value: Any) -> int | None:
    """`all` | `first` | n ≥ 0 → the number of leading generated tokens shifted (None: all)."""
    if value == "all":
        return ALL
    if value == "first":
        return 1
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{STEPS_KEY} must be 'all', 'first' or a count ≥ 0, got {value!r}")
    return value


def tasks_env(names: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The environment a multi-task engine's frontend needs: the task names a request may
    name. vLLM checks a request's parameters (`validate_params`) with a class method that sees
    only the request, in the process that admits it, so the names travel by environment."""
    return {TASKS_ENV: json.dumps(sorted(names))}


def served_tasks(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The task names this process's engine serves, and its task-store tasks' keys (empty:
    none, so any `ltv_task` is refused)."""
    raw = (os.environ if environ is None else environ).get(TASKS_ENV)
    static = _names(raw) if raw else frozenset()
    return static | frozenset(RUNTIME.values()) if RUNTIME else static


@functools.lru_cache(maxsize=4)
def _names(raw: str) -> frozenset[str]:
    # parsed once: every request's check reads it
    return frozenset(json.loads(raw))


def check_request(args: Mapping[str, Any], *, prompt_logprobs: bool,
                  tasks: frozenset[str]) -> None:
    """A request's `vllm_xargs` as the engine admits them (ValueError: an HTTP 400)."""
    if STEPS_KEY in args:
        parse_steps(args[STEPS_KEY])
    if TASK_KEY not in args:
        return
    task = args[TASK_KEY]
    if not isinstance(task, str) or task not in tasks:
        known = ", ".join(sorted(tasks)) or "none (this server serves no named tasks)"
        raise ValueError(f"unknown {TASK_KEY} {task!r}; served tasks: {known}")
    if prompt_logprobs:
        # vLLM computes prompt logprobs one request at a time after sampling, through a call
        # the engine cannot tell apart: with a per-request task they would be the bare model's
        raise ValueError(f"prompt_logprobs cannot be combined with {TASK_KEY}; serve the task "
                         "alone (one fused vector) for prompt logprobs")


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
    return xargs.get(CHAT_KEY) != "allow" and xargs.get(STEPS_KEY) not in (0, "0")
