"""Classification, generation under a step policy and the task store of a running server.

The server runs with `--logprobs-mode processed_logprobs`, so a completion request with
`allowed_token_ids` = the label tokens returns log-probabilities renormalised over the label
set: the paper's label-restricted distribution P(c | p; C), from the engine itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ltv_vllm.errors import UserError
from ltv_vllm.tasks.chat import system_turn
from ltv_vllm.tasks.specs import Task


class ClientError(UserError):
    """The server refused or could not be reached (one line)."""


@dataclass(frozen=True)
class Classification:
    label: str
    probs: dict[str, float]  # label word → restricted probability


def classification(lp: dict[int, float], label_ids: Sequence[int],
                   labels: Sequence[str]) -> Classification:
    """Label and label-restricted probabilities from logprobs by token id (a label the
    engine did not return gets probability 0)."""
    by_lab = {lab: lp[i] for i, lab in zip(label_ids, labels, strict=True) if i in lp}
    z = sum(math.exp(v) for v in by_lab.values())
    probs = {lab: math.exp(by_lab[lab]) / z if lab in by_lab else 0.0 for lab in labels}
    return Classification(label=max(probs, key=probs.__getitem__), probs=probs)


def token_logprobs(top: dict[str, float]) -> dict[int, float]:
    """`top_logprobs` keyed `token_id:N` (return_tokens_as_token_ids) → {N: logprob}."""
    return {int(k.split(":", 1)[1]): v for k, v in top.items()}


def _auth(api_key: str | None) -> dict[str, str]:
    """The header a server started with --api-key wants; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _openai(base_url: str, api_key: str | None) -> Any:
    import openai

    # the openai client insists on some key; a server without --api-key ignores this one
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "ltv-vllm",
                         max_retries=0)


def label_ids_from_server(base_url: str, model: str, task: Task, *,
                          api_key: str | None = None, chat: bool = False) -> list[int]:
    """First token of " " + label for each label (of the label itself after a chat
    template's generation prompt), from the server's own tokenizer."""
    import httpx

    ids = []
    for lab in task.labels:
        try:
            r = httpx.post(f"{base_url}/tokenize",
                           json={"model": model, "prompt": lab if chat else " " + lab,
                                 "add_special_tokens": False},
                           headers=_auth(api_key), timeout=30)
        except httpx.HTTPError:
            raise ClientError(f"cannot reach {base_url}") from None
        if r.status_code != 200:
            raise ClientError(f"/tokenize failed ({r.status_code}): {r.text[:200]}")
        toks = r.json()["tokens"]
        ids.append(int(toks[0]))
    if len(set(ids)) != len(ids):
        raise ClientError(f"labels of task {task.name!r} share a first token: {ids}")
    return ids


def classify(
    base_url: str,
    task: Task,
    texts: Sequence[str],
    *,
    model: str | None = None,
    concurrency: int = 8,
    api_key: str | None = None,
    chat: bool = False,
) -> list[Classification]:
    """Classify `texts` with the server's task `model` (default: the task's name). `chat`:
    through /v1/chat/completions, the task's query as the user's message and the label read
    at the assistant's first token (for a vector fitted with `extract --format chat`)."""
    import openai

    base_url = base_url.rstrip("/")
    model = model or task.name
    ids = label_ids_from_server(base_url, model, task, api_key=api_key, chat=chat)
    client = _openai(base_url, api_key)
    body = {"allowed_token_ids": ids, "return_tokens_as_token_ids": True}

    def one(text: str) -> Classification:
        # the task's instruction line and query (a chat rendering adds no tail); through chat
        # the task's system turn before it, as the vector was fitted
        query = task.lead + Task.query(task, text)
        try:
            if chat:
                messages = [*system_turn(task), {"role": "user", "content": query}]
                r = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=1,
                    temperature=0.0, logprobs=True, top_logprobs=len(ids), extra_body=body)
                top = token_logprobs({t.token: t.logprob for t in
                                      r.choices[0].logprobs.content[0].top_logprobs})
            else:
                r = client.completions.create(
                    model=model, prompt=query, max_tokens=1, temperature=0.0,
                    logprobs=len(ids), extra_body=body)
                top = token_logprobs(r.choices[0].logprobs.top_logprobs[0])
        except openai.APIStatusError as e:
            raise ClientError(f"server refused ({e.status_code}): {_message(e)}") from None
        except openai.APIConnectionError:
            raise ClientError(f"cannot reach {base_url}") from None
        return classification(top, ids, task.labels)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, texts))


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]


