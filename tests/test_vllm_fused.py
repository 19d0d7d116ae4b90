"""vLLM fused serving: the plugin's wrapper against the transformers reference path.

Each engine runs in a fresh process (vLLM keeps global state). Float32 throughout; every
returned logprob — sampled tokens at every step and prompt-logprob rows — must match
transformers + the reference hook within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import assert_told_apart, make_llama, plan, reference_logprobs, run_worker
from ltv_vllm.core.vector import TaskVector, VectorError, model_identity
from ltv_vllm.tasks.specs import BUILTIN_TASKS

pytestmark = pytest.mark.slow(seconds=110)  # see conftest's ordering

WORKERS = Path(__file__).parent / "vllm_workers"
PROMPTS = ["Review: the plot is dull\nSentiment:", "News: the team wins the final game\nType:"]


def run_batch(jobs: list[dict], tmp: Path, tp: int = 1) -> dict:
    """Every job (`vllm_workers/batch.py`: generate or classify) in one process of its own,
    one engine after another: {key: result}. tp > 1: every job at that tensor-parallel size."""
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc sends a function
    if tp > 1:
        # the CPU backend wants one NUMA node per rank; on one node, bind a core per rank
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    out = run_worker("batch", [{**j, **({"tp": tp} if j["kind"] == "generate" else {})}
                               for j in jobs], tmp, env)
    assert sorted(out) == sorted(j["key"] for j in jobs)  # every engine answered
    return out


def generate_job(key: str, model_dir: Path, vector: str, max_tokens: int,
                 check: str = "") -> dict:
    return {"key": key, "kind": "generate", "model_dir": str(model_dir), "vector": vector,
            "prompts": PROMPTS, "max_tokens": max_tokens, "check": check}


def classify_job(key: str, model_dir: Path, vector: Path, texts: list[str],
                 dtype: str = "float32") -> dict:
    return {"key": key, "kind": "classify", "model_dir": str(model_dir), "vector": str(vector),
            "texts": texts, "dtype": dtype}


FUSED_KINDS = ("fused", "fold", "logit", "kernel")


def fused_jobs(served, served_tied, logit_vector, kernel_vector) -> list[dict]:
    d, _model, _tv, path = served
    arg = {"fused": str(path), "logit": str(logit_vector[1]), "kernel": str(kernel_vector[1]),
           "fold": f"fold:{served_tied[3]}"}
    check = {"logit": "local", "fold": "fold"}
    jobs = [generate_job(k, served_tied[0] if k == "fold" else d, arg[k], 5, check.get(k, ""))
            for k in FUSED_KINDS]
    # the fused engine also answers every step policy, in a batch of its own (`steps_out`)
    jobs[0]["more"] = [{"max_tokens": 4, "steps": STEP_POLICIES}]
    return jobs


@pytest.fixture(scope="module")
def engines(served, served_tied, logit_vector, kernel_vector, served_qwen2, soft,
            tmp_path_factory):
    """Every single-process engine this module checks, run in one worker process: the fused
    kinds, the Qwen2 wrapper, offline classification, and the bf16 maps."""
    d, _model, _tv, path = served
    jobs = [*fused_jobs(served, served_tied, logit_vector, kernel_vector),
            generate_job("qwen2", served_qwen2[0], str(served_qwen2[3]), 4),
            classify_job("classify", soft[0], soft[3]["linear"][1], SOFT_TEXTS),
            *(classify_job(f"bf16-{k}", soft[0], p, SOFT_TEXTS, "bfloat16")
              for k, (_tv, p) in soft[3].items()),
            {"key": "pp-fold", "kind": "pp_fold", "vector": str(path)},
            {**generate_job("steps-default", d, str(path), 4), "steps": [None, "all", 0],
             "shift_steps": "first"},
            tasks_job(served, logit_vector, kernel_vector, tmp_path_factory)]
    return run_batch(jobs, tmp_path_factory.mktemp("jobs"))


# One batch mixing tasks, policies and the bare model on one multi-task engine: each request's
# `vllm_xargs` (None: the bare model). "lin-first" is the linear vector recording
# meta.shift_steps "first", so a request naming no policy gets that default.
TASK_XARGS = [None, {"ltv_task": "lin"}, {"ltv_task": "logit", "ltv_steps": "first"},
              {"ltv_task": "rbf", "ltv_steps": 2}, {"ltv_task": "lin-first"},
              {"ltv_task": "lin", "ltv_steps": 0}, {"ltv_task": "logit"}]
# and each its own `max_tokens`: rows finish at different steps, and the rows after them move
TASK_LENGTHS = [4, 6, 3, 5, 2, 4, 6]


def tasks_job(served, logit_vector, kernel_vector, tmp_path_factory) -> dict:
    _d, _model, tv, path = served
    first = TaskVector(tv.kind, tv.U, tv.V, tv.bias, tv.model, tv.label_token_ids,
                       {**tv.meta, "shift_steps": "first"})
    first_path = first.save(tmp_path_factory.mktemp("first") / "first.safetensors")
    vectors = {"lin": str(path), "logit": str(logit_vector[1]), "rbf": str(kernel_vector[1]),
               "lin-first": str(first_path)}
    # and a batch naming no task: the bare model with its prompt logprobs (the "plain" kind)
    return {**generate_job("tasks", served[0], "", 4), "vector": vectors, "xargs": TASK_XARGS,
            "lengths": TASK_LENGTHS, "more": [{"max_tokens": 5}]}


def kind_result(engines: dict, kind: str) -> dict:
    """A fused kind's engine result; "plain" (no vector) is the multi-task engine's batch
    that names no task."""
    if kind == "plain":
        return {**engines["tasks"], "outputs": engines["tasks"]["more"][0]}
    return engines[kind]


def steps_out(engines: dict) -> list[dict]:
    """The fused engine's batch of STEP_POLICIES."""
    return engines["fused"]["more"][0]


