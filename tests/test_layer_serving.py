"""Layer tasks inside vLLM's engine (`engine.layer_shift`, `engine.prefix_keys`) on both of
its runners (V2 through `tests/v2shim`), against transformers.

One mixed batch (`vllm_workers/layer_mix.py`): layer tasks at block 0, block 1 and both,
each at its own positions (all, the last prompt token, every token-producing row, the prompt
only, two steps, none), a final-layer task and the bare model, long prompts prefilled in
chunks, four requests at a time. Every row is a hand-made patched forward of the whole
sequence — no cache, the delta added by hand at exactly the positions its policy names — to
1e-4 in float32, and at least ten tolerances from what a misplaced shift would give (the bare
model, the task a block off, its positions one step longer or all of them). V2 equals V1
token for token.

Then the prefix cache, one request after another over one long prompt: a layer task that
shifts the prompt reuses no block a bare request or another task left; a task that shifts
from the last prompt token on reuses the bare blocks before it; the same task again reuses
its own; a bare request and a task asked to shift nothing reuse the bare blocks — and every
answer is its own reference, so a shared shifted block would show.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import MARGIN, make_vllm_llama
from ltv_vllm.core.layer_task import LayerPolicy, LayerTask
from ltv_vllm.core.vector import TaskVector, model_identity
from ltv_vllm.methods.base import decoder_layers, edits

pytestmark = pytest.mark.slow(seconds=60)  # see conftest's ordering

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "vllm_workers"))
from layer_mix import CACHE, CACHED, MIX, TOKENS  # noqa: E402

TOL = 1e-4


def run(runner: str, d: Path, vectors: dict[str, str], out: Path) -> dict:
    """`layer_mix.py` in a process of its own on vLLM's V1 ("0") or V2 ("1") runner (the
    runner test's launcher)."""
    from test_v2_runner import run as run_worker

    return run_worker(runner, d, vectors, out,
                      worker=[str(HERE / "vllm_workers" / "layer_mix.py")])


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """The model, its tasks (three layer tasks and a final-layer one) and their files."""
    tmp = tmp_path_factory.mktemp("layers")
    d = tmp / "model"
    model = make_vllm_llama(tokenizer, seed=41, tie=False)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    ident = model_identity(model, str(d))
    g = torch.Generator().manual_seed(5)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g)

    tasks = {
        "ctl": LayerTask((0, 1), randn(2, 128, scale=0.5), None, None, ident,
                         LayerPolicy.parse("all"), provenance={"task": {"name": "ctl"}}),
        "map": LayerTask((0,), None, randn(1, 128, 4, scale=0.6), randn(1, 128, 4, scale=0.6),
                         ident, LayerPolicy.parse("last"), provenance={"task": {"name": "map"}}),
        "both": LayerTask((0, 1), randn(2, 128, scale=0.3), randn(2, 128, 4, scale=0.4),
                          randn(2, 128, 4, scale=0.4), ident, LayerPolicy.parse("generated"),
                          provenance={"task": {"name": "both"}}),
        "add": LayerTask((1,), randn(1, 128, scale=0.4), None, None, ident,
                         LayerPolicy.parse("all"), provenance={"task": {"name": "add"}}),
        "head": TaskVector("hidden", randn(128, 8, scale=0.5),
                           torch.linalg.qr(randn(128, 8))[0], None, ident, (5, 6),
                           {"task": {"name": "head"}, "shift_steps": "first"}),
    }
    paths = {name: str(t.save(tmp / f"{name}.safetensors")) for name, t in tasks.items()}
    return tmp, d, model, tasks, paths


@pytest.fixture(scope="module")
def runs(served):
    tmp, d, _, _, paths = served
    return {"v1": run("0", d, paths, tmp / "v1.json"), "v2": run("1", d, paths, tmp / "v2.json")}


