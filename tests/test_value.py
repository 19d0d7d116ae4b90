# ruff: noqa: F811 - pytest fixtures imported from test_extract are parameters here
"""The held-out value protocol (`bench value`) and its parts, each against an independent
computation: bootstrap intervals against normal theory, the probe against its optimality
condition, the LoRA tuner against transformers' own forward (and the model restored after),
the bench's default row against the pipeline's `extract`, its summary against the stored
per-query records — and no choice reads the test split (scrambling the test leaves every
choice as it was)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from test_extract import WORDS, model_dir  # noqa: F401 - the tiny model fixture

from conftest import write_toy_task
from ltv_vllm.core.probe import fit_probe
from ltv_vllm.core.stats import Interval, paired_bootstrap, stratified_bootstrap


def _normal_halfwidth(d: torch.Tensor) -> float:
    return 1.96 * float(d.std(unbiased=False)) / math.sqrt(d.numel())


def test_paired_bootstrap_against_normal_theory():
    g = torch.Generator().manual_seed(0)
    a = (torch.rand(600, generator=g) < 0.7).double()
    b = (torch.rand(600, generator=g) < 0.6).double()
    iv = paired_bootstrap(a, b)
    d = a - b
    assert iv.diff == pytest.approx(float(d.mean()))
    half = _normal_halfwidth(d)
    assert (iv.hi - iv.lo) / 2 == pytest.approx(half, rel=0.08)
    assert iv.lo == pytest.approx(iv.diff - half, abs=0.01)
    assert paired_bootstrap(a, b) == iv  # seeded: recomputed from records, the same numbers
    # a constant difference has no spread; identical scores are a tie at 0
    assert paired_bootstrap([1, 1, 0], [0, 0, -1]) == Interval(1.0, 1.0, 1.0)
    assert paired_bootstrap(a, a).verdict == "tie"
    assert Interval(0.1, 0.01, 0.2).verdict == "above"
    assert Interval(-0.1, -0.2, -0.01).verdict == "below"
    # stratified: the mean of the per-task differences, each task's variance on its own
    c = (torch.rand(200, generator=g) < 0.5).double()
    e = (torch.rand(200, generator=g) < 0.4).double()
    both = stratified_bootstrap([(a, b), (c, e)])
    assert both.diff == pytest.approx((float(d.mean()) + float((c - e).mean())) / 2)
    half2 = math.sqrt(_normal_halfwidth(d) ** 2 + _normal_halfwidth(c - e) ** 2) / 2
    assert (both.hi - both.lo) / 2 == pytest.approx(half2, rel=0.08)
    with pytest.raises(AssertionError, match="differ in length"):
        paired_bootstrap([1, 0], [1])


def test_probe_is_the_regularised_optimum():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(120, 10, generator=g)
    y = (h[:, :3] @ torch.randn(3, 3, generator=g)).argmax(-1)
    pr = fit_probe(h, y, 3, 1e-3)
    # the gradient of the objective at the returned weights, by autograd from scratch
    x = (h.double() - h.double().mean(0)) / (h.double().std(0) + 1e-6)
    w = pr.w.clone().requires_grad_(True)
    xb = torch.cat([x, torch.ones(120, 1, dtype=torch.float64)], 1)
    loss = torch.nn.functional.cross_entropy(xb @ w, y) + 1e-3 * (w[:-1] ** 2).sum()
    (grad,) = torch.autograd.grad(loss, w)
    assert float(grad.abs().max()) < 1e-5  # (at the zero start it is ~0.1)
    assert float((pr.logits(h).argmax(-1) == y).double().mean()) > 0.9


def test_lora_tuner_scores_like_transformers_and_restores_the_model(model_dir):
    from ltv_vllm.extraction.finetune import LoraOptions, LoraTuner
    from ltv_vllm.models.loading import load_model

    lm = load_model(str(model_dir), dtype="float32")
    prompts = [f"Review: {w} {w}\nSentiment:" for w in WORDS[:12]]
    labels = [i % 2 for i in range(12)]
    ids = [lm.tokenizer(" negative", add_special_tokens=False)["input_ids"][0],
           lm.tokenizer(" positive", add_special_tokens=False)["input_ids"][0]]

    def own(model) -> torch.Tensor:  # transformers' forward, one prompt at a time
        with torch.no_grad():
            return torch.stack([model(**lm.tokenizer(p, return_tensors="pt")).logits[0, -1, ids]
                                for p in prompts])

    before = own(lm.model)
    opts = LoraOptions(lrs=(1e-3, 1e-2), epochs=2, batch_size=5, seed=0)
    tuner = LoraTuner(lm.model, lm.tokenizer, ids, opts=opts, progress=False)
    try:
        torch.testing.assert_close(tuner.label_logits(prompts), before, atol=1e-4, rtol=1e-4)
        choice = tuner.fit(prompts[:8], labels[:8], prompts[8:], labels[8:])
        assert len(choice.curve) == 4
        best = max(choice.curve, key=lambda c: (c["dev_accuracy"], -c["dev_loss"]))
        assert (choice.lr, choice.epoch) == (best["lr"], best["epoch"])
        z = tuner.label_logits(prompts[8:])  # the kept adapter, batched
        acc = float((z.argmax(-1) == torch.tensor(labels[8:])).double().mean())
        assert acc == pytest.approx(choice.dev_accuracy)
        torch.testing.assert_close(z, own(tuner.model)[8:], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(z, before[8:], atol=1e-3)  # training moved it
    finally:
        restored = tuner.close()
    assert restored is lm.model
    torch.testing.assert_close(own(lm.model), before, atol=0, rtol=0)


OPTS = dict(k=4, many_k=8, demo_sets=2, n=24, n_dev=16, n_test=20, seeds=(0, 1),
            dtype="float32", batch_size=8)


@pytest.fixture(scope="module")
def value_run(tmp_path_factory, model_dir):
    from ltv_vllm.bench.value import ValueOptions, bench_value
    from ltv_vllm.extraction.finetune import LoraOptions
    from ltv_vllm.tasks.specs import get_task

    root = tmp_path_factory.mktemp("value")
    task = get_task(str(write_toy_task(root, WORDS)))
    opts = ValueOptions(model=str(model_dir), **OPTS, layer_rows=True,
                        lora_options=LoraOptions(lrs=(1e-3,), epochs=2, batch_size=8))
    out = root / "out"
    doc = bench_value([task], opts, out, "test", log=print)
    return task, opts, out, doc


def test_value_summary_is_the_records_and_the_default_is_extracts(value_run, model_dir):
    from safetensors.torch import load_file

    from ltv_vllm.bench.value import DEFAULT, LORA, PROBE, PROMPT_K, plan, regimes
    from ltv_vllm.core.stats import stratified_bootstrap
    from ltv_vllm.core.teacher import DEFAULT_GOLD_WEIGHT, TeacherOptions
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, extract

    task, opts, out, doc = value_run
    records = json.loads((out / "records.json").read_text())
    gold = records["tasks"][task.name]["gold"]
    sizes = doc["splits"][task.name]
    assert sizes == {"train": 24, "dev": 16, "test": len(gold), "k": 4, "demo_sets": 2,
                     "many_k": 8}
    assert [e["seed"] for e in records["episodes"]] == [0, 1]
    # every row's accuracy is the stored predictions' (mean over seeds), counted by hand
    labels = doc["summary"]["labels"]
    for row in regimes(True)["labels"]["rows"]:
        hand = sum(sum(p == y for p, y in zip(e["test_predictions"][row], gold, strict=True))
                   for e in records["episodes"]) / (2 * len(gold))
        assert labels["accuracy"][task.name][row] == pytest.approx(hand), row
    # an interval in results.json is recomputed from the records alone
    cmp = next(c for c in labels["comparisons"] if c["row"] == DEFAULT and c["reference"] == PROBE)

    def scores(row: str) -> torch.Tensor:
        return torch.stack([(torch.tensor(e["test_predictions"][row]) == torch.tensor(gold))
                            .double() for e in records["episodes"]]).mean(0)

    again = stratified_bootstrap([(scores(DEFAULT), scores(PROBE))])
    assert cmp["average"] == again.record()
    # the default row is `extract`'s shipped vector (gold 0.8, λ = 5) on the same episode
    lm = load_model(str(model_dir), dtype="float32")
    ep, _ = plan(task, opts, 0)
    teacher = TeacherOptions(gold_weight=DEFAULT_GOLD_WEIGHT)  # what `extract` ships
    res = extract(lm, task, "ltv", ExtractOptions(k=4, n=24, n_test=20, seed=0, n_val=16,
                                                  batch_size=8, progress=False, teacher=teacher),
                  episode=replace(ep, extra_demos=()))
    assert res.artifact.provenance.teacher["gold_weight"] == DEFAULT_GOLD_WEIGHT
    assert res.label_logits["ltv"].argmax(-1).tolist() == \
        records["episodes"][0]["test_predictions"][DEFAULT]
    assert res.label_logits["icl"].argmax(-1).tolist() == \
        records["episodes"][0]["test_predictions"][PROMPT_K]
    st = load_file(str(out / "states" / f"{task.name}_seed0.safetensors"))
    assert st["h_icl_train"].shape[0] == 3  # two k-shot sets and the many-shot prompt
    ch = doc["episodes"][0]["choices"]
    assert ch[LORA]["labels_used"] == 24 and ch[DEFAULT]["labels_used"] == 24
    assert "## With the N train queries' labels" in (out / "results.md").read_text()


def _label_logits_at_block(lm, task, prompts, ids, layer, U, V) -> torch.Tensor:
    """transformers' own forward, one prompt at a time, with a hand-made hook on decoder
    block `layer`: its output at the last position moved by (h V) Uᵀ; the label logits."""
    block = lm.model.model.layers[layer]

    def hook(_mod, _args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h.clone()
        h[:, -1] = h[:, -1] + (h[:, -1] @ V) @ U.T
        return (h, *out[1:]) if isinstance(out, tuple) else h

    handle = block.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return torch.stack([lm.model(**lm.tokenizer(
                p, return_tensors="pt", add_special_tokens=task.special_tokens)).logits[0, -1, ids]
                for p in prompts])
    finally:
        handle.remove()


def test_the_layer_row_is_its_block_s_shift_chosen_on_dev(value_run, model_dir):
    """`--layer-rows`: the stored layer task applied by a hand-made hook at its block (last
    prompt token) in transformers' forward gives the row's test predictions and its dev
    accuracy (the best block's on dev); the table compares it with the prompt it replaces.
    A shift one block off, or on another row, changes the logits checked here."""
    from ltv_vllm.bench.value import LAYER, PROMPT_K, plan, regimes
    from ltv_vllm.core.layer_task import load_layer_task
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.tasks.specs import label_token_ids

    task, opts, out, doc = value_run
    records = json.loads((out / "records.json").read_text())
    rec = json.loads((out / "states" / f"{task.name}_seed0.layer.json").read_text())
    lt = load_layer_task(out / "states" / f"{task.name}_seed0.layer.safetensors")
    ell = int(lt.layers[0])
    assert rec["layer"] == ell and len(rec["dev_by_layer"]) == 2  # the tiny model's blocks
    assert rec["dev_accuracy"] == max(rec["dev_by_layer"])
    lm = load_model(str(model_dir), dtype="float32")
    ids = list(label_token_ids(task, lm.tokenizer))
    ep, _ = plan(task, opts, 0)
    U, V = lt.U[0].float(), lt.V[0].float()
    z = _label_logits_at_block(lm, task, [task.zero_shot(e.text) for e in ep.test], ids,
                               ell, U, V)
    torch.testing.assert_close(z, torch.tensor(rec["test_logits"]), atol=1e-4, rtol=1e-4)
    assert z.argmax(-1).tolist() == records["episodes"][0]["test_predictions"][LAYER]
    z_dev = _label_logits_at_block(lm, task, [task.zero_shot(e.text) for e in ep.val], ids,
                                   ell, U, V)
    dev = torch.tensor([e.label for e in ep.val])
    assert float((z_dev.argmax(-1) == dev).double().mean()) == pytest.approx(rec["dev_accuracy"])
    layer = doc["summary"]["layer"]
    assert list(layer["average"]) == regimes(True, True)["layer"]["rows"]
    assert {c["reference"] for c in layer["comparisons"]} >= {PROMPT_K}
    md = (out / "results.md").read_text()
    assert "## At a decoder block" in md and f"layer={ell}" in md


def test_the_layer_row_s_choice_reads_no_test(value_run, tmp_path):
    """The layer row's block and dev accuracy come from train and dev alone: with the test
    queries replaced by others, its record chooses the same."""
    from ltv_vllm.bench.value import ModelHandle, layer_record, plan
    from ltv_vllm.tasks.specs import label_token_ids

    task, opts, out, _ = value_run
    rec = json.loads((out / "states" / f"{task.name}_seed0.layer.json").read_text())
    ep, _ = plan(task, opts, 0)
    other = replace(ep, test=tuple(reversed(ep.val)))
    model = ModelHandle(opts)
    ids = list(label_token_ids(task, model.capturer(task).tokenizer))
    again = layer_record(model, task, other, ids, tmp_path / "x.layer.json")
    assert (again["layer"], again["dev_by_layer"]) == (rec["layer"], rec["dev_by_layer"])
    assert again["test_logits"] != rec["test_logits"]


def _choices(episode: dict) -> dict:
    """What was chosen and its dev accuracy, per row (timings dropped)."""
    return {row: {k: v for k, v in c.items() if k != "fit_seconds"}
            for row, c in episode["choices"].items()}


def test_no_choice_reads_the_test_split(value_run):
    """Scramble the test split (its states replaced by noise, its labels permuted): every
    choice, and every dev accuracy, stays as it was. A choice made on test (λ picked by
    test accuracy, say) changes with it and fails here."""
    from safetensors.torch import load_file

    from ltv_vllm.bench.value import lora_fit, run_episode

    task, opts, out, _ = value_run
    for seed in opts.seeds:
        st = load_file(str(out / "states" / f"{task.name}_seed{seed}.safetensors"))
        rec = json.loads((out / "states" / f"{task.name}_seed{seed}.lora.json").read_text())
        first = run_episode(st, opts.demo_sets, lora_fit(rec, opts.n))
        g = torch.Generator().manual_seed(seed)
        scrambled = dict(st)
        scrambled["h_zs_test"] = torch.randn(st["h_zs_test"].shape, generator=g) * 3
        scrambled["h_icl_test"] = torch.randn(st["h_icl_test"].shape, generator=g) * 3
        scrambled["labels_test"] = st["labels_test"][torch.randperm(
            st["labels_test"].numel(), generator=g)]
        rec2 = {**rec, "test_logits": torch.randn(len(rec["test_logits"]), 2).tolist()}
        second = run_episode(scrambled, opts.demo_sets, lora_fit(rec2, opts.n))
        assert _choices(second) == _choices(first)
        assert second["test_predictions"] != first["test_predictions"]  # the test did change


def test_a_rerun_reuses_the_states_without_a_model(value_run, monkeypatch):
    from ltv_vllm.bench import value

    task, opts, out, doc = value_run

    def no_model(*_args: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(value.ModelHandle, "capturer", no_model)
    again = value.bench_value([task], opts, out, "test", log=print)
    assert again["summary"] == doc["summary"]


def test_bench_value_refusals_before_any_model(tmp_path, model_dir):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    task = write_toy_task(tmp_path, WORDS)
    base = ["bench", "value", "--model", str(model_dir), "--tasks", str(task), "--k", "4",
            "--n", "24", "--n-test", "20", "--many-k", "8", "--no-lora",
            "--out", str(tmp_path / "o")]
    for extra, why in ((["--n-dev", "5000"], "only"), (["--many-k", "lots"], "--many-k"),
                       (["--seeds", "1,1"], "distinct"), (["--seeds", "x"], "integers"),
                       (["--lora-lrs", "0.1,x"], "--lora-lrs"),
                       (["--lora-epochs", "0"], "at least"),
                       (["--serving", "--serving-tasks", "sst2"], "not among --tasks"),
                       (["--serving-tasks", "toy"], "needs --serving")):
        r = CliRunner().invoke(main, [*base, *extra])
        assert r.exit_code != 0 and why in r.output, (extra, r.output)
        assert not (tmp_path / "o" / "states").exists()


def test_the_recorded_command_keeps_an_off_switch():
    """`--no-lora` (a switch whose default is on) is spelled out in the recorded command, so
    running it again does what the first run did."""
    import click
    from click.testing import CliRunner

    from ltv_vllm.cli.base import _command_line

    @click.command()
    @click.option("--lora/--no-lora", default=True)
    @click.option("--serving/--no-serving", default=False)
    @click.option("--quiet", is_flag=True)
    def cmd(lora: bool, serving: bool, quiet: bool) -> None:  # noqa: ARG001 - recorded only
        click.echo(_command_line())

    out = CliRunner().invoke(cmd, ["--no-lora"]).output
    assert "--no-lora" in out and "--no-serving" in out and "--quiet" not in out
    assert "--lora --serving" in CliRunner().invoke(cmd, ["--serving"]).output


def test_merge_joins_another_run_s_tasks_and_refuses_a_mismatch(value_run, tmp_path):
    from dataclasses import replace as dc_replace

    from ltv_vllm.bench.value import DEFAULT, bench_value
    from ltv_vllm.bench.value_report import merge_docs
    from ltv_vllm.errors import ArgumentError
    from ltv_vllm.tasks.specs import get_task

    task, opts, out, doc = value_run
    src = out.parent / "toy.json"
    spec = json.loads(src.read_text())
    spec["name"] = "toy2"
    (out.parent / "toy2.json").write_text(json.dumps(spec))
    task2 = get_task(str(out.parent / "toy2.json"))
    merged = merge_docs([out], opts, ["toy2"])
    both = bench_value([task2], opts, tmp_path / "both", "test", log=print, merged=merged)
    assert both["tasks"] == ["toy2", "toy"] and len(both["episodes"]) == 4
    acc = both["summary"]["labels"]["accuracy"]
    assert acc["toy"] == doc["summary"]["labels"]["accuracy"]["toy"]
    avg = both["summary"]["labels"]["average"][DEFAULT]
    assert avg == pytest.approx((acc["toy"][DEFAULT] + acc["toy2"][DEFAULT]) / 2)
    records = json.loads((tmp_path / "both" / "records.json").read_text())
    assert set(records["tasks"]) == {"toy", "toy2"}
    with pytest.raises(ArgumentError, match="is in this run"):
        merge_docs([out], opts, ["toy"])
    with pytest.raises(ArgumentError, match="another configuration"):
        merge_docs([out], dc_replace(opts, n_test=19), ["toy2"])
