"""Chat-fitted task vectors through the real OpenAI server: `/v1/chat/completions` shifted
without any opt-in when the request renders through the template the vector was fitted on,
each answer equal to transformers' greedy loop over the template's rendering (shifted at
exactly its policy's steps), streamed and not, mixed in one batch with completion tasks and
the bare model; a completion request, another template and a request's own template
refused in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch
from test_server import PROMPTS, RUNNERS, Shared, check_answer, start_server, stop

from conftest import make_vllm_llama, plan
from ltv_vllm.core.vector import TaskVector, model_identity
from ltv_vllm.tasks.chat import chat_task
from ltv_vllm.tasks.specs import BUILTIN_TASKS, label_token_ids

pytestmark = pytest.mark.slow(seconds=120)  # see conftest's ordering

# ChatML with a default system turn (as SmolLM2's and Qwen2.5's templates write it)
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "{{ '<s>system\nBe brief.</s>\n' }}{% endif %}"
          "{{ '<s>' + m['role'] + '\n' + m['content'] + '</s>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")
OTHER = CHATML.replace("Be brief.", "Be kind.")
SST2 = BUILTIN_TASKS["sst2"]


@pytest.fixture(scope="module", params=RUNNERS, ids=["v1", "v2"])
def shared_chat_server(tmp_path_factory, tokenizer, request):
    """A per-request multi-task server rendering chat with CHATML and keeping a task store:
    `alpha` fitted on the completion prompt, `delta` through CHATML (policy: the first
    token), `epsilon` through another template; (its `Shared`, model, vectors, the
    directory of the vector files, `zeta.pt` and `eta.pt` among them for uploads). On
    vLLM's V1 and V2 runners."""
    d = tmp_path_factory.mktemp("chat-model")
    model = make_vllm_llama(tokenizer, seed=37, tie=False)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    ident = model_identity(model, str(d))
    vecs = {}
    for name, template, seed in (("alpha", None, 1), ("delta", CHATML, 2),
                                 ("epsilon", OTHER, 3)):
        g = torch.Generator().manual_seed(seed)
        task = SST2 if template is None else chat_task(SST2, tokenizer, template=template)
        meta = {"task": {**SST2.to_dict(), "name": name}, "shift_steps": "first"}
        if template is not None:
            meta["prompt_format"] = task.record()
        vecs[name] = TaskVector("hidden", 0.5 * torch.randn(128, 8, generator=g),
                                torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None,
                                ident, tuple(label_token_ids(task, tokenizer)), meta)
    # zeta and eta: uploaded to the task store by a test (fitted through CHATML / OTHER)
    for name, template, seed in (("zeta", CHATML, 4), ("eta", OTHER, 5)):
        g = torch.Generator().manual_seed(seed)
        task = chat_task(SST2, tokenizer, template=template)
        meta = {"task": {**SST2.to_dict(), "name": name}, "shift_steps": "first",
                "prompt_format": task.record()}
        vecs[name] = TaskVector("hidden", 0.5 * torch.randn(128, 8, generator=g),
                                torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None,
                                ident, tuple(label_token_ids(task, tokenizer)), meta)
    tmp = tmp_path_factory.mktemp("chat-server")
    paths = [f"{n}={tv.save(tmp / f'{n}.pt')}" for n, tv in vecs.items()
             if n not in ("zeta", "eta")]
    for n in ("zeta", "eta"):
        vecs[n].save(tmp / f"{n}.pt")
    proc, url, log = start_server(d, paths, tmp, ("--chat-template", CHATML,
                                                  "--task-store", str(tmp / "store")),
                                  runner=request.param)
    try:
        shared = Shared(url)
        yield shared, model, vecs, tmp
        shared.close()
    finally:
        stop(proc, log)


@pytest.fixture
def chat_server(shared_chat_server, request):
    """`shared_chat_server` for one test (`Shared.use`): (url, model, vectors, directory).
    A test that uploads to its store deletes what it uploaded before it ends."""
    shared, *rest = shared_chat_server
    shared.use(request)
    return (shared.url, *rest)