def patched_logprobs(model, tokenizer, prompt: str, tokens: list[int], task, policy,
                     head: TaskVector | None = None, head_steps: int = 0) -> torch.Tensor:
    """The whole sequence in one forward, no cache: `task`'s delta added by hand at the
    positions `policy` names (every prompt position with `prompt`; the row producing
    generated token s, position P − 2 + s, while s is within its steps); a final-layer
    `head` vector on its first `head_steps` rows. Log-probs of generated token s at row s."""
    from ltv_vllm.extraction.apply import task_vector_applied

    p_ids = tokenizer(prompt)["input_ids"]
    ids = p_ids + list(tokens)
    n0 = len(p_ids)
    marked = set(range(n0)) if task is not None and policy.prompt else set()
    if task is not None:
        marked |= {n0 - 2 + s for s in range(1, len(tokens) + 1) if policy.shifts_step(s)}
    layers = decoder_layers(model)

    def edit(x, ell):
        y = x.clone()
        for p in sorted(marked):
            y[0, p] = x[0, p] + task.delta(ell, x[0, p][None].float())[0].to(x.dtype)
        return y

    hooks = [(layers[ell], lambda x, ell=ell: edit(x, ell)) for ell in
             (task.layers if task is not None else ())]
    with torch.no_grad(), edits(outputs=hooks):
        bare = model(torch.tensor([ids])).logits[0]
        if head is not None:
            with task_vector_applied(model, head):
                shifted = model(torch.tensor([ids])).logits[0]
            rows = torch.arange(len(ids))
            bare = torch.where(((rows >= n0 - 1) & (rows < n0 - 1 + head_steps))[:, None],
                               shifted, bare)
    return torch.log_softmax(bare.double(), -1)[n0 - 1: n0 - 1 + len(tokens)]


def distance(got: list[dict[str, float]], ref: torch.Tensor) -> float:
    return max(abs(v - float(ref[s][int(t)])) for s, top in enumerate(got)
               for t, v in top.items())


def off_by_one_block(task: LayerTask) -> LayerTask:
    """The task with each block's shift on the other block (what a hook on the wrong layer
    would do; the model has two)."""
    moved = [1 - ell for ell in task.layers]
    order = sorted(range(len(moved)), key=moved.__getitem__)

    def pick(t):
        return None if t is None else t[order]

    return LayerTask(tuple(moved[i] for i in order), pick(task.bias), pick(task.U),
                     pick(task.V), task.model, task.policy)


def asked(tasks, task_name, more):
    """The layer task a request asks for: its own, scaled by `ltv_scale`, plus its `ltv_mix`
    (`core.layer_task.combine`, written apart from the engine's sum)."""
    from ltv_vllm.core.layer_task import combine

    own = tasks[task_name]
    parts = [(own, float(more.get("ltv_scale", 1.0)))]
    from ltv_vllm.serving.contract.wire import parse_mix

    mix = parse_mix(more["ltv_mix"]) if "ltv_mix" in more else {}
    parts += [(tasks[n], float(s)) for n, s in mix.items()]
    return combine(parts) if len(parts) > 1 else own.scaled(parts[0][1])


def assert_row(model, tokenizer, tasks, prompt, task_name, steps, row, what, more=None):
    tokens, got = row[0], row[1]
    assert len(got) == TOKENS, what
    if task_name == "head":
        ref = patched_logprobs(model, tokenizer, prompt, tokens, None, None, tasks["head"], 1)
        assert distance(got, ref) < TOL, what
        bare = patched_logprobs(model, tokenizer, prompt, tokens, None, None)
        assert distance(got, bare) >= MARGIN * TOL, what
        return
    plain = tasks.get(task_name)
    task = asked(tasks, task_name, more) if more else plain
    policy = (LayerPolicy.parse(steps) if steps is not None else plain.policy) if task \
        else LayerPolicy(False, 0)
    own = patched_logprobs(model, tokenizer, prompt, tokens, task, policy)
    d = distance(got, own)
    assert d < TOL, (what, "off its own answer by", d)
    if task is None or (policy.steps == 0 and not policy.prompt):
        return
    wrong = {"bare": (None, LayerPolicy(False, 0)), "a block off": (off_by_one_block(task),
                                                                   policy),
             "every position": (task, LayerPolicy(True, None))}
    if policy.steps is not None:
        wrong["one step more"] = (task, LayerPolicy(False, policy.steps + 1))
    if more:  # its scale or its mix ignored
        wrong["the task as its file has it"] = (plain, policy)
    for name, (t, p) in wrong.items():
        if (t is task and p == policy) or (name == "one step more" and policy.prompt):
            continue  # the row's own answer
        alt = patched_logprobs(model, tokenizer, prompt, tokens, t, p)
        if name == "one step more" and torch.equal(alt, own):
            continue
        assert distance(got, alt) >= MARGIN * TOL, (what, f"{name} is only "
                                                           f"{distance(got, alt):.2e} away")


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_mixed_batch_of_layer_tasks_equals_patched_forwards(served, runs, tokenizer, runner):
    _, _, model, tasks, _ = served
    out = runs[runner]
    assert out["v2"] is (runner == "v2")  # vLLM's own config says which runner ran
    for i, (prompt, task, steps, *more) in enumerate(MIX):
        assert_row(model, tokenizer, tasks, prompt, task, steps, out["rows"][i],
                   f"{runner} row {i}: {task} {steps} {more}", *more)