def task_expectations(served, logit_vector, kernel_vector) -> list[tuple]:
    """(vector or None, steps shifted or None for all) of each TASK_XARGS request."""
    from ltv_vllm.serving.contract.wire import parse_steps

    tv = served[2]
    vecs = {"lin": tv, "logit": logit_vector[0], "rbf": kernel_vector[0], "lin-first": tv}
    default = {"lin": "all", "logit": "all", "rbf": "all", "lin-first": "first"}
    out = []
    for x in TASK_XARGS:
        if x is None:
            out.append((None, 0))
        else:
            out.append((vecs[x["ltv_task"]],
                        parse_steps(x.get("ltv_steps", default[x["ltv_task"]]))))
    return out


@pytest.fixture(scope="module")
def engines_tp2(served, served_tied, logit_vector, kernel_vector, tmp_path_factory):
    """The fused kinds at tensor_parallel_size=2, in one worker process: the ones whose TP path
    differs (the linear shift of the replicated h, the folded head's shards, the logit shift's
    vocab-sharded rows). The kernel map and the bare model are left at TP=1: the kernel's
    shift is computed from the same replicated h as the linear one, by the same wrapper
    code, and every TP=2 kind already runs the bare model under its shift."""
    # (the fused engine's step-policy batch: each rank's processor tracks the same requests
    # and masks the same rows)
    jobs = [j for j in fused_jobs(served, served_tied, logit_vector, kernel_vector)
            if j["key"] != "kernel"]
    jobs.append(tasks_job(served, logit_vector, kernel_vector, tmp_path_factory))
    return run_batch(jobs, tmp_path_factory.mktemp("jobs-tp2"), tp=2)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """Untied: this tiny model's greedy answers then differ between tasks, policies and the
    bare model (tied, its ×20 head copies the last token whatever the shift, and token
    equality tells nothing)."""
    return tiny_served(tmp_path_factory, tokenizer, tie=False)