def rendered(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         chat_template=CHATML, tokenize=False,
                                         add_generation_prompt=True)


def chat_logprobs(chunks) -> SimpleNamespace:
    """A chat answer's (or its streamed chunks') per-step tokens and top logprobs."""
    steps = [s for c in chunks for ch in c.choices if ch.logprobs for s in ch.logprobs.content]
    return SimpleNamespace(tokens=[s.token for s in steps], top_logprobs=[
        {t.token: t.logprob for t in s.top_logprobs} for s in steps])


def test_a_chat_fitted_task_is_shifted_through_chat(chat_server, tokenizer):
    url, model, vecs, _tmp = chat_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    tv = vecs["delta"]
    prompt = rendered(tokenizer, PROMPTS[0])
    assert prompt.startswith("<s>system\nBe brief.</s>\n<s>user\n")
    for xargs, n in ((None, 1), ({"ltv_steps": "all"}, 3), ({"ltv_steps": 0}, 0)):
        for stream in (False, True):
            kw = dict(model="delta", messages=[{"role": "user", "content": PROMPTS[0]}],
                      max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=5,
                      extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True,
                                  **({"vllm_xargs": xargs} if xargs else {})})
            chunks = (list(client.chat.completions.create(**kw, stream=True)) if stream
                      else [client.chat.completions.create(**kw)])
            assert {c.model for c in chunks} == {"delta"}
            lp = chat_logprobs(chunks)
            assert len(lp.tokens) == 3, (xargs, stream)
            check_answer(lp, {k: plan(tv, k, 3) for k in (0, 1, 2, 3)}, n, model, tokenizer,
                         prompt)