def test_v2_answers_as_v1(runs):
    for i in range(len(MIX)):
        assert runs["v2"]["rows"][i][0] == runs["v1"]["rows"][i][0], (i, "V2 differs from V1")


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_prefix_cache_never_shares_a_shifted_block(served, runs, tokenizer, runner):
    _, _, model, tasks, _ = served
    cache = runs[runner]["cache"]
    prompt = CACHED
    n0 = len(tokenizer(prompt)["input_ids"])
    for i, (task, steps) in enumerate(CACHE):
        assert_row(model, tokenizer, tasks, prompt, task, steps, cache[i],
                   f"{runner} cache request {i}: {task} {steps}")
    cached = [row[2] for row in cache]
    block = 32  # the CPU attention's smallest
    before_last = (n0 - 1) // block * block  # the bare blocks before the last prompt token
    assert cached[0] == 0                  # bare, first: nothing cached yet
    assert cached[1] == 0                  # ctl shifts the whole prompt: no bare block fits
    assert cached[2] == 0                  # another task, the whole prompt: not ctl's blocks
    assert cached[3] == before_last > 0    # map shifts from the last prompt token on
    assert cached[4] >= before_last > 0    # ctl again: its own blocks
    assert cached[5] >= before_last        # bare again: the bare blocks
    assert cached[6] >= before_last        # ctl asked to shift nothing: the bare blocks