@pytest.fixture(scope="module")
def served_tied(tmp_path_factory, tokenizer):
    """Tied embeddings, like SmolLM2: folding must untie rather than change the embeddings."""
    return tiny_served(tmp_path_factory, tokenizer, tie=True)


def tiny_served(tmp_path_factory, tokenizer, tie: bool):
    d = tmp_path_factory.mktemp("tiny-vllm")
    # head_dim 64: a size every vLLM attention backend supports
    model = make_llama(len(tokenizer), hidden=128, layers=2, seed=21, tie=tie)
    model.config.num_attention_heads, model.config.num_key_value_heads = 2, 1
    model = make_llama_from(model.config)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    g = torch.Generator().manual_seed(5)
    tv = TaskVector("hidden", 0.5 * torch.randn(128, 8, generator=g),
                    torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None,
                    model_identity(model, "tiny"), (1, 2),
                    {"task": BUILTIN_TASKS["sst2"].to_dict()})
    path = tv.save(tmp_path_factory.mktemp("vectors") / "tv.safetensors")
    return d, model, tv, path


@pytest.fixture(scope="module")
def logit_vector(served, tmp_path_factory):
    """A logit-space vector for the same model: U is vocab-sized, added to the logits."""
    _d, model, tv, _path = served
    g = torch.Generator().manual_seed(7)
    vocab = model.lm_head.weight.shape[0]
    ltv = TaskVector("logit", 2.0 * torch.randn(vocab, 8, generator=g),
                     torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None,
                     model_identity(model, "tiny"), tv.label_token_ids, tv.meta)
    return ltv, ltv.save(tmp_path_factory.mktemp("logit-vectors") / "ltv.safetensors")


@pytest.fixture(scope="module")
def kernel_vector(served, tmp_path_factory):
    """A kernel (RBF) vector for the same model: 6 support states, γ about 1/‖h − s‖²."""
    _d, model, tv, _path = served
    g = torch.Generator().manual_seed(9)
    kv = TaskVector("hidden", 2.0 * torch.randn(128, 6, generator=g),
                    torch.randn(128, 6, generator=g), None, model_identity(model, "tiny"),
                    tv.label_token_ids, tv.meta, map="rbf", gamma=1 / 256)
    return kv, kv.save(tmp_path_factory.mktemp("kernel-vectors") / "kv.safetensors")