def test_system_prompt_and_history_are_shifted_as_sent(chat_server, tokenizer):
    """The stated rule (docs/serving.md, "Other system prompts and earlier turns"): a
    chat-fitted vector shifts a conversation as the client sends it — its own system turn and
    earlier turns — at the assistant's first token after them: the answer is transformers' on
    the template's rendering of that whole conversation, shifted at its first step, and told
    apart from the unshifted answer and the other step policies'."""
    url, model, vecs, _tmp = chat_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    tv = vecs["delta"]
    for messages in (
            [{"role": "system", "content": "You label reviews."},
             {"role": "user", "content": PROMPTS[0]}],
            [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
             {"role": "user", "content": PROMPTS[0]}],
            [{"role": "system", "content": "You label reviews."},
             {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
             {"role": "user", "content": PROMPTS[0]}]):
        prompt = tokenizer.apply_chat_template(messages, chat_template=CHATML, tokenize=False,
                                               add_generation_prompt=True)
        r = client.chat.completions.create(
            model="delta", messages=messages, max_tokens=3, temperature=0.0, logprobs=True,
            top_logprobs=5, extra_body={"return_tokens_as_token_ids": True,
                                        "ignore_eos": True})
        check_answer(chat_logprobs([r]), {k: plan(tv, k, 3) for k in (0, 1, 2, 3)}, 1, model,
                     tokenizer, prompt)


def test_other_renderings_are_refused(chat_server):
    url, _model, _vecs, _tmp = chat_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    chat = dict(messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=2)
    cases = [
        (lambda: client.completions.create(model="delta", prompt=PROMPTS[0], max_tokens=2),
         "fitted through the model's chat template; send the request to /v1/chat/completions"),
        (lambda: client.chat.completions.create(model="delta", **chat, extra_body={
            "chat_template": OTHER}), "a request's own chat_template"),
        (lambda: client.chat.completions.create(model="delta", **chat, extra_body={
            "add_generation_prompt": False}), "generation prompt"),
        (lambda: client.chat.completions.create(model="epsilon", **chat),
         "this server renders chat with"),
        (lambda: client.chat.completions.create(model="alpha", **chat),
         "fitted on the task's completion prompt"),
    ]
    for call, why in cases:
        with pytest.raises(openai.BadRequestError, match=why):
            call()
    # the opt-in shifts it anyway; the bare model's chat is nobody's rendering
    for name, xargs in (("delta", {"ltv_chat": "allow"}), ("epsilon", {"ltv_chat": "allow"})):
        client.chat.completions.create(model=name, **chat, extra_body={"vllm_xargs": xargs})
    client.completions.create(model="delta", prompt=PROMPTS[0], max_tokens=2,
                              extra_body={"vllm_xargs": {"ltv_chat": "allow"}})


def test_what_vllm_parses_is_what_the_gate_reads(chat_server):
    """The gate once read raw JSON while vLLM parses more: `add_generation_prompt` as 0,
    "false", "no", "off", "f" or 0.0 (all false to vLLM's request model) rendered without the
    generation prompt and was shifted by the chat-fitted vector (W1); /invocations with
    messages vLLM cannot validate ("x", [], a role that is a number, or valid messages with
    a completion's integer `logprobs`) is served by vLLM as a completion, and was shifted as
    one by a chat-fitted vector without consent (W2). Now the gate reads the request as vLLM's
    own models parse it: each is refused, in one line, and the server stays up."""
    import httpx

    url, _model, _vecs, _tmp = chat_server
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    for lax in (0, "false", "no", "off", "f", 0.0, "0", "n"):
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "delta", "messages": msgs, "max_tokens": 2,
            "add_generation_prompt": lax}, timeout=60)
        assert r.status_code == 400 and "generation prompt" in r.text, (lax, r.text)
    for bad in ("x", [{"role": 5, "content": "hi"}], []):
        r = httpx.post(f"{url}/invocations", json={
            "model": "delta", "messages": bad, "prompt": PROMPTS[0], "max_tokens": 2},
            timeout=60)
        # ([] is a chat request to vLLM's model: its own 400, an empty conversation)
        why = "empty conversation" if bad == [] else "send the request to /v1/chat/completions"
        assert r.status_code == 400 and why in r.text, (bad, r.text)
    r = httpx.post(f"{url}/invocations", json={
        "model": "delta", "messages": msgs, "prompt": PROMPTS[0], "logprobs": 5,
        "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "send the request to /v1/chat/completions" in r.text, \
        r.text
    # the same through chat with true spellings: served (and named as the task)
    for on in (1, "true", "yes"):
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "delta", "messages": msgs, "max_tokens": 2,
            "add_generation_prompt": on}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "delta", (on, r.text)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_a_chat_fitted_upload_is_served_through_chat(chat_server, tokenizer):
    """A chat-fitted vector uploaded to the task store is shifted through chat with no
    opt-in (= transformers on the rendering, at its policy's steps) and refused through
    completions; one fitted through another template than the server's is a 422 naming
    both; after DELETE the name uploaded again as a completion-fitted vector is that
    vector's: its chat refused, its completions shifted."""
    from test_server import HTTP

    url, model, vecs, tmp = chat_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    tasks = f"{url}/v1/ltv/tasks"

    def post(name, file):
        return HTTP.post(tasks, data={"name": name},
                         files={"vector": (file, (tmp / file).read_bytes())}, timeout=60)

    r = post("eta", "eta.pt")
    assert r.status_code == 422 and "renders chat with" in r.text, r.text
    assert "--chat-template" in r.json()["error"]["message"]
    r = post("zeta", "zeta.pt")
    assert r.status_code == 201, r.text
    assert r.json()["prompt_format"] == vecs["zeta"].provenance.prompt_format
    prompt = rendered(tokenizer, PROMPTS[1])
    for stream in (False, True):
        kw = dict(model="zeta", messages=[{"role": "user", "content": PROMPTS[1]}],
                  max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=5,
                  extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        chunks = (list(client.chat.completions.create(**kw, stream=True)) if stream
                  else [client.chat.completions.create(**kw)])
        check_answer(chat_logprobs(chunks), {k: plan(vecs["zeta"], k, 3) for k in (0, 1, 3)},
                     1, model, tokenizer, prompt)
    with pytest.raises(openai.BadRequestError, match="fitted through the model's chat template"):
        client.completions.create(model="zeta", prompt=PROMPTS[1], max_tokens=2)
    assert HTTP.delete(f"{tasks}/zeta").status_code == 200
    r = post("zeta", "alpha.pt")  # the name again, now a completion-fitted vector
    assert r.status_code == 201 and "prompt_format" not in r.json(), r.text
    with pytest.raises(openai.BadRequestError, match="fitted on the task's completion prompt"):
        client.chat.completions.create(model="zeta", max_tokens=2,
                                       messages=[{"role": "user", "content": PROMPTS[1]}])
    lp = client.completions.create(model="zeta", prompt=PROMPTS[1], max_tokens=2,
                                   temperature=0.0, logprobs=5,
                                   extra_body={"return_tokens_as_token_ids": True,
                                               "ignore_eos": True}).choices[0].logprobs
    check_answer(lp, {"alpha": plan(vecs["alpha"], 1, 2), "zeta": plan(vecs["zeta"], 1, 2)},
                 "alpha", model, tokenizer, PROMPTS[1])
    assert HTTP.delete(f"{tasks}/zeta").status_code == 200


def test_chat_and_completion_tasks_in_one_batch(chat_server, tokenizer):
    """delta through chat, alpha through completions, the bare model both ways, in flight
    together with staggered lengths: each answer is its own task's at its own steps and
    ≥ 10× the tolerance from every other's."""
    url, model, vecs, _tmp = chat_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    base = client.models.list().data[0].id
    jobs = [(name, route, p, 2 + r) for r in range(3) for p in PROMPTS
            for name, route in (("delta", "chat"), ("alpha", "completion"), (base, "chat"),
                                (base, "completion"))]
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}

    def call(i_job):
        i, (name, route, text, n) = i_job
        # arrivals spread on purpose: requests joining a batch mid-decode is the case tested
        time.sleep(0.4 * i / len(jobs))
        if route == "chat":
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": text}], max_tokens=n,
                temperature=0.0, logprobs=True, top_logprobs=5, extra_body=extra)
            return chat_logprobs([r])
        return client.completions.create(model=name, prompt=text, max_tokens=n,
                                         temperature=0.0, logprobs=5,
                                         extra_body=extra).choices[0].logprobs

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(call, enumerate(jobs)))
    for (name, route, text, n), lp in zip(jobs, results, strict=True):
        assert len(lp.tokens) == n, (name, route)
        prompt = rendered(tokenizer, text) if route == "chat" else text
        plans = {"delta": plan(vecs["delta"], 1, n), "alpha": plan(vecs["alpha"], 1, n),
                 "(bare)": plan(None, 0, n)}
        right = name if name in vecs else "(bare)"
        check_answer(lp, plans, right, model, tokenizer, prompt)