def test_ltv_vllm_serve_serves_layer_tasks_by_name(served, tokenizer):
    """`ltv-vllm serve` in vLLM's default process layout with two layer tasks and a
    final-layer one by name, its start-up self-check with the layer probes: requests for
    each, the bare model and a layer word sent through the gate (`ltv_steps: "prompt"`), all
    in flight together; each answer is its own patched forward. A policy the vocabulary
    does not name is a 400 in one line."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai
    from test_server import start_server, stop

    tmp, d, model, tasks, paths = served
    proc, url, log = start_server(d, [f"{n}={paths[n]}" for n in ("ctl", "map", "head",
                                                                 "add")],
                                  tmp, ("--task-store", str(tmp / "store"), "--layer-uploads"),
                                  layout="default")
    try:
        # the start-up self-check ran the layer probes beside the final-layer ones
        started = Path(log.name).read_text()
        assert "selfcheck passed on vLLM 0.32.0, V1 runner, cpu, layer probes: 23 rows" in \
            started, started[-2000:]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        jobs = [(MIX[0][0], "ctl", None, {}), (MIX[1][0], "map", None, {}),
                (MIX[2][0], "map", "generated", {}), (MIX[4][0], "head", None, {}),
                (MIX[6][0], str(d), None, {}), (MIX[3][0], "ctl", "prompt", {}),
                (MIX[9][0], "ctl", "all", {"ltv_scale": 2.0, "ltv_mix": "add=0.5"})]

        def ask(job):
            prompt, name, steps, more = job
            xargs = {**({"ltv_steps": steps} if steps else {}), **more}
            extra = {"return_tokens_as_token_ids": True,
                     **({"vllm_xargs": xargs} if xargs else {})}
            return client.completions.create(model=name, prompt=prompt, max_tokens=TOKENS,
                                             temperature=0.0, logprobs=3,
                                             extra_body=extra).choices[0].logprobs

        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
        for (prompt, name, steps, more), lp in zip(jobs, answers, strict=True):
            toks = [int(t.split(":", 1)[1]) for t in lp.tokens]
            got = [{k.split(":", 1)[1]: v for k, v in top.items()} for top in lp.top_logprobs]
            task = None if name == str(d) else name
            assert_row(model, tokenizer, tasks, prompt, task, steps, [toks, got],
                       f"served {name} {steps} {more}", more)
        for xargs, message in (({"ltv_mix": "map=1"}, "is a map"),
                               ({"ltv_scale": 1e9}, "ltv_scale must be"),
                               ({"ltv_mix": "nothing=1"}, "not a layer task")):
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(model="ctl", prompt="x", max_tokens=1,
                                          extra_body={"vllm_xargs": xargs})
        with pytest.raises(openai.BadRequestError, match="apply to a layer task"):
            client.completions.create(model="head", prompt="x", max_tokens=1,
                                      extra_body={"vllm_xargs": {"ltv_scale": 2.0}})
        # malformed layer asks: each a 400, never a 500, and the server answers on
        bad = [("ltv_scale", "2"), ("ltv_scale", [1]), ("ltv_scale", -1e9),
               ("ltv_scale", 1e300), ("ltv_mix", ""), ("ltv_mix", "add"),
               ("ltv_mix", "add="), ("ltv_mix", "=1"), ("ltv_mix", "add=1,"),
               ("ltv_mix", "add=nan"), ("ltv_mix", "add=1e400"), ("ltv_mix", "a" * 5000),
               ("ltv_mix", ["add", 1]), ("ltv_mix", 3), ("ltv_mix", "add=1,add=2"),
               ("ltv_mix", "ctl=1"), ("ltv_mix", "head=1"), ("ltv_mix", "add@x=1"),
               ("ltv_steps", "prompt+2"), ("ltv_steps", "Generated")]
        for key, value in bad:
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "ctl", "prompt": "x", "max_tokens": 1,
                "vllm_xargs": {key: value}})
            assert r.status_code == 400, (key, value, r.status_code, r.text[:300])
        again = client.completions.create(model="ctl", prompt=MIX[0][0], max_tokens=1,
                                          temperature=0.0)
        assert again.choices[0].text
        with pytest.raises(openai.BadRequestError, match="ltv_steps must be") as e:
            client.completions.create(model="ctl", prompt="x", max_tokens=1,
                                      extra_body={"vllm_xargs": {"ltv_steps": "sideways"}})
        assert "\n" not in str(e.value.body.get("message", e.value))
        check_store_layer_tasks(served, tokenizer, url, client)
    finally:
        stop(proc, log)


def served_row(client, name, prompt, steps, more):
    """One greedy completion of `name` with its layer asks, as `assert_row` reads a row:
    [its tokens, each step's top log-probabilities by token id]."""
    xargs = {**({"ltv_steps": steps} if steps else {}), **more}
    lp = client.completions.create(
        model=name, prompt=prompt, max_tokens=TOKENS, temperature=0.0, logprobs=3,
        extra_body={"return_tokens_as_token_ids": True,
                    **({"vllm_xargs": xargs} if xargs else {})}).choices[0].logprobs
    toks = [int(t.split(":", 1)[1]) for t in lp.tokens]
    got = [{k.split(":", 1)[1]: v for k, v in top.items()} for top in lp.top_logprobs]
    return [toks, got]


def check_store_layer_tasks(served, tokenizer, url, client):
    """Layer tasks uploaded to the same server's task store (`--layer-uploads`), served by
    name beside the command line's: each answer its own patched forward, with its default
    positions, a request's own, a scale and a command-line task mixed in; a store task that
    shifts the prompt, asked after the bare model over one long prompt, reuses none of its
    blocks (else its answer would be the bare prefix's). A store task in a mix, and a
    client's own `ltv_layer`, are 400s in one line."""
    import httpx
    import openai

    from ltv_vllm.serving.client import upload_task

    tmp, d, model, tasks, _ = served
    ident = tasks["ctl"].model
    g = torch.Generator().manual_seed(9)
    store = {
        # at block 0: the KV of block 1 reads its output (the last block's feeds none)
        "s-ctl": LayerTask((0,), 0.5 * torch.randn(1, 128, generator=g), None, None, ident,
                           LayerPolicy.parse("all")),
        "s-map": LayerTask((0, 1), 0.3 * torch.randn(2, 128, generator=g),
                           0.5 * torch.randn(2, 128, 4, generator=g),
                           0.5 * torch.randn(2, 128, 4, generator=g), ident,
                           LayerPolicy.parse("generated")),
    }
    for name, task in store.items():
        view = upload_task(url, name, str(task.save(tmp / f"{name}.safetensors")))
        assert view["kind"] == "layer" and view["positions"] == str(task.policy), view
    every = {**tasks, **store}
    jobs = [(CACHED, str(d), None, {}), (CACHED, "s-ctl", None, {}),
            (MIX[1][0], "s-map", None, {}), (MIX[2][0], "s-map", "2", {}),
            (MIX[9][0], "s-ctl", None, {"ltv_scale": -1.5, "ltv_mix": "add=0.5"})]
    for prompt, name, steps, more in jobs:  # one after another: the cache's order
        assert_row(model, tokenizer, every, prompt, None if name == str(d) else name, steps,
                   served_row(client, name, prompt, steps, more), f"store {name} {steps} {more}",
                   more)
    for body, message in (({"model": "ctl", "vllm_xargs": {"ltv_mix": "s-ctl=1"}},
                           "task-store task 's-ctl'"),
                          ({"model": "s-ctl", "vllm_xargs": {"ltv_layer": "add"}},
                           "ltv_layer is the server's own")):
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"prompt": "x", "max_tokens": 1, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert "\n" not in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="apply to a layer task"):
        client.completions.create(model="head", prompt="x", max_tokens=1,
                                  extra_body={"vllm_xargs": {"ltv_scale": 2.0}})