def make_llama_from(config, head_scale: float = 20.0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(21)
    m = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(head_scale)
    return m


def assert_decode_matches(out: list[dict], model, tokenizer, tv) -> None:
    """Every decode step: greedy token = reference argmax, every logprob within 1e-4."""
    assert len(out) == len(PROMPTS)
    for prompt, res in zip(PROMPTS, out, strict=True):
        n_prompt = len(tokenizer(prompt)["input_ids"])
        ref = reference_logprobs(model, tokenizer, prompt, res["token_ids"], tv)
        for step, lp in enumerate(res["logprobs"]):
            row = ref[n_prompt - 1 + step]
            assert int(row.argmax()) == res["token_ids"][step]
            for tok, v in lp.items():
                assert abs(v - float(row[int(tok)])) < 1e-4, (step, tok, v, float(row[int(tok)]))


@pytest.mark.parametrize(
    "mode", ["fused", "fold", "plain", "logit", "kernel", "fused-tp2", "fold-tp2", "logit-tp2"])
def test_vllm_fused_matches_transformers(served, logit_vector, kernel_vector, tokenizer, mode,
                                         request):
    """tp2: tensor_parallel_size=2 on the CPU backend (lm_head sharded by vocabulary).
    logit: a logit-space vector (U vocab-sized, added to the LM head's output).
    kernel: an RBF kernel map (at TP=1 only; see `engines_tp2`)."""
    d, model, tv, path = request.getfixturevalue("served_tied") if "fold" in mode else served
    kind, _, tp = mode.partition("-tp")
    if kind == "logit":
        tv, path = logit_vector
    if kind == "kernel":
        tv, path = kernel_vector
    # (the vocab-local entry points are checked where they can differ: a logit vector, where
    # each rank must add only its own rows of U; `fused_jobs`)
    res = kind_result(request.getfixturevalue("engines_tp2" if tp else "engines"), kind)
    out = res["outputs"]
    assert len(out) == len(PROMPTS)
    fused = kind != "plain"
    ref_tv = tv if fused else None
    assert_decode_matches(out, model, tokenizer, ref_tv)
    for prompt, r in zip(PROMPTS, out, strict=True):
        # prompt-logprob rows go through compute_logits too
        ref = reference_logprobs(model, tokenizer, prompt, r["token_ids"], ref_tv)
        for i, lp in enumerate(r["prompt_logprobs"][1:], start=1):
            for tok, v in lp.items():
                assert abs(v - float(ref[i - 1, int(tok)])) < 1e-4
    if fused:  # and the shift really changed something
        plain = reference_logprobs(model, tokenizer, PROMPTS[0], out[0]["token_ids"], None)
        shifted = reference_logprobs(model, tokenizer, PROMPTS[0], out[0]["token_ids"], tv)
        assert (plain - shifted).abs().max() > 1e-2
    if kind == "fold":  # folded for real: no per-token shift left, the head is W (I + UVᵀ)
        assert len(res["fold"]) == int(tp or 1)
        for r in res["fold"]:
            assert not r["shift_left"] and r["untied"] and r["moved"] > 1e-2, r
            assert r["max_err"] < 1e-4, r
    if res["local"] is not None:
        ranks = res["local"]
        assert len(ranks) == int(tp or 1)
        # the shards tile the vocabulary; the last one carries vLLM's padding columns
        assert [r["start"] for r in ranks] == [sum(x["n"] for x in ranks[:i])
                                               for i in range(len(ranks))]
        assert sum(r["n"] for r in ranks) == model.lm_head.weight.shape[0]
        assert (ranks[-1]["pad"] > 0
                and ranks[-1]["local_width"] == ranks[-1]["n"] + ranks[-1]["pad"])
        for r in ranks:
            assert r["max_err"] < 1e-4 and r["top_ok"], r


STEP_POLICIES = [None, "all", "first", 2, 0]  # None: the request sets no policy


def test_step_policy_per_request_shifts_exactly_its_steps(served, tokenizer, engines):
    """One batch: each prompt under every policy (`ltv_steps` in `extra_args`). Each request's
    greedy tokens and logprobs are a greedy loop's that shifts exactly the policy's steps: the
    vector's distribution at a shifted step, the bare model's at the others (the shift touches
    the LM head's input only, so earlier steps never change a later step's states)."""
    _d, model, tv, _path = served
    check_step_policies(steps_out(engines), STEP_POLICIES, "all", model, tokenizer, tv)


def test_step_policy_at_tp2_equals_tp1(served, tokenizer, engines, engines_tp2):
    """Tensor parallelism 2: the same policies, the same tokens as TP 1, each step checked
    against the greedy loop as at TP 1."""
    _d, model, tv, _path = served
    out = steps_out(engines_tp2)
    check_step_policies(out, STEP_POLICIES, "all", model, tokenizer, tv)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in steps_out(engines)]


def test_per_request_tasks_in_one_batch(served, logit_vector, kernel_vector, tokenizer,
                                        engines):
    """One multi-task engine (`serve.task_engine`: linear, logit-space and kernel vectors),
    one batch mixing tasks, step policies and the bare model: each request equals the greedy
    loop that shifts exactly its policy's steps with its own task's vector; a request naming
    no policy gets its task's default (the vector's meta.shift_steps)."""
    model = served[1]
    expected = task_expectations(served, logit_vector, kernel_vector)
    out = engines["tasks"]["outputs"]
    check_requests(out, expected, model, tokenizer, TASK_LENGTHS)
    # the tasks' answers differ in tokens too: the bare model, lin, logit and rbf at every
    # step (requests 0, 1, 6 and 3's first two steps) give four different answers per prompt
    for p in range(len(PROMPTS)):
        rows = out[p * len(TASK_XARGS):(p + 1) * len(TASK_XARGS)]
        heads = {tuple(rows[i]["token_ids"][:2]) for i in (0, 1, 3, 6)}
        assert len(heads) == 4, (p, heads)