def generate(base_url: str, prompt: str, *, model: str, steps: str | int | None = "first",
             max_tokens: int = 16, api_key: str | None = None) -> Generation:
    """Greedy generation from a served task `model`, shifted at the generated tokens `steps`
    names (`first`, `all` or a count; None: the server's default for the task). One request:
    the engine applies the step policy itself (`vllm_xargs.ltv_steps`), so the prompt is
    prefilled once."""
    import openai

    if max_tokens < 1:
        raise ClientError(f"max_tokens must be at least 1, got {max_tokens}")
    client = _openai(base_url.rstrip("/"), api_key)
    body: dict[str, Any] = {"return_tokens_as_token_ids": True}
    if steps is not None:
        body["vllm_xargs"] = {"ltv_steps": steps}
    try:
        c = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0.0, logprobs=0, extra_body=body).choices[0]
    except openai.APIStatusError as e:
        raise ClientError(f"server refused ({e.status_code}): {_message(e)}") from None
    except openai.APIConnectionError:
        raise ClientError(f"cannot reach {base_url}") from None
    toks = [int(t.split(":", 1)[1]) for t in c.logprobs.tokens]  # type: ignore[union-attr]
    return Generation(text=c.text, token_ids=toks)


def first_step_only(base_url: str, prompt: str, *, vector: str, max_tokens: int = 16,
                    api_key: str | None = None) -> Generation:
    """`generate` with the task vector on the first generated token only."""
    return generate(base_url, prompt, model=vector, steps="first", max_tokens=max_tokens,
                    api_key=api_key)


# -- the server's task store (/v1/ltv/tasks) -------------------------------------------------
def _tasks_call(method: str, base_url: str, path: str = "", *, api_key: str | None = None,
                **kw: Any) -> Any:
    import httpx

    url = f"{base_url.rstrip('/')}/v1/ltv/tasks{path}"
    try:
        r = httpx.request(method, url, headers=_auth(api_key), timeout=120, **kw)
    except httpx.HTTPError:
        raise ClientError(f"cannot reach {base_url}") from None
    if r.status_code >= 400:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:200]
        raise ClientError(f"server refused ({r.status_code}): {msg}")
    return r.json()


def list_remote_tasks(base_url: str, *, api_key: str | None = None) -> list[dict[str, Any]]:
    return list(_tasks_call("GET", base_url, api_key=api_key)["data"])


def _task_path(name: str) -> str:
    """"/NAME" for a checked task name (StoreError, before any request, otherwise): a name
    like "x/../other" or "v?x=1" would address another URL than the task's."""
    from urllib.parse import quote

    from ltv_vllm.serving.store.taskstore import (
        check_name,  # here: taskstore imports the vector stack
    )

    return "/" + quote(check_name(name), safe="")


def remote_task(base_url: str, name: str, *, api_key: str | None = None) -> dict[str, Any]:
    return dict(_tasks_call("GET", base_url, _task_path(name), api_key=api_key))


def delete_remote_task(base_url: str, name: str, *, api_key: str | None = None) -> None:
    _tasks_call("DELETE", base_url, _task_path(name), api_key=api_key)


def upload_task(base_url: str, name: str, vector: str, *, api_key: str | None = None
                ) -> dict[str, Any]:
    """Send a task-vector file to the server's store; served when this returns."""
    from pathlib import Path

    _task_path(name)  # checked here, as for the calls that put it in the URL
    data = Path(vector).read_bytes()
    return dict(_tasks_call("POST", base_url, api_key=api_key, data={"name": name},
                            files={"vector": (Path(vector).name, data)}))


def compile_remote(base_url: str, request: dict[str, Any], *, wait: bool = False,
                   api_key: str | None = None, poll: float = 1.0,
                   on_status: Any = None) -> dict[str, Any]:
    """POST a compile request (`store.compile`); with `wait`, poll until the task is
    served (or the compile failed: ClientError), calling `on_status(view)` each time."""
    import time

    from ltv_vllm.serving.store.taskstore import check_name

    check_name(request.get("name"))  # `wait` polls it in the URL: checked before any request
    view = dict(_tasks_call("POST", base_url, api_key=api_key, json=request))
    while wait and view.get("status") != "ready":
        if on_status is not None:
            on_status(view)
        if view.get("status") == "failed":
            raise ClientError(f"compiling {request.get('name')!r} failed: {view.get('error')}")
        time.sleep(poll)
        view = remote_task(base_url, str(request["name"]), api_key=api_key)
    if on_status is not None:
        on_status(view)
    return view


def _message(e: Any) -> str:
    try:
        return str(e.body.get("message") or e.body.get("error", {}).get("message"))
    except AttributeError:
        return str(e)