def test_classify_through_chat(chat_server, tokenizer):
    """`classify(..., chat=True)` (and `ltv-vllm classify --chat`): the label-restricted
    distribution at the assistant's first token of the rendered conversation, with the
    task's shift, as transformers gives it; far from the bare model's and from the
    completion prompt's."""
    from conftest import reference_logprobs
    from ltv_vllm.serving.client import classify

    url, model, vecs, _tmp = chat_server
    task = chat_task(SST2, tokenizer, template=CHATML)
    ids = label_token_ids(task, tokenizer)
    texts = ["the plot is dull", "a gorgeous, witty movie", "leaders meet for peace talks"]
    got = classify(url, SST2, texts, model="delta", chat=True)
    for text, c in zip(texts, got, strict=True):
        query = SST2.query(text)
        want = {}
        for name, prompt, tv in (("right", rendered(tokenizer, query), vecs["delta"]),
                                 ("bare", rendered(tokenizer, query), None),
                                 ("completion", query, vecs["delta"])):
            lp = reference_logprobs(model, tokenizer, prompt, [], tv)[-1][ids]
            want[name] = torch.softmax(lp, -1).tolist()
        served = [c.probs[lab] for lab in SST2.labels]
        assert max(abs(a - b) for a, b in zip(served, want["right"], strict=True)) < 1e-4
        for other in ("bare", "completion"):
            assert max(abs(a - b) for a, b in zip(served, want[other], strict=True)) > 1e-3
        assert c.label == SST2.labels[max(range(2), key=lambda i: want["right"][i])]