def test_per_request_tasks_at_tp2_equal_tp1(served, logit_vector, kernel_vector, tokenizer,
                                            engines, engines_tp2):
    model = served[1]
    out = engines_tp2["tasks"]["outputs"]
    check_requests(out, task_expectations(served, logit_vector, kernel_vector), model,
                   tokenizer, TASK_LENGTHS)
    assert [r["token_ids"] for r in out] == [r["token_ids"]
                                             for r in engines["tasks"]["outputs"]]


def test_server_default_step_policy_applies_where_a_request_names_none(served, tokenizer,
                                                                       engines):
    """An engine started with `shift_steps="first"` (`serve --shift-steps first`): a request
    without `ltv_steps` is shifted at its first token only; one that names a policy gets its
    own."""
    _d, model, tv, _path = served
    check_step_policies(engines["steps-default"]["outputs"], [None, "all", 0], "first", model,
                        tokenizer, tv)


def check_step_policies(out, policies, default, model, tokenizer, tv) -> None:
    """The batch holds each prompt under each of `policies` (None: the request names none,
    so `default` applies); each request is checked against the greedy loop that shifts
    exactly its steps."""
    from ltv_vllm.serving.contract.wire import parse_steps

    check_requests(out, [(tv, parse_steps(default if p is None else p)) for p in policies],
                   model, tokenizer)


