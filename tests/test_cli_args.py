"""Every CLI command refuses a bad argument with one line, exit 1, before any model is
loaded or fetched (loading is made to fail loudly here, and the hub is off)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from conftest import write_model_and_vectors, write_toy_task
from ltv_vllm.cli import main
from ltv_vllm.core.vector import TaskVector, load_task_vector


@pytest.fixture()
def env(tmp_path, tokenizer, monkeypatch):
    """A tiny model directory, a vector for it, one for another model, and a trap on loading."""
    good, _ = write_model_and_vectors(tmp_path, tokenizer)
    tv = load_task_vector(good)  # the same vector with a constant bias: not a LoRA
    TaskVector(tv.kind, tv.U, tv.V, torch.ones(64), tv.model, tv.label_token_ids,
               tv.provenance).save(tmp_path / "biased.pt")
    (tmp_path / "a_file").write_text("x")
    write_toy_task(tmp_path, ["good", "bad", "film"])
    (tmp_path / "collide.json").write_text(json.dumps({
        "name": "collide", "in_prefix": "Review", "label_prefix": "Sentiment",
        "labels": ["positive", "positive!"], "data": "packaged:sst2"}))

    def trap(*_a, **_k):
        raise AssertionError("a model was loaded before the arguments were checked")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", trap)
    monkeypatch.setenv("LTV_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a regression must not reach for the registry
    monkeypatch.chdir(tmp_path)
    return tmp_path


M = ["--model", "m"]

CASES = [
    # extract: numbers, k against the task's classes, N against its data, outputs, task specs
    (["extract", *M, "--task", "trec", "--demo-sets", "0"], "--demo-sets must be at least 1"),
    (["extract", *M, "--task", "linear", "--demo-sets", "2"], "--demo-sets draws its sets"),
    (["extract", *M, "--task", "trec", "--lam", "-1"], "--lam must be a positive number"),
    (["extract", *M, "--task", "trec", "--lam", "0"], "--lam must be a positive number"),
    (["extract", *M, "--task", "trec", "--lam", "nan"], "--lam must be a positive number"),
    (["extract", *M, "--task", "trec", "--lam", "big"], "'big' is neither a number nor 'auto'"),
    (["evaluate", *M, "--tasks", "trec", "--lam", "-2"], "--lam must be a positive number"),
    (["extract", *M, "--task", "trec", "--k", "0"], "--k must be at least 1"),
    (["extract", *M, "--task", "toy.json", "--k", "1"], "smaller than the number of classes (2)"),
    (["extract", *M, "--task", "trec", "--n", "0"], "--n must be at least 1"),
    (["extract", *M, "--task", "toy.json", "--n", "100000"], "100000 queries requested"),
    (["extract", *M, "--task", "trec", "--n-test", "0"], "--n-test must be at least 1"),
    (["extract", *M, "--task", "trec", "--rank", "0"], "--rank must be at least 1"),
    (["extract", *M, "--task", "trec", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["extract", *M, "--task", "trec", "-o", "v.txt"], "must end in .pt or .safetensors"),
    (["extract", *M, "--task", "trec", "-o", "a_file/v.pt"], "is not a directory"),
    (["extract", *M, "--task", "nope"], "unknown task 'nope'"),
    (["extract", *M, "--task", "missing.json"], "cannot read task spec"),
    (["extract", *M, "--task", "collide.json"], "share their first token"),
    (["extract", *M, "--task", "trec", "--source-model", "m", "--chunk-size", "0"],
     "--chunk-size must be at least 1"),
    (["extract", "--model", "./no/such/dir", "--task", "trec"], "no such directory"),
    # evaluate
    (["evaluate", *M, "--tasks", "trec", "--runs", "0"], "--runs must be at least 1"),
    (["evaluate", *M, "--tasks", "trec", "--demo-sets", "0"], "--demo-sets must be at least 1"),
    (["evaluate", *M, "--tasks", "trec", "--methods", "ltv-multi"], "need --demo-sets 2 or more"),
    (["evaluate", *M, "--tasks", "linear", "--demo-sets", "2"], "--demo-sets draws its sets"),
    (["evaluate", *M, "--tasks", "trec", "--demo-sets", "2", "--source-model", "m"],
     "a transfer evaluation fits one ICL prompt"),
    (["evaluate", *M, "--tasks", "trec", "--methods", "icl,magic"], "unknown magic"),
    (["evaluate", *M, "--tasks", "trec", "--methods", "ltv-transfer"], "needs --source-model"),
    (["evaluate", *M, "--tasks", "trec,nope"], "unknown task 'nope'"),
    (["evaluate", *M, "--tasks", "trec,trec"], "given twice"),
    (["evaluate", *M, "--tasks", "trec", "--out", "a_file"], "'a_file' is a file"),
    (["evaluate", *M, "--tasks", "toy.json", "--k", "1"], "smaller than the number of classes"),
    # serving: vector against model, modes of use
    (["serve", *M, "--task-vector", "other.pt", "--dry-run"], "was extracted from other"),
    (["serve", *M, "--task-vector", "a=good.pt", "--task-vector", "b=good.pt", "--lora-rank",
      "0", "--dry-run"], "--lora-rank must be at least 1"),
    (["serve", *M, "--task-vector", "good.pt", "--port", "0", "--dry-run"], "--port must be"),
    (["serve", *M, "--task-vector", "a=good.pt", "--task-vector", "b=good.pt", "--fold",
      "--dry-run"], "--fold applies to one fused vector"),
    (["serve", *M, "--task-vector", "a=biased.pt", "--task-vector", "b=good.pt",
      "--multi-task", "lora", "--dry-run"], "has a constant bias"),
    (["export-lora", "biased.pt", "-o", "lora", "--model", "m"], "has a constant bias"),
    (["export-lora", "good.pt", "-o", "lora", "--model", "m", "--rank", "0"],
     "--rank must be at least 1"),
    (["export-lora", "other.pt", "-o", "lora", "--model", "m"], "was extracted from other"),
    (["export-lora", "good.pt", "-o", "a_file", "--model", "m"], "is a file"),
    (["inspect", "nothing.pt"], "task-vector file not found"),
    # models: a packaged base would be fetched and converted by resolving it; refused first
    (["models", "derive", "smollm2-135m", "--keep-layers", "0"], "keep_layers must be at least 1"),
    (["data", "show", "trec", "--k", "3"], "smaller than the number of classes (6)"),
    (["data", "episode", "linear", "-o", "ep"], "'linear' is a regression task"),
    (["data", "episode", "sst2", "--n-test", "-1", "-o", "ep"], "--n-test must be at least 0"),
    # benchmarks
    (["bench", "serving", *M, "--modes", "zero-shot,warp"], "unknown mode(s) warp"),
    (["bench", "serving", *M, "--concurrency", "0"], "--concurrency must be at least 1"),
    (["bench", "serving", *M, "--tasks", "nope"], "unknown task 'nope'"),
    (["bench", "serving", *M, "--out", "a_file"], "is a file"),
    # writable by its permission bits (root), yet no file can be made there
    (["bench", "serving", *M, "--out", "/proc/ltv-out"], "/proc is not writable"),
    (["bench", "icl-cost", *M, "--out", "/proc/ltv-out"], "/proc is not writable"),
    (["bench", "icl-cost", *M, "--ks", "0,-1"], "--ks must be at least 0"),
    (["bench", "rank", *M, "--ranks", "0,4"], "--rank must be at least 1"),
    (["bench", "rank", *M, "--lam", "-2"], "--lam must be a positive number"),
    (["bench", "scaling", *M, "--demo-sets", "0"], "--demo-sets must be at least 1"),
    (["bench", "scaling", *M, "--ns", "0,64"], "--n must be at least 1"),
    (["bench", "scaling", *M, "--lam", "-2"], "--lam must be a positive number"),
    (["bench", "scaling", *M, "--lam", "often"], "'often' is neither a number nor 'auto'"),
    (["bench", "extraction", *M, "--ks", "0"], "--k must be at least 1"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(c[0][:2] + c[0][-2:]) for c in CASES])
def test_bad_argument_refused_before_work(env, args, message):
    r = CliRunner().invoke(main, args)
    assert message in r.output, r.output
    assert "Traceback" not in r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and message in errors[0], r.output
    if r.exit_code == 2:  # click's own usage error (a path type): its usage lines, then ours
        assert r.output.startswith("Usage: "), r.output
    else:
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert not (env / "cache" / "models").exists()  # nothing fetched or converted either


def test_every_help_is_unchanged():
    """Every command's `--help` (at a width of 100) as recorded in tests/fixtures/cli_help.json
    when `ltv_vllm/cli.py` became a package: moving code between modules changes none of it.
    (A deliberate change to a help text updates the fixture with it.)"""
    import json
    from pathlib import Path

    import click
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    want = json.loads((Path(__file__).parent / "fixtures" / "cli_help.json").read_text())
    got = {}

    def walk(cmd, path):
        r = CliRunner().invoke(main, [*path, "--help"], prog_name="ltv-vllm",
                               terminal_width=100)
        got[" ".join(path)] = r.output
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(None):
                walk(cmd.get_command(None, name), [*path, name])

    walk(main, [])
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []


def test_a_vector_below_zero_shot_is_warned_where_it_is_read(env):
    """A vector whose extraction scored it below zero-shot (beyond 1/√n_test): `inspect` and
    `serve --dry-run` say so in one line each, and serve still plans (a warning, not a refusal);
    a vector above zero-shot gets no line."""
    tv = load_task_vector(env / "good.pt")
    for name, ltv, warned in (("low", 0.30, True), ("fine", 0.55, False)):
        meta = {"method": "ltv", "n_test": 100, "task": {"name": name},
                "metrics": {"zero-shot": {"accuracy": 0.57, "d_ntp": 0.4},
                            "icl": {"accuracy": 0.28, "d_ntp": 0.0},
                            "ltv": {"accuracy": ltv, "d_ntp": 0.04}}}
        TaskVector(tv.kind, tv.U, tv.V, None, tv.model, tv.label_token_ids,
                   meta).save(env / f"{name}.pt")
        r = CliRunner().invoke(main, ["inspect", f"{name}.pt"])
        assert r.exit_code == 0, r.output
        lines = [x for x in r.output.splitlines() if x.startswith("warning: ")]
        assert lines == (["warning: ltv scored 30.0 % on 100 held-out queries, below "
                          "zero-shot's 57.0 %: serving it lowers accuracy on prompts like "
                          "these; ICL is below zero-shot too (28.0 %) and the vector imitates "
                          "ICL, so this model gains nothing from it on this prompt format"]
                         if warned else []), r.output
        r = CliRunner().invoke(main, ["serve", *M, "--task-vector", f"{name}=good.pt",
                                      "--task-vector", f"x={name}.pt", "--dry-run"])
        assert r.exit_code == 0, r.output
        # one line, for x only (good.pt, served as the other task, records no metrics)
        assert [x for x in r.output.splitlines() if "held-out" in x] == (
            [f"warning: x: {lines[0].removeprefix('warning: ')}"] if warned else []), r.output