def test_docs_chat_blocks_run(chat_server, tmp_path):
    """The docs' chat client blocks, run as scripts against this server (its URL; its
    chat-fitted task `delta` for their `trec`)."""
    from test_docs import CHAT_CLIENT, run_client_blocks

    url, _model, _vecs, _tmp = chat_server
    run_client_blocks(CHAT_CLIENT, url, "delta", tmp_path)


def test_a_chat_fitted_store_entry_is_served_after_a_restart(chat_server, tokenizer, tmp_path,
                                                             request):
    """A chat-fitted entry already in the store when a server starts: the gate learns its
    template from the stored vector (not from an upload), so its chat requests are shifted
    with no opt-in and its completions refused, as before the restart."""
    from pathlib import Path

    from ltv_vllm.serving.store.taskstore import TaskStore

    url, model, vecs, _tmp = chat_server
    base = openai.OpenAI(base_url=f"{url}/v1", api_key="x").models.list().data[0].id
    store = TaskStore(tmp_path / "store")
    store.add("zeta", vecs["zeta"], Path(base))
    proc, url2, log = start_server(base, [], tmp_path, ("--chat-template", CHATML,
                                                        "--task-store", str(store.root)),
                                   runner=request.node.callspec.params["shared_chat_server"])
    try:
        client = openai.OpenAI(base_url=f"{url2}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model="zeta", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=2,
            temperature=0.0, logprobs=True, top_logprobs=5,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        check_answer(chat_logprobs([r]), {k: plan(vecs["zeta"], k, 2) for k in (0, 1, 2)}, 1,
                     model, tokenizer, rendered(tokenizer, PROMPTS[0]))
        with pytest.raises(openai.BadRequestError, match="fitted through the model's chat"):
            client.completions.create(model="zeta", prompt=PROMPTS[0], max_tokens=2)
    finally:
        stop(proc, log)


# a test file run by `test_a_test_that_leaves_a_task_fails_the_next_one`: this file's own
# wiring of a shared server (a module fixture holding `Shared`, a test fixture calling `use`)
LEAKY_TESTS = '''
import os

import pytest
from test_server import HTTP, Shared


@pytest.fixture(scope="module")
def shared_server():
    shared = Shared(os.environ["LTV_TEST_URL"])
    yield shared
    shared.close()


@pytest.fixture
def server(shared_server, request):
    shared_server.use(request)
    return shared_server.url


def test_leaves_a_task(server):
    with open(os.environ["LTV_TEST_VECTOR"], "rb") as f:
        r = HTTP.post(f"{server}/v1/ltv/tasks", data={"name": "leaked"},
                      files={"vector": ("leaked.pt", f)})
    assert r.status_code == 201, r.text


def test_next(server):
    pass
'''


def test_a_test_that_leaves_a_task_fails_the_next_one(chat_server, tmp_path):
    """The shared servers' guard (`test_server.Shared`), on this live server: in a run of
    two tests, the first uploads a task and leaves it; the second, which only uses the
    server, fails before it starts, naming the first; the end of the run fails too. Then the
    task is deleted here, so the next test of this file finds the server as it started
    (were it not, that test would fail the same way)."""
    from test_server import HTTP

    url, _model, _vecs, tmp = chat_server
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    env = {**os.environ, "LTV_TEST_URL": url, "LTV_TEST_VECTOR": str(tmp / "alpha.pt"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p",
                            "no:cacheprovider", "test_leaky.py"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        assert HTTP.delete(f"{url}/v1/ltv/tasks/leaked").status_code == 200
    out = r.stdout
    assert r.returncode == 1, out
    assert "PASSED test_leaky.py::test_leaves_a_task" in out, out
    assert "ERROR test_leaky.py::test_next" in out, out
    assert re.search(r"left changed by test_leaky.py::test_leaves_a_task: \{'models'", out), out
    # test_next's set-up, and the run's end
    assert re.search(r"1 passed, (\d+ warnings?, )?2 errors", out), out