def check_requests(out, expected, model, tokenizer, lengths: list[int] | None = None) -> None:
    """The batch holds each prompt under each entry of `expected`, (vector or None, n: the
    leading steps it shifts, None: all), `lengths` tokens each (default 4); each request's
    greedy tokens are the greedy loop's that shifts exactly those steps with that vector, and
    its logprobs are that loop's within 1e-4 and ≥ 10× that from every other entry's loop
    (`assert_told_apart`: a row given another's task or policy cannot pass)."""
    assert len(out) == len(PROMPTS) * len(expected)
    for i, res in enumerate(out):
        prompt, (tv, n) = PROMPTS[i // len(expected)], expected[i % len(expected)]
        steps = (lengths or [4] * len(expected))[i % len(expected)]
        n_prompt = len(tokenizer(prompt)["input_ids"])
        assert len(res["logprobs"]) == steps == len(res["token_ids"])
        mine = plan(tv, n, steps)
        for step in range(steps):
            row = reference_logprobs(model, tokenizer, prompt, res["token_ids"], mine[step])
            assert int(row[n_prompt - 1 + step].argmax()) == res["token_ids"][step], (i, step)
        plans = {j: plan(v, m, steps) for j, (v, m) in enumerate(expected)}
        assert_told_apart([{int(t): v for t, v in lp.items()} for lp in res["logprobs"]],
                          plans, i % len(expected), model, tokenizer, prompt,
                          res["token_ids"], 1e-4, i)


def test_fold_leaves_a_pipeline_stage_without_the_head_alone(engines):
    """--fold under pipeline parallelism: a stage before the last holds vLLM's PPMissingLayer
    in place of the LM head; the fold skips it (the last stage folds, as the fold tests
    show) instead of reading `lm_head.weight` there."""
    r = engines["pp-fold"]
    assert r["error"] is None, r["error"]
    assert r["head_is_missing_layer"] and not r["shift_left"]


def test_pipeline_parallel_is_refused_on_the_cpu_backend():
    from ltv_vllm.errors import ArgumentError
    from ltv_vllm.serving.launcher.recipe import check_pipeline_parallel
    from ltv_vllm.serving.launcher.serve import ServeOptions

    with pytest.raises(ArgumentError, match="does not run on vLLM's CPU backend"):
        ServeOptions(None, ("v.pt",), vllm_args=("--pipeline-parallel-size", "2"))
    with pytest.raises(ArgumentError, match="does not run on vLLM's CPU backend"):
        ServeOptions(None, ("v.pt",), vllm_args=("-pp=2",))
    ServeOptions(None, ("v.pt",), vllm_args=("-pp", "1"))
    check_pipeline_parallel(4, cuda=True)  # on GPUs it is vLLM's to run


def test_vector_for_another_model_refused_before_engine(served, logit_vector, tokenizer,
                                                        tmp_path):
    from ltv_vllm.serving.launcher.recipe import engine_kwargs

    d, _model, tv, _path = served
    with pytest.raises(VectorError, match="only a hidden-space vector"):
        engine_kwargs(d, logit_vector[1], fold=True)
    assert engine_kwargs(d, logit_vector[1])["hf_overrides"]["ltv_task_vector"]
    other = make_llama(len(tokenizer), hidden=128, seed=99)
    bad = TaskVector("hidden", tv.U, tv.V, None, model_identity(other, "other"),
                     tv.label_token_ids, tv.meta)
    with pytest.raises(VectorError, match="was extracted from other"):
        engine_kwargs(d, bad.save(tmp_path / "bad.pt"))
    inside = tv.save(d / "tv-inside.safetensors")
    try:
        with pytest.raises(VectorError, match="weight shard"):
            engine_kwargs(d, inside)
    finally:
        inside.unlink()
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(VectorError, match="junk.pt"):
        engine_kwargs(d, tmp_path / "junk.pt")


def test_offline_classify_matches_restricted_softmax(soft, tokenizer, engines):
    """`make_llm` + `classify_offline` (float32) on the unsaturated model: every label
    probability is the restricted softmax of the shifted state within 1e-4, and the bare
    model's is ≥ 10× that away for every text (so an unshifted engine cannot pass)."""
    from conftest import MARGIN
    from ltv_vllm.tasks.specs import label_token_ids

    _d, model, h, vectors = soft
    tv = vectors["linear"][0]
    task = BUILTIN_TASKS["sst2"]
    ids = label_token_ids(task, tokenizer)
    ref, bare = restricted(model, h, tv, ids), restricted(model, h, None, ids)
    got = engines["classify"]
    assert len(got) == len(SOFT_TEXTS)
    for i, r in enumerate(got):
        probs = torch.tensor([r["probs"][lab] for lab in task.labels], dtype=torch.float64)
        assert float((probs - ref[i]).abs().max()) < 1e-4, i
        assert float((probs - bare[i]).abs().max()) >= MARGIN * 1e-4, i
        assert r["label"] == task.labels[int(ref[i].argmax())]


@pytest.fixture(scope="module")
def served_qwen2(tmp_path_factory, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("tiny-qwen2")
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(41)
    model = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    g = torch.Generator().manual_seed(6)
    tv = TaskVector("hidden", 0.5 * torch.randn(128, 8, generator=g),
                    torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None,
                    model_identity(model, "tiny-qwen2"), (1, 2),
                    {"task": BUILTIN_TASKS["sst2"].to_dict()})
    return d, model, tv, tv.save(tmp_path_factory.mktemp("qvec") / "tv.pt")


def test_vllm_qwen2_wrapper_matches_transformers(served_qwen2, tokenizer, engines):
    d, model, tv, path = served_qwen2
    out = engines["qwen2"]["outputs"]
    assert_decode_matches(out, model, tokenizer, tv)


# -- bf16 serving against the float32 reference ---------------------------------------------
SOFT_TEXTS = ["the plot is dull", "a gorgeous witty movie", "the team wins", "boring and slow",
              "great acting", "i loved it", "a waste of time", "fresh and bright",
              "flat and tired", "so good", "so bad", "the cast shines", "the script fails",
              "truly moving", "painfully dull", "a warm and funny film"]
BF16_TOL = 0.02  # label probability; the bare model alone moves 0.0012 in bf16 here


@pytest.fixture(scope="module")
def soft(tmp_path_factory, tokenizer):
    """A tiny model whose label distribution is not saturated (LM head x2, not x20), its
    float32 states for SOFT_TEXTS, and one vector per served map whose shift moves it."""
    from ltv_vllm.extraction.capture import Capturer

    d = tmp_path_factory.mktemp("tiny-soft")
    cfg = make_llama(len(tokenizer), hidden=128, layers=2, seed=21, tie=True).config
    cfg.num_attention_heads, cfg.num_key_value_heads = 2, 1
    model = make_llama_from(cfg, head_scale=2.0)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    task = BUILTIN_TASKS["sst2"]
    h = Capturer(model, tokenizer, progress=False).hidden([task.query(t) for t in SOFT_TEXTS])
    ident = model_identity(model, "tiny-soft")
    g = torch.Generator().manual_seed(4)
    # kernel: support states next to half the queries' own states, as a fit on real states
    # is (LM states sit in a tight cluster); γ from the nearest-support distances
    S = h[::2] + 0.05 * torch.randn(8, 128, generator=g)
    gamma = 1.0 / float(torch.cdist(h, S).pow(2).min(dim=1).values.median())
    vectors = {
        "kernel": TaskVector("hidden", 5.0 * torch.randn(128, 8, generator=g),
                             S.T.contiguous(), None, ident, (1, 2), {}, map="rbf",
                             gamma=gamma),
        "linear": TaskVector("hidden", 0.5 * torch.randn(128, 8, generator=g),
                             torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None, ident,
                             (1, 2), {}),
        "logit": TaskVector("logit", 2.0 * torch.randn(len(tokenizer), 8, generator=g),
                            torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None, ident,
                            (1, 2), {}),
    }
    vd = tmp_path_factory.mktemp("soft-vectors")
    return d, model, h, {k: (tv, tv.save(vd / f"{k}.safetensors")) for k, tv in vectors.items()}


def restricted(model, h: torch.Tensor, tv: TaskVector | None, ids: list[int]) -> torch.Tensor:
    """float32 reference: transformers' LM head on h (+ the shift), softmax over `ids`."""
    with torch.no_grad():
        if tv is not None and tv.kind == "hidden":
            h = tv.shift_hidden(h)
        logits = model.lm_head(h)
        if tv is not None and tv.kind == "logit":
            logits = logits + tv.delta(h)
    return torch.softmax(logits[:, ids].double(), -1)


@pytest.mark.parametrize("kind", ["kernel", "linear", "logit"])
def test_bf16_serving_holds_to_float32(soft, tokenizer, kind, engines):
    """Served in bf16 (the engine's dtype with `--dtype auto` on a CPU with native bf16, and
    on every GPU), every map's label distribution stays within BF16_TOL of the float32
    reference: the shift is computed in float32. (Computed in bf16, the kernel map's
    distances cancelled and its shift was lost: 0.32 off here, more than the shift itself;
    on SmolLM2 the served kernel fell from 35 % to below zero-shot.)"""
    from ltv_vllm.tasks.specs import label_token_ids

    d, model, h, vectors = soft
    tv, path = vectors[kind]
    ids = label_token_ids(BUILTIN_TASKS["sst2"], tokenizer)
    ref, bare = restricted(model, h, tv, ids), restricted(model, h, None, ids)
    assert float((ref - bare).abs().max()) > 0.1  # the shift matters at this tolerance
    got = engines[f"bf16-{kind}"]
    assert len(got) == len(SOFT_TEXTS)
    labels = BUILTIN_TASKS["sst2"].labels
    err = max(abs(r["probs"][lab] - float(ref[i, j]))
              for i, r in enumerate(got) for j, lab in enumerate(labels))
    assert err < BF16_TOL, err
