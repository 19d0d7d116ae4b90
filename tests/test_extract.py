"""extract/evaluate/CLI end to end on a tiny random model, checked against an independent path.

The independent path: ICL states from naive full-prompt forwards (no shared cache), LTV
logits from transformers' own forward with the reference hook, d_NTP from a hand-written KL.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from conftest import make_llama, write_toy_task
from ltv_vllm.cli import main
from ltv_vllm.core.vector import load_task_vector
from ltv_vllm.models.loading import load_model
from ltv_vllm.pipeline.extract import ExtractOptions, extract
from ltv_vllm.tasks.data import load_dataset, sample_episode
from ltv_vllm.tasks.specs import get_task, label_token_ids

WORDS = ["the", "plot", "is", "dull", "and", "acting", "worse", "a", "gorgeous", "witty",
         "seductive", "movie", "team", "wins", "final"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("tiny-llama")
    make_llama(len(tokenizer), seed=5).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    return write_toy_task(tmp_path_factory.mktemp("task"), WORDS)


def hand_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    total = 0.0
    for a, b in zip(p_logits.tolist(), q_logits.tolist(), strict=True):
        za, zb = sum(math.exp(x) for x in a), sum(math.exp(x) for x in b)
        total += sum(math.exp(x) / za * (x - math.log(za) - (y - math.log(zb)))
                     for x, y in zip(a, b, strict=True))
    return total / len(p_logits)


@pytest.mark.parametrize("rank", [None, 3])
def test_extract_metrics_match_independent_computation(model_dir, task_file, rank):
    lm = load_model(str(model_dir), dtype="float32")
    task = get_task(str(task_file))
    res = extract(lm, task, "ltv", ExtractOptions(k=6, n=24, lam=5.0, seed=3, n_test=20,
                                                  batch_size=5, progress=False, rank=rank))
    tv = res.artifact
    assert tv.meta["k_used"] == 6 and tv.meta["n"] == 24 and tv.rank <= 24
    assert tv.meta["metrics_rank"] == tv.rank
    ep = sample_episode(load_dataset(task), k=6, n=24, n_test=20, seed=3)
    # the recorded gram is the train queries' zero-shot states in V's coordinates,
    # here from transformers' own forward (last layer, post-norm, last token)
    h = []
    for e in ep.queries:
        enc = lm.tokenizer(task.query(e.text), return_tensors="pt")
        with torch.no_grad():
            h.append(lm.model(**enc, output_hidden_states=True).hidden_states[-1][0, -1].float())
    A = tv.V.T @ torch.stack(h).T
    torch.testing.assert_close(tv.gram, A @ A.T / 24, atol=1e-4, rtol=1e-3)
    if rank is not None:  # the rank-3 cut of the full fit, weighted by its states and LM head
        from ltv_vllm.core.ridge import Factors, head_gram, truncate
        from ltv_vllm.extraction.capture import full_head

        full = extract(lm, task, "ltv", ExtractOptions(k=6, n=24, lam=5.0, seed=3, n_test=20,
                                                       batch_size=5, progress=False)).artifact
        assert tv.rank == 3 < full.rank
        cut = truncate(Factors(full.U, full.V, "", full.gram), 3,
                       head_gram=head_gram(full_head(lm.model)[0]))
        torch.testing.assert_close(tv.U @ tv.V.T, cut.dense(), atol=1e-5, rtol=1e-4)
    ids = label_token_ids(task, lm.tokenizer)
    labels = torch.tensor([e.label for e in ep.test])
    from ltv_vllm.extraction.apply import task_vector_applied

    def last_logits(prompt: str) -> torch.Tensor:
        enc = lm.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            return lm.model(**enc).logits[0, -1, ids].float()

    icl = torch.stack([last_logits(ep.demo_prefix() + task.query(e.text)) for e in ep.test])
    zs = torch.stack([last_logits(task.query(e.text)) for e in ep.test])
    with task_vector_applied(lm.model, tv):
        ltv = torch.stack([last_logits(task.query(e.text)) for e in ep.test])
    for name, z in (("icl", icl), ("zero-shot", zs), ("ltv", ltv)):
        acc = float((z.argmax(-1) == labels).float().mean())
        assert res.metrics[name]["accuracy"] == pytest.approx(acc, abs=1e-9), name
        assert res.metrics[name]["d_ntp"] == pytest.approx(hand_kl(icl, z), abs=1e-4), name
    # the fit moves the zero-shot distribution toward ICL on held-out queries
    if rank is None:
        assert res.metrics["ltv"]["d_ntp"] < res.metrics["zero-shot"]["d_ntp"]


def test_cli_extract_inspect_evaluate(tmp_path, model_dir, task_file):
    runner = CliRunner()
    out = tmp_path / "toy.safetensors"
    r = runner.invoke(main, ["extract", "--model", str(model_dir), "--task", str(task_file),
                             "--k", "4", "--n", "16", "--n-test", "12", "--quiet", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "ltv" in r.output and out.exists()
    tv = load_task_vector(out)
    assert tv.meta["task"]["name"] == "toy" and tv.meta["seed"] == 0
    pv = tv.provenance  # typed: what ran, in which precision, on which hardware
    assert (pv.k_used, pv.n, pv.seed, pv.method) == (4, 16, 0, "ltv")
    assert pv.shift_steps == "first"  # what a server shifts by default (docs/serving.md)
    assert pv.dtype == "float32"  # a float32 checkpoint stays float32 under --dtype auto
    assert pv.hardware["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "float32 on CPU" in r.output  # the timing line names the dtype and the hardware
    # --batch-size auto (the default): the batch planned from free memory, printed and kept
    assert f"batch {int(pv.timings['batch_size'])} (auto)" in r.output, r.output
    assert pv.timings["batch_size"] == 12  # the last pass: all 12 test prompts at once
    # a vector below zero-shot by more than 1/√12 of the test queries is warned (hand count)
    low = pv.metrics["zero-shot"]["accuracy"] - pv.metrics["ltv"]["accuracy"] > 12 ** -0.5
    assert ("warning: ltv scored" in r.output) == low, r.output
    r = runner.invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0 and "hidden task vector" in r.output
    assert "extracted on: " in r.output and pv.hardware["cpu_capability"] in r.output

    ev = tmp_path / "ev"
    r = runner.invoke(main, ["evaluate", "--model", str(model_dir), "--tasks", str(task_file),
                             "--runs", "2", "--k", "4", "--n", "16", "--n-test", "12",
                             "--quiet", "--out", str(ev)],
                      prog_name="python -m ltv_vllm.cli")  # run as a module, written as the CLI
    assert r.exit_code == 0, r.output
    doc = json.loads((ev / "results.json").read_text())
    assert doc["command"].startswith(f"ltv-vllm evaluate --model {model_dir} --tasks")
    assert len(doc["records"]) == 2 * 4  # runs × methods
    s = doc["summary"]["per_task"]["toy"]
    assert s["icl"]["d_ntp"] == 0.0 and s["ltv"]["runs"] == 2
    accs = [r_["accuracy"] for r_ in doc["records"] if r_["method"] == "ltv"]
    assert s["ltv"]["accuracy"] == pytest.approx(sum(accs) / 2)
    assert (ev / "dntp_vs_accuracy.png").stat().st_size > 1000
    assert "| LTV |" in (ev / "results.md").read_text()


def test_the_python_api_makes_the_command_s_file(tmp_path, model_dir, task_file, monkeypatch):
    """`jobs.extract.extract_file(ExtractJob(...))` is the call `ltv-vllm extract` makes:
    the same flags as a job write the same vector, tensor for tensor; a job a check refuses
    loads no model and writes nothing."""
    from ltv_vllm.errors import ArgumentError
    from ltv_vllm.jobs import extract as jobs
    from ltv_vllm.pipeline.extract import ExtractOptions

    cli_out = tmp_path / "cli.pt"
    r = CliRunner().invoke(main, ["extract", "--model", str(model_dir), "--task", str(task_file),
                                  "--k", "4", "--n", "16", "--n-test", "12", "--seed", "2",
                                  "--batch-size", "5", "--quiet", "-o", str(cli_out)])
    assert r.exit_code == 0, r.output
    job = jobs.ExtractJob(task=str(task_file), model=str(model_dir), output=tmp_path / "api.pt",
                          opts=ExtractOptions(k=4, n=16, n_test=12, seed=2, batch_size=5,
                                              progress=False))
    out = jobs.extract_file(job)
    assert out.output == tmp_path / "api.pt" and out.task.name == "toy"
    a, b = load_task_vector(cli_out), load_task_vector(out.output)
    torch.testing.assert_close(a.U, b.U, atol=0, rtol=0)
    torch.testing.assert_close(a.V, b.V, atol=0, rtol=0)
    assert a.provenance.teacher == b.provenance.teacher  # gold blended by default, both ways
    assert out.metrics["ltv"] == a.provenance.metrics["ltv"]

    def no_model(*_a: object, **_k: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("ltv_vllm.models.loading.load_model", no_model)
    for bad, why in ((dict(method="tv", engine="vllm"), "inner layers"),
                     (dict(method="fv", output=tmp_path / "x.pt"), ".safetensors"),
                     (dict(demos_file=str(task_file), opts=ExtractOptions(k=3)), "drop --k")):
        with pytest.raises(ArgumentError, match=why):
            jobs.extract_file(jobs.ExtractJob(**{"task": str(task_file),
                                                 "model": str(model_dir), **bad}))
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["extract", "--task", "nope"], "unknown task 'nope'"),
        (["data", "show", "nope"], "unknown task 'nope'"),
        (["inspect", "/nonexistent.pt"], "not found"),
        (["models", "prepare", "gpt-17"], "gpt-17"),
        (["evaluate", "--methods", "ltv,magic"], "magic"),
    ],
)
def test_cli_bad_input_is_one_line(args, message):
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0
    assert message in r.output
    assert "Traceback" not in r.output


def test_cli_colliding_labels(tmp_path, model_dir):
    (tmp_path / "d.jsonl").write_text(
        "\n".join(json.dumps({"text": f"x {i}", "label": ["negative", "negatively"][i % 2]})
                  for i in range(40)))
    (tmp_path / "t.json").write_text(json.dumps({
        "name": "clash", "in_prefix": "Review", "label_prefix": "Sentiment",
        "labels": ["negative", "negatively"], "data": "d.jsonl"}))
    r = CliRunner().invoke(main, ["extract", "--model", str(model_dir), "--task",
                                  str(tmp_path / "t.json"), "-o", str(tmp_path / "c.pt")])
    assert r.exit_code == 1
    assert "share their first token" in r.output
    assert not (tmp_path / "c.pt").exists()
