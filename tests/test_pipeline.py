"""One extraction pipeline: the artifact `ltv-vllm extract` writes is the one `evaluate`
scores for the same episode, and a method added in one module (plus one `register` line)
reaches `extract`, `evaluate`, their flags and the plots with nothing else touched."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import ltv_vllm.evaluation.episodes as episodes
import ltv_vllm.evaluation.evaluate as ev
from conftest import make_llama, write_toy_task
from ltv_vllm.cli import main
from ltv_vllm.core.vector import load_task_vector
from ltv_vllm.evaluation.evaluate import EvalConfig, method_colors
from ltv_vllm.methods import METHODS, MethodOptions
from ltv_vllm.methods.base import DECLARED
from ltv_vllm.models.loading import load_model
from ltv_vllm.tasks.specs import get_task

WORDS = ["the", "plot", "is", "dull", "and", "acting", "worse", "a", "gorgeous", "movie"]
VECTOR_METHODS = ("ltv", "mean", "kernel")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("pipeline")
    make_llama(len(tokenizer), seed=5, layers=2).save_pretrained(d / "m")
    tokenizer.save_pretrained(d / "m")
    return d, d / "m", write_toy_task(d, WORDS)


def test_the_vector_extract_writes_is_the_one_evaluate_scores(setup, monkeypatch):
    d, model_dir, spec = setup
    runner = CliRunner()
    written = {}
    for m in VECTOR_METHODS:
        out = d / f"{m}.safetensors"
        r = runner.invoke(main, ["extract", "--model", str(model_dir), "--task", str(spec),
                                 "--method", m, "--k", "6", "--n", "20", "--n-test", "10",
                                 "--seed", "4", "--dtype", "float32", "--quiet", "-o", str(out),
                                 # evaluate's batch below: equal to the bit needs equal batches
                                 "--batch-size", "16",
                                 # and evaluate's teacher, the prompt itself (extract's
                                 # default blends the labelled queries' gold labels in)
                                 "--gold-weight", "0"])
        assert r.exit_code == 0, r.output
        written[m] = load_task_vector(out)

    # what evaluate scores: the artifacts its scoring pass holds, run 0 = seed 4
    scored = {}
    real = episodes.score_methods

    def spy(ctx, names, *a, **kw):
        sc = real(ctx, names, *a, **kw)
        scored.update(sc.artifacts)
        return sc

    monkeypatch.setattr(episodes, "score_methods", spy)
    lm = load_model(str(model_dir), dtype="float32")
    task = get_task(str(spec))
    doc = ev.evaluate(lm, [task], ["zero-shot", "icl", *VECTOR_METHODS],
                      EvalConfig(k=6, n=20, n_test=10, runs=1, seed=4, cost_samples=0),
                      progress=False)
    for m in VECTOR_METHODS:
        a, b = written[m], scored[m]
        assert a.map == b.map and a.gamma == b.gamma, m
        for name in ("U", "V", "bias"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), (m, name)
            if x is not None:
                assert torch.equal(x, y), (m, name)
        # and the metrics the file records are the evaluation's
        rec = {r["method"]: r for r in doc["records"]}
        assert a.provenance.metrics[m]["accuracy"] == rec[m]["accuracy"], m
        assert a.provenance.metrics[m]["d_ntp"] == rec[m]["d_ntp"], m
    assert written["ltv"].rank > 0 and written["mean"].rank == 0


# -- a worked example: a new method is one module and one register line ---------------------
# (This is what docs/methods.md walks through; it is not shipped.)

def _example_module():
    from ltv_vllm.core.ridge import mean_shift
    from ltv_vllm.core.vector import TaskVector
    from ltv_vllm.methods.base import Context, Method, Option

    class HalfMean(Method):
        """The mean shift, scaled by a factor: h + s · mean(h_icl − h_zs)."""

        name, label = "half-mean", "Scaled mean shift"
        hidden_space = uses_states = True
        color = "crimson"
        supports = frozenset({"fused", "generation"})
        options = (Option("mean_scale", 0.5, "half-mean: the factor s.", float, positive=True),)

        def extract(self, ctx: Context) -> TaskVector:
            h_zs, h_icl = ctx.states()
            d = h_zs.shape[1]
            empty = torch.zeros(d, 0)
            return TaskVector("hidden", empty, empty.clone(),
                              ctx.opts.mean_scale * mean_shift(h_icl - h_zs), ctx.identity,
                              tuple(ctx.label_ids), ctx.provenance(self.name))

        def applied(self, model, art):
            from ltv_vllm.extraction.apply import task_vector_applied

            return task_vector_applied(model, art)

        def shift(self, art, h):
            return art.shift_hidden(h)

    return HalfMean


@pytest.fixture
def registered():
    from ltv_vllm.methods import register

    method = register(_example_module()())
    yield method
    del METHODS[method.name]
    for o in method.options:
        DECLARED.pop(o.name)


@pytest.mark.usefixtures("registered")
def test_a_method_added_in_one_module_reaches_every_command(setup, tmp_path):
    d, model_dir, spec = setup
    runner = CliRunner()
    help_ = runner.invoke(main, ["extract", "--help"], terminal_width=200).output
    assert "half-mean" in help_ and "--mean-scale" in help_ and "half-mean: the factor" in help_
    assert "half-mean" in runner.invoke(main, ["evaluate", "--help"]).output
    assert method_colors()["half-mean"] == "crimson"

    base = ["--model", str(model_dir), "--k", "6", "--n", "20", "--n-test", "10",
            "--dtype", "float32", "--quiet"]
    r = runner.invoke(main, ["extract", "--task", str(spec), "--method", "half-mean",
                             "--mean-scale", "0.25", "-o", str(tmp_path / "h.pt"), *base])
    assert r.exit_code == 0, r.output
    quarter = load_task_vector(tmp_path / "h.pt")
    r = runner.invoke(main, ["extract", "--task", str(spec), "--method", "mean",
                             "-o", str(tmp_path / "mean.pt"), *base])
    assert r.exit_code == 0, r.output
    mean = load_task_vector(tmp_path / "mean.pt")
    torch.testing.assert_close(quarter.bias, 0.25 * mean.bias)  # its option reached its fit
    # its flag is refused where it is not read
    r = runner.invoke(main, ["extract", "--task", str(spec), "--method", "ltv",
                             "--mean-scale", "2", *base])
    assert r.exit_code == 1 and "--mean-scale is an option of half-mean" in r.output

    import matplotlib.axes

    drawn = []  # (label, colour) of every scatter series the report draws
    real_scatter = matplotlib.axes.Axes.scatter

    def scatter(self, *a, **kw):
        drawn.append((kw.get("label"), kw.get("color")))
        return real_scatter(self, *a, **kw)

    out = tmp_path / "ev"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.axes.Axes, "scatter", scatter)
        r = runner.invoke(main, ["evaluate", "--tasks", str(spec), "--methods",
                                 "zero-shot,icl,half-mean", "--runs", "1", "--cost-samples",
                                 "0", "--out", str(out), *base])
    assert r.exit_code == 0, r.output
    assert ("Scaled mean shift", "crimson") in drawn
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["options"]["mean_scale"] == 0.5
    assert "| Scaled mean shift |" in (out / "results.md").read_text()
    assert (out / "dntp_vs_accuracy.png").stat().st_size > 1000


def test_method_options_are_checked_and_defaulted_from_the_declarations():
    o = MethodOptions(fv_trials=3)
    assert o.fv_trials == 3 and o.mlp_depth == 2 and o.replace(mlp_depth=4).mlp_depth == 4
    with pytest.raises(Exception, match="--mlp-depth must be an even number"):
        MethodOptions(mlp_depth=3)
    with pytest.raises(Exception, match="--i2cl-lam must be a finite number"):
        MethodOptions(i2cl_lam=float("nan"))
    with pytest.raises(Exception, match="unknown method option"):
        MethodOptions(nope=1)
    with pytest.raises(AttributeError):
        o.fv_trials = 4  # frozen