def test_store_layer_tasks_on_the_v2_runner(served, tokenizer):
    """The same store layer tasks, uploaded to a server on vLLM's V2 runner (through
    `tests/v2shim`): the V2 model state reads a store task's kind and positions from its
    request as V1's processor does, each answer its own patched forward."""
    import openai
    from test_server import start_server, stop

    tmp, d, _, _, paths = served
    proc, url, log = start_server(d, [f"{n}={paths[n]}" for n in ("ctl", "head", "add")],
                                  tmp, ("--task-store", str(tmp / "store-v2"),
                                        "--layer-uploads"), runner="1")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        check_store_layer_tasks(served, tokenizer, url, client)
        assert "V2 runner" in Path(log.name).read_text()
    finally:
        stop(proc, log)


def test_a_fused_layer_task_shifts_every_request(served, tokenizer):
    """`ltv-vllm serve --task-vector ctl.safetensors` (one unnamed layer task, as llama.cpp's
    global control vector), in vLLM's default process layout: every request shifted at its
    positions, a request's own policy and scale honoured, each answer its own patched
    forward; the start-up self-check ran the layer probes beside the fused task."""
    import openai
    from test_server import start_server, stop

    tmp, d, model, tasks, paths = served
    proc, url, log = start_server(d, [paths["ctl"]], tmp, layout="default")
    try:
        started = Path(log.name).read_text()
        assert "selfcheck passed on vLLM 0.32.0, V1 runner, cpu, layer probes" in started, \
            started[-2000:]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        name = client.models.list().data[0].id
        for prompt, steps, more in ((MIX[0][0], None, {}), (MIX[3][0], "generated", {}),
                                    (MIX[1][0], "last", {"ltv_scale": 0.5})):
            assert_row(model, tokenizer, tasks, prompt, "ctl", steps,
                       served_row(client, name, prompt, steps, more), f"fused {steps} {more}",
                       more)
    finally:
        stop(proc, log)


def test_layer_tasks_keep_piecewise_cuda_graphs_split_at_their_op(tmp_path, tokenizer,
                                                                  monkeypatch):
    """With a layer task and no compilation flag of the user's, `serve` asks a GPU engine for
    piecewise CUDA graphs (a CPU one stays eager), and the plugin names the layer op among
    the splitting ops vLLM fills in when the user names none (an own list is the user's);
    a full-graph mode is refused at engine start (`layer_shift.check_graphs`)."""
    from click.testing import CliRunner

    from conftest import write_model_and_vectors
    from ltv_vllm.cli import main
    from ltv_vllm.core.layer_task import LayerTask
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.models import hardware
    from ltv_vllm.serving.engine.layer_shift import LAYER_OP, patch_splitting_ops

    tmp = tmp_path
    good, _ = write_model_and_vectors(tmp, tokenizer)
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    ident = load_task_vector(good).model
    path = LayerTask((0,), torch.ones(1, ident.hidden_size), None, None, ident).save(
        tmp / "ctl.safetensors")
    base = ["serve", "--model", str(tmp / "m"), "--task-vector", f"ctl={path}", "--dry-run"]
    r = CliRunner().invoke(main, base)
    assert r.exit_code == 0 and "--enforce-eager" in r.output, r.output  # this CPU
    monkeypatch.setattr(hardware, "engine_device", lambda: "cuda")
    r = CliRunner().invoke(main, base)
    assert r.exit_code == 0, r.output
    assert "--enforce-eager" not in r.output, r.output
    assert """--compilation-config '{"cudagraph_mode": "PIECEWISE"}'""" in r.output, r.output
    r = CliRunner().invoke(main, [*base, "-O3"])  # the user's choice wins
    assert r.exit_code == 0 and "PIECEWISE" not in r.output, r.output
    from vllm.config.compilation import CompilationConfig, CompilationMode

    assert patch_splitting_ops() and patch_splitting_ops()  # idempotent
    assert CompilationConfig._attention_ops.count(LAYER_OP) == 1
    c = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    c.set_splitting_ops_for_v1("naive")
    assert LAYER_OP in c.splitting_ops and "vllm::unified_attention_with_output" in \
        c.splitting_ops


def test_a_store_that_holds_or_may_hold_layer_tasks_gets_their_hooks(tmp_path, tokenizer,
                                                                     monkeypatch):
    """`serve --task-store`: with a layer task among its entries, or `--layer-uploads`, the
    engine is told to hook its blocks (`store_layers`), the layer probes join the self-check
    and a GPU engine gets piecewise graphs — none of it for a store without (full graphs
    stay); `--layer-uploads` without a store or in LoRA mode, and a LoRA server on a store
    holding a layer task, are one line each before any engine."""
    import json
    import shlex

    from click.testing import CliRunner

    from conftest import write_model_and_vectors
    from ltv_vllm.cli import main
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.models import hardware
    from ltv_vllm.serving.contract.settings import ENV
    from ltv_vllm.serving.store.taskstore import TaskStore

    tmp = tmp_path
    good, _ = write_model_and_vectors(tmp, tokenizer)
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp / "cache"))
    monkeypatch.setattr(hardware, "engine_device", lambda: "cuda")
    ident = load_task_vector(good).model

    def dry(*flags):
        r = CliRunner().invoke(main, ["serve", "--model", str(tmp / "m"), "--dry-run",
                                      "--dtype", "float32", "--allow-unauthenticated",
                                      *flags])
        line = next((ln for ln in r.output.splitlines() if ENV + "=" in ln), "")
        env = next((w for w in shlex.split(line) if w.startswith(ENV + "=")), None)
        return r, json.loads(env.split("=", 1)[1]) if env else None

    store = TaskStore(tmp / "store")
    store.add("v", load_task_vector(good), tmp / "m")
    r, settings = dry("--task-store", str(store.root))
    assert r.exit_code == 0 and settings["store_layers"] is False, r.output
    assert "PIECEWISE" not in r.output and "LTV_VLLM_LAYER_TASKS" not in r.output
    r, settings = dry("--task-store", str(store.root), "--layer-uploads")
    assert r.exit_code == 0 and settings["store_layers"] is True, r.output
    assert "PIECEWISE" in r.output and "LTV_VLLM_LAYER_TASKS" in r.output  # layer probes
    store.add("ctl", LayerTask((0,), torch.ones(1, ident.hidden_size), None, None, ident),
              tmp / "m")
    r, settings = dry("--task-store", str(store.root))
    assert r.exit_code == 0 and settings["store_layers"] is True, r.output
    for flags, message in ((("--task-vector", good, "--layer-uploads"), "--layer-uploads"),
                           (("--task-store", str(store.root), "--multi-task", "lora"),
                            "no LoRA adapter carries"),
                           (("--task-store", str(tmp / "s2"), "--multi-task", "lora",
                             "--layer-uploads"), "--layer-uploads")):
        r, _ = dry(*flags)
        assert r.exit_code == 1 and message in r.output, (flags, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_a_server_reads_back_the_layer_probes_an_earlier_start_wrote(served, tmp_path,
                                                                      monkeypatch):
    """`served_probes` with layer probes: computed once from the LM head and written to the
    cache (their signatures in their files); a later start reads them back without a pass
    over the head, the same signatures; a file that does not read back is recomputed."""
    from ltv_vllm.serving.store import probes

    _, d, _, _, _ = served
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp_path / "cache"))
    first = probes.served_probes(d, "float32")
    first.write()
    assert sorted(first.layer) == sorted(probes.SERVED_PREFIX + n for n in probes.LAYER_PROBES)
    assert first.layer_tasks() == {probes.SERVED_PREFIX + n: (p, True)
                                   for n, p in probes.LAYER_PROBES.items()}
    real = probes.layer_probe_tasks

    def no_pass(*_a):
        raise AssertionError("computed again")

    monkeypatch.setattr(probes, "layer_probe_tasks", no_pass)
    assert probes.served_probes(d, "float32").layer == first.layer
    path = next(c["path"] for n, c in first.config.items() if n in first.layer)
    Path(path).write_bytes(b"not a task")
    monkeypatch.setattr(probes, "layer_probe_tasks", real)
    again = probes.served_probes(d, "float32")
    assert again.layer == first.layer and not Path(path).exists()  # rewritten by `write`
    again.write()
    assert Path(path).stat().st_size > 100
