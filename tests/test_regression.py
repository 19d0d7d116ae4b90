"""Regression tasks: task specs, seeded instances, prompt format, number parsing, MSE."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from conftest import make_llama
from ltv_vllm.core.metrics import parse_number, regression_scores
from ltv_vllm.tasks.data import (
    DataError,
    regression_instance,
    regression_target,
    sample_regression_episode,
)
from ltv_vllm.tasks.specs import RegressionTask, TaskError, get_task, get_tasks, task_from_dict

pytestmark = pytest.mark.slow(seconds=10)  # see conftest's ordering


def _x(text: str) -> list[float]:
    return json.loads(text)


# -- parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "want"), [
    (" 1.2345\n\nx: [0.1]", 1.2345),     # the answer, then the next demo
    (" -0.5", -0.5),                     # sign
    (" +.25 units", 0.25),               # explicit plus, no leading digit, trailing words
    (" 3.", 3.0),                        # a trailing point
    (" 2e-3", 0.002),                    # exponent
    (" about -1.5 or so", -1.5),         # leading words on the answer line
    (" 1.2.3", 1.2),                     # a second point ends the number
    ("\n  -0.75\n", -0.75),              # the answer on the next line
    (" 12", 12.0),                       # an integer
])
def test_parse_number_reads_the_first_number_of_the_answer_line(text, want):
    assert parse_number(text) == pytest.approx(want, abs=0, rel=0)


@pytest.mark.parametrize("text", [
    "", "   ", " abc", " -", " .", "\n\n",
    "\nx: [1.0, 2.0]",                   # skipped the answer, started the next demo
    " 1e999",                            # not finite
    " nan", " inf",
])
def test_parse_number_garbage_is_none(text):
    assert parse_number(text) is None


def test_parse_number_only_reads_the_first_line():
    assert parse_number(" ?\n4.0") is None
    assert parse_number(" ?\n4.0", next_input=None) is None  # the first non-empty line is " ?"


def test_regression_scores_against_hand_values():
    answers = [1.0, None, 3.5, -2.0]
    targets = [0.0, 2.0, 3.0, -1.0]
    got = regression_scores(answers, targets)
    assert got["mse"] == pytest.approx((1.0 + 0.25 + 1.0) / 3)
    assert got["parse_rate"] == pytest.approx(0.75)
    assert got["mse_zero_fill"] == pytest.approx((1.0 + 4.0 + 0.25 + 1.0) / 4)
    assert got["n"] == 4
    none = regression_scores([None, None], [1.0, 2.0])
    assert math.isnan(none["mse"]) and none["parse_rate"] == 0.0
    assert none["mse_zero_fill"] == pytest.approx(2.5)


def test_regression_scores_tell_echoes_of_x_from_answers():
    """An answer equal to a coordinate of its own query's x (as printed, 4 decimals) is an
    echo: counted apart, and left out of `mse_own`; a value of another query's x is not."""
    inputs = [[-3.6117, 0.8299], [1.25, 0.0], [0.5, 0.5], [2.0, -1.0], [0.1, 0.2]]
    # echo of x; own; unparsed; own (an x of query 1, not of query 3); a demo's y
    answers = [-3.6117, 0.7, None, 0.0, 1.2346]
    targets = [1.0, 1.0, 2.0, 0.5, 1.0]
    got = regression_scores(answers, targets, inputs, decimals=4, demo_labels=[1.2346, 9.0])
    assert (got["parsed"], got["echoes"], got["echoes_x"], got["echoes_demo"]) == (4, 2, 1, 1)
    assert got["echo_rate"] == 0.4 and got["own_rate"] == 0.4
    assert got["mse_own"] == pytest.approx(((0.7 - 1.0) ** 2 + 0.25) / 2)
    assert got["mse"] == pytest.approx((4.6117 ** 2 + 0.09 + 0.25 + 0.2346 ** 2) / 4)
    assert got["zeros"] == 1 and got["top_count"] == 1
    # the printed rounding decides: 0.82994 prints as 0.8299, 0.82996 as 0.8300
    assert regression_scores([0.8299], [0.0], [[0.82994]], 4)["echoes_x"] == 1
    assert regression_scores([0.8299], [0.0], [[0.82996]], 4)["echoes_x"] == 0
    same = regression_scores([2.0, 2.0, 1.0, None], [0.0] * 4)
    assert (same["top_answer"], same["top_count"]) == (2.0, 2) and "echoes" not in same


# -- tasks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["linear", "relu"])
def test_reference_predictors_against_hand_values(family):
    """Predict 0, the demos' mean, least squares on the demos: MSEs computed by hand (numpy
    on the instance's own x and y); on a linear instance least squares recovers w."""
    import json

    import numpy as np

    from ltv_vllm.evaluation.regress import reference_scores
    from ltv_vllm.tasks.data import regression_instance, sample_regression_episode

    task = get_task(family, regression=True)
    ep = sample_regression_episode(task, k=30, n=1, n_test=40, seed=7)
    got = reference_scores(ep)
    y = np.array([e.label for e in ep.test])
    y_demo = np.array([round(e.label, 4) for e in ep.demos])  # as the prompt prints it
    x_demo = np.array([json.loads(e.text) for e in ep.demos])
    x_test = np.array([json.loads(e.text) for e in ep.test])
    a = np.hstack([x_demo, np.ones((30, 1))])
    coef = np.linalg.lstsq(a, y_demo, rcond=None)[0]
    pred = np.hstack([x_test, np.ones((40, 1))]) @ coef
    assert got["zero"] == pytest.approx(np.mean(y ** 2), rel=1e-9)
    assert got["demo_mean"] == pytest.approx(np.mean((y - y_demo.mean()) ** 2), rel=1e-9)
    assert got["least_squares"] == pytest.approx(np.mean((y - pred) ** 2), rel=1e-6, abs=1e-12)
    if family == "linear":
        w = regression_instance(task, 7)["w"].numpy().ravel()
        np.testing.assert_allclose(coef[:-1], w, atol=1e-3)
        assert got["least_squares"] < 1e-6 < got["zero"]


def test_builtin_regression_tasks_and_prompt_format():
    lin, relu = get_tasks("linear,relu", regression=True)
    assert (lin.family, relu.family) == ("linear", "relu")
    assert (lin.m, relu.r, lin.decimals) == (6, 100, 4)
    assert lin.query("[1.0000]") == "x: [1.0000]\ny:"
    assert lin.demo("[1.0000]", -2.5) == "x: [1.0000]\ny: -2.5000\n\n"
    assert lin.x_text([0.5, -1.25]) == "[0.5000, -1.2500]"
    assert task_from_dict(relu.to_dict()) == relu


def test_regression_task_spec_files(tmp_path):
    p = tmp_path / "cubicish.yaml"
    p.write_text("family: relu\nm: 3\nr: 8\nnoise: 0.1\ndecimals: 2\n")
    t = get_task(str(p), regression=True)
    assert isinstance(t, RegressionTask)
    assert (t.name, t.m, t.r, t.noise, t.decimals) == ("cubicish", 3, 8, 0.1, 2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"family": "quadratic"}))
    with pytest.raises(TaskError, match="unknown regression family 'quadratic'"):
        get_task(str(bad), regression=True)
    bad.write_text(json.dumps({"family": "linear", "degree": 2}))
    with pytest.raises(TaskError, match=r"unknown keys \['degree'\]"):
        get_task(str(bad), regression=True)
    with pytest.raises(TaskError, match="decimals"):
        RegressionTask("x", "linear", decimals=-1)
    with pytest.raises(TaskError, match="noise"):
        RegressionTask("x", "linear", noise=float("nan"))


# -- instances and episodes ------------------------------------------------------------------


def test_instances_are_reproducible_from_their_seed():
    t = get_task("relu", regression=True)
    a = sample_regression_episode(t, k=5, n=7, n_test=3, seed=4, n_val=2)
    b = sample_regression_episode(t, k=5, n=7, n_test=3, seed=4, n_val=2)
    assert a == b and a.demo_prefix() == b.demo_prefix()
    c = sample_regression_episode(t, k=5, n=7, n_test=3, seed=5)
    assert c.demos != a.demos and c.test != a.test
    # each part has its own stream: more queries do not move the demos or the test set
    d = sample_regression_episode(t, k=5, n=50, n_test=3, seed=4)
    assert d.demos == a.demos and d.test == a.test and d.queries[:7] == a.queries
    assert (len(a.demos), len(a.queries), len(a.test), len(a.val)) == (5, 7, 3, 2)


def test_targets_are_the_instance_function_of_the_printed_x():
    for name in ("linear", "relu"):
        t = get_task(name, regression=True)
        ep = sample_regression_episode(t, k=4, n=1, n_test=6, seed=2)
        p = regression_instance(t, 2)
        for e in ep.demos + ep.test:
            x = _x(e.text)
            assert len(x) == t.m and all(round(v, 4) == v for v in x)
            if name == "linear":
                want = sum(wj * xj for wj, xj in zip(p["w"].tolist(), x, strict=True))
            else:  # by hand: α · ReLU(V x), one unit at a time
                want = 0.0
                for vi, ai in zip(p["V"].tolist(), p["alpha"].tolist(), strict=True):
                    want += ai * max(0.0, sum(v * xj for v, xj in zip(vi, x, strict=True)))
            assert e.label == pytest.approx(want, rel=1e-12, abs=1e-12)
        # demos print y to 4 decimals, with a blank line between demos
        first = ep.demos[0]
        assert ep.demo_prefix().startswith(f"x: {first.text}\ny: {first.label:.4f}\n\nx: ")


def test_instance_parameters_follow_the_papers_priors():
    t = get_task("relu", regression=True)
    ps = [regression_instance(t, s) for s in range(20)]
    v = torch.cat([p["V"].flatten() for p in ps])
    alpha = torch.cat([p["alpha"] for p in ps])
    assert v.mean().abs() < 0.05 and (v.std() - 1).abs() < 0.05          # V ~ N(0, I)
    assert (alpha.std() * math.sqrt(t.r) - 1).abs() < 0.1                # α ~ N(0, I/r)
    lin = get_task("linear", regression=True)
    w = torch.cat([regression_instance(lin, s)["w"] for s in range(400)])
    assert (w.std() - 1).abs() < 0.05 and w.mean().abs() < 0.1           # w ~ N(0, I)
    x = torch.tensor([[1.0, -1.0, 0.5, 0.0, 2.0, -0.5]])
    assert regression_target(t, ps[0], x).item() == pytest.approx(
        float(ps[0]["alpha"] @ torch.relu(ps[0]["V"] @ x[0].double())))


def test_noise_is_added_and_seeded():
    t = RegressionTask("noisy", "linear", noise=0.5)
    a = sample_regression_episode(t, k=2, n=1, n_test=200, seed=0)
    clean = sample_regression_episode(RegressionTask("noisy", "linear"), k=2, n=1, n_test=200,
                                      seed=0)
    assert [e.text for e in a.test] == [e.text for e in clean.test]
    diff = torch.tensor([u.label - v.label for u, v in zip(a.test, clean.test, strict=True)])
    assert 0.4 < float(diff.std()) < 0.6
    assert a == sample_regression_episode(t, k=2, n=1, n_test=200, seed=0)


def test_bad_counts_are_refused():
    t = get_task("linear", regression=True)
    for kw in ({"k": 0}, {"n": 0}, {"n_test": 0}):
        with pytest.raises(DataError):
            sample_regression_episode(t, **kw)


def test_classification_only_commands_refuse_regression_tasks_in_one_line():
    with pytest.raises(TaskError, match="'relu' is a regression task"):
        get_task("relu")
    with pytest.raises(TaskError, match="'linear' is a regression task"):
        get_tasks("sst2,linear")


# -- greedy generation with the shift (transformers reference) --------------------------------


def _hand_greedy(model, tokenizer, prompt: str, w: torch.Tensor | None, n_new: int,
                 shifted: int | None = None) -> list[int]:
    """No cache, no batching, no hooks: run the whole sequence each step, take h at the last
    position, add W h by hand (at the first `shifted` steps, all by default), project, argmax."""
    shifted = n_new if shifted is None else shifted
    ids = tokenizer(prompt)["input_ids"]
    out = []
    with torch.no_grad():
        for t in range(n_new):
            h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
            if w is not None and t < shifted:
                h = h + w @ h
            nxt = int(model.lm_head(h).argmax())
            out.append(nxt)
            ids = ids + [nxt]
            if nxt == tokenizer.eos_token_id:
                break
    return out


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


PROMPTS = ["x: [0.5000, -1.2500]\ny:", "x: [2.0000]\ny:", "Review: dull\nSentiment:",
           "x: [-0.1234, 3.0000, 1.0000]\ny:", "News: the team"]


@pytest.fixture(scope="module")
def planted_w(tiny_model):
    g = torch.Generator().manual_seed(3)
    d = tiny_model.config.hidden_size
    return torch.randn(d, d, generator=g) / d ** 0.5


@pytest.mark.parametrize("steps", ["every", "first", 3])
def test_greedy_shift_equals_a_hand_written_loop(tiny_model, tokenizer, planted_w, steps):
    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.extraction.generate import greedy

    cap = Capturer(tiny_model, tokenizer, progress=False, batch_size=2)  # batches pad
    got = greedy(cap, PROMPTS, max_new_tokens=6, mapping=lambda h: h + h @ planted_w.T,
                 steps=steps)
    plain = greedy(cap, PROMPTS, max_new_tokens=6)
    for p, text, base in zip(PROMPTS, got, plain, strict=True):
        n = {"every": 6, "first": 1}.get(steps, steps)
        want = _hand_greedy(tiny_model, tokenizer, p, planted_w, 6, shifted=n)
        assert tokenizer.decode(want, skip_special_tokens=True) == text
        assert tokenizer.decode(_hand_greedy(tiny_model, tokenizer, p, None, 6),
                                skip_special_tokens=True) == base
    assert got != plain  # the planted map changes the answers
    # the hook is gone: plain logits are as before
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    with torch.no_grad():
        again = tiny_model(ids).logits
        assert torch.equal(again, tiny_model(ids).logits)
    assert not tiny_model.lm_head._forward_pre_hooks


def test_greedy_with_a_shared_prefix_equals_full_prompts(tiny_model, tokenizer, planted_w):
    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.extraction.generate import greedy

    prefix = "x: [1.0000]\ny: 2.0000\n\nx: [-3.0000]\ny: -6.0000\n\n"
    cap = Capturer(tiny_model, tokenizer, progress=False, batch_size=3)
    mapping = lambda h: h + h @ planted_w.T  # noqa: E731
    cached = greedy(cap, PROMPTS, prefix=prefix, max_new_tokens=5, mapping=mapping)
    full = [greedy(cap, [prefix + p], max_new_tokens=5, mapping=mapping)[0] for p in PROMPTS]
    assert cached == full
    for p, text in zip(PROMPTS, cached, strict=True):
        hand = _hand_greedy(tiny_model, tokenizer, prefix + p, planted_w, 5)
        assert text == tokenizer.decode(hand, skip_special_tokens=True)


def test_greedy_shared_equals_one_greedy_run_per_map(tiny_model, tokenizer, planted_w):
    """One prefill for several head maps gives each map's own `greedy` answers token for
    token (batches pad), and the states are the Capturer's h."""
    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.extraction.generate import greedy, greedy_shared

    cap = Capturer(tiny_model, tokenizer, progress=False, batch_size=2)
    w2 = planted_w.flip(0)
    maps = {"plain": (None, "every"), "w": (lambda h: h + h @ planted_w.T, "every"),
            "w-first": (lambda h: h + h @ planted_w.T, "first"),
            "w2": (lambda h: h + 2 * h @ w2.T, "every")}
    for n_new in (1, 6):
        got, h = greedy_shared(cap, PROMPTS, maps, max_new_tokens=n_new)
        for name, (mapping, steps) in maps.items():
            want = greedy(cap, PROMPTS, max_new_tokens=n_new, mapping=mapping, steps=steps)
            assert got[name] == want, (name, n_new)
        torch.testing.assert_close(h, cap.hidden(PROMPTS), rtol=1e-5, atol=1e-5)
    assert len({tuple(got[name]) for name in maps}) == len(maps)  # the maps differ
    assert not tiny_model.lm_head._forward_pre_hooks


def test_greedy_states_are_the_captured_states(tiny_model, tokenizer, planted_w):
    """The prefill's last state (before the map) is Capturer.hidden's / .icl's h."""
    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.extraction.generate import greedy, greedy_states

    prefix = "x: [1.0000]\ny: 2.0000\n\nx: [-3.0000]\ny: -6.0000\n\n"
    cap = Capturer(tiny_model, tokenizer, progress=False, batch_size=2)
    mapping = lambda h: h + h @ planted_w.T  # noqa: E731
    texts, h = greedy_states(cap, PROMPTS, max_new_tokens=4, mapping=mapping)
    assert texts == greedy(cap, PROMPTS, max_new_tokens=4, mapping=mapping)
    torch.testing.assert_close(h, cap.hidden(PROMPTS), rtol=1e-5, atol=1e-5)
    texts, h = greedy_states(cap, PROMPTS, prefix=prefix, max_new_tokens=4)
    torch.testing.assert_close(h, cap.icl(prefix, PROMPTS), rtol=1e-5, atol=1e-5)


def test_greedy_refuses_bad_requests(tiny_model, tokenizer):
    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.extraction.generate import GenerateError, greedy

    prompt = "x: [1.0000, 2.0000]\ny:"
    cap = Capturer(tiny_model, tokenizer, progress=False, max_length=len(_tokens(tokenizer,
                                                                                prompt)) + 4)
    with pytest.raises(GenerateError, match="max_new_tokens"):
        greedy(cap, ["x:"], max_new_tokens=0)
    with pytest.raises(GenerateError, match="plus 8 new ones exceeds the model context"):
        greedy(cap, [prompt], max_new_tokens=8)
    with pytest.raises(GenerateError, match="steps"):
        greedy(cap, ["x:"], mapping=lambda h: h, steps="last")


# -- evaluate on regression tasks, end to end -------------------------------------------------


def test_cli_evaluate_regression_end_to_end_against_hand_computation(tmp_path, tokenizer):
    """`evaluate --tasks linear` on a tiny model; run 0's zero-shot, ICL, LTV (every step)
    and LTV (first step) answers are recomputed by hand: plain forwards without cache, a
    direct ridge solve for W, the hand greedy loop, our parser, MSE by hand."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    model = make_llama(len(tokenizer), seed=11, layers=2)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    methods = "zero-shot,icl,ltv,ltv-first,mean,mlp,i2cl"
    r = CliRunner().invoke(main, [
        "evaluate", "--model", str(tmp_path / "m"), "--tasks", "linear", "--methods", methods,
        "--runs", "2", "--k", "3", "--n", "12", "--n-test", "5", "--max-new-tokens", "4",
        "--dtype", "float32", "--out", str(tmp_path / "ev"), "--quiet"])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert not (tmp_path / "ev" / "partial.json").exists()
    assert {(x["method"], x["run"]) for x in doc["records"]} == {
        (m, run) for m in methods.split(",") for run in (0, 1)}
    md = (tmp_path / "ev" / "results.md").read_text()
    assert "**MSE over parsed answers**" in md and "| LTV, first step only |" in md

    task = get_task("linear", regression=True)
    ep = sample_regression_episode(task, k=3, n=12, n_test=5, seed=0)
    prefix = ep.demo_prefix()

    def h_last(prompt: str) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            return model.model(input_ids=ids).last_hidden_state[0, -1]

    h_zs = torch.stack([h_last(task.query(e.text)) for e in ep.queries]).double()
    h_icl = torch.stack([h_last(prefix + task.query(e.text)) for e in ep.queries]).double()
    y = h_icl - h_zs
    d = h_zs.shape[1]
    w = torch.linalg.solve(h_zs.T @ h_zs + 5.0 * torch.eye(d, dtype=torch.float64),
                           h_zs.T @ y).T.float()  # ridge: W (d, d), h ↦ W h

    def by_hand(prompts: list[str], w=None, first_only=False) -> dict[str, Any]:
        n = 1 if first_only else None
        texts = [tokenizer.decode(_hand_greedy(model, tokenizer, p, w, 4, n),
                                  skip_special_tokens=True) for p in prompts]
        answers = [parse_number(t) for t in texts]
        targets = [e.label for e in ep.test]
        ok = [(a - t) ** 2 for a, t in zip(answers, targets, strict=True) if a is not None]
        filled = [((a or 0.0) - t) ** 2 for a, t in zip(answers, targets, strict=True)]
        return {"parse_rate": len(ok) / len(targets), "mse_zero_fill": sum(filled) / len(filled),
                "mse": sum(ok) / len(ok) if ok else math.nan, "texts": texts}

    queries = [task.query(e.text) for e in ep.test]
    got = {x["method"]: x for x in doc["records"] if x["run"] == 0}
    want = {"zero-shot": by_hand(queries), "icl": by_hand([prefix + q for q in queries]),
            "ltv": by_hand(queries, w), "ltv-first": by_hand(queries, w, first_only=True)}
    assert want["ltv"]["texts"] != want["zero-shot"]["texts"]  # the map changes the answers
    for m, hand in want.items():
        assert got[m]["texts"] == hand["texts"], m  # the generated answers, token for token
        assert got[m]["parse_rate"] == pytest.approx(hand["parse_rate"]), m
        assert got[m]["mse_zero_fill"] == pytest.approx(hand["mse_zero_fill"], rel=1e-9), m
        assert (math.isnan(got[m]["mse"]) and math.isnan(hand["mse"])) or \
            got[m]["mse"] == pytest.approx(hand["mse"], rel=1e-9), m
    # the KL analogue by hand: full-vocabulary softmax at the first generated token
    with torch.no_grad():
        lp_icl = torch.log_softmax(model.lm_head(torch.stack(
            [h_last(prefix + q) for q in queries])).double(), -1)
        lp_zs = torch.log_softmax(model.lm_head(torch.stack(
            [h_last(q) for q in queries])).double(), -1)
        h = torch.stack([h_last(q) for q in queries])
        lp_ltv = torch.log_softmax(model.lm_head(h + h @ w.T).double(), -1)

    def kl(lp):
        return float((lp_icl.exp() * (lp_icl - lp)).sum(-1).mean())

    assert got["zero-shot"]["kl_first"] == pytest.approx(kl(lp_zs), rel=1e-4)
    assert got["ltv"]["kl_first"] == pytest.approx(kl(lp_ltv), rel=1e-3)
    assert got["ltv-first"]["kl_first"] == got["ltv"]["kl_first"]
    assert got["icl"]["kl_first"] == 0.0


def test_cli_evaluate_regression_refusals(tmp_path):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    def run(*args: str) -> str:
        r = CliRunner().invoke(main, ["evaluate", "--out", str(tmp_path / "x"), *args])
        assert r.exit_code != 0
        return r.output

    assert "mixes classification and regression" in run("--tasks", "sst2,linear")
    assert "tv cannot run on regression tasks" in run("--tasks", "relu", "--methods", "ltv,tv")
    assert "--max-new-tokens must be at least 1" in run("--tasks", "relu",
                                                        "--max-new-tokens", "0")
    assert not (tmp_path / "x").exists()


def test_cli_extract_regression_writes_the_instance_ltv(tmp_path, tokenizer):
    """`extract --task relu`: the saved vector is the direct ridge solve on the instance's
    queries, records the regression task, and is refused nowhere for lacking label tokens."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main
    from ltv_vllm.core.vector import load_task_vector, model_identity

    model = make_llama(len(tokenizer), seed=12, layers=2)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    out = tmp_path / "relu.pt"
    r = CliRunner().invoke(main, [
        "extract", "--model", str(tmp_path / "m"), "--task", "relu", "--k", "2", "--n", "10",
        "--n-test", "3", "--seed", "4", "--dtype", "float32", "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "KL first" in r.output
    tv = load_task_vector(out)
    assert tv.provenance.task["kind"] == "regression" and tv.label_token_ids == ()
    assert set(tv.provenance.metrics) == {"zero-shot", "icl", "ltv"}
    tv.check_model(model_identity(model))
    tv.check_tokenizer(tokenizer)
    task = get_task("relu", regression=True)
    ep = sample_regression_episode(task, k=2, n=10, n_test=3, seed=4)
    with torch.no_grad():
        def h(p):
            return model.model(input_ids=torch.tensor([tokenizer(p)["input_ids"]])
                               ).last_hidden_state[0, -1].double()
        h_zs = torch.stack([h(task.query(e.text)) for e in ep.queries])
        h_icl = torch.stack([h(ep.demo_prefix() + task.query(e.text)) for e in ep.queries])
    d = h_zs.shape[1]
    w = torch.linalg.solve(h_zs.T @ h_zs + 5.0 * torch.eye(d, dtype=torch.float64),
                           h_zs.T @ (h_icl - h_zs)).T
    torch.testing.assert_close((tv.U @ tv.V.T).double(), w, atol=1e-4, rtol=1e-3)
    bad = CliRunner().invoke(main, ["extract", "--task", "relu", "--method", "tv",
                                    "-o", str(tmp_path / "x.pt")])
    assert bad.exit_code != 0 and "regression task" in bad.output


def test_evaluate_regression_through_vllm_equals_transformers(tmp_path, tokenizer):
    """`evaluate --tasks linear --vllm` on a tiny model in float32: vLLM's greedy answers —
    zero-shot and ICL on the plain engine (prefix caching), LTV and the mean shift fused, LTV
    at the first step only by the request step policy in LTV's engine — are transformers'
    token for token (the shift at exactly the same steps in both engines)."""
    from click.testing import CliRunner

    from conftest import make_vllm_llama
    from ltv_vllm.cli import main

    model = make_vllm_llama(tokenizer, seed=31, tie=False)  # untied: answers that vary
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    r = CliRunner().invoke(main, [
        "evaluate", "--model", str(tmp_path / "m"), "--tasks", "linear", "--methods",
        "zero-shot,icl,ltv,ltv-first,mean", "--runs", "1", "--k", "3", "--n", "12",
        "--n-test", "6", "--max-new-tokens", "5", "--dtype", "float32", "--vllm", "--out",
        str(tmp_path / "ev"), "--quiet"])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "ev" / "results.json").read_text())
    recs = {x["method"]: x for x in doc["records"]}
    assert set(recs) == {"zero-shot", "icl", "ltv", "ltv-first", "mean"}
    assert recs["ltv-first"]["texts"] != recs["ltv"]["texts"]  # the policies differ here
    for m, x in recs.items():
        assert x["vllm"]["texts"] == x["texts"], m
        assert x["vllm"]["identical_text"] == 1.0 and x["vllm"]["agreement"] == 1.0, m
    assert recs["ltv"]["texts"] != recs["zero-shot"]["texts"]
    assert "**Through vLLM**" in (tmp_path / "ev" / "results.md").read_text()


def test_regression_table_keeps_a_degenerate_mse_readable():
    from ltv_vllm.evaluation.regress import REFERENCES, regression_table, summarise_regression

    def rec(method: str, run: int, mse: float) -> dict[str, Any]:
        return {"task": "linear", "run": run, "method": method, "mse": mse, "parse_rate": 1.0,
                "mse_zero_fill": mse, "kl_first": 0.5}

    records = [rec("zero-shot", 0, 1.0), rec("zero-shot", 1, 3.0),
               rec("ltv", 0, 2.0e20), rec("ltv", 1, 0.0)]
    cfg = {"model": "m", "dtype": "float32", "k": 30, "n": 8, "lam": 5.0, "n_test": 4,
           "runs": 2, "max_new_tokens": 12, "tasks": ["linear"], "methods": ["zero-shot", "ltv"]}
    doc = {"config": cfg, "summary": summarise_regression(records, ["linear"], cfg["methods"]),
           "references": {"linear": {key: (1.0, 0.0) for key in REFERENCES}}}
    rows = regression_table(doc).splitlines()
    mse_rows = rows[rows.index("**MSE over parsed answers**, echoes included (lower is "
                               "better)") + 4:][:2]
    # zero-shot: mean 2, std (sample) sqrt(2); ltv: mean 1e20, std 2e20/sqrt(2)
    assert mse_rows[0] == "| Zero-shot | 2.00 ± 1.41 |"
    assert mse_rows[1] == "| LTV | 1.00e+20 ± 1.41e+20 |"


def test_table_says_how_few_instances_a_mean_rests_on():
    """An instance with no parsed answer has no MSE: the mean says it rests on fewer."""
    from ltv_vllm.evaluation.regress import REFERENCES, regression_table, summarise_regression

    def rec(run: int, mse: float, parsed: int) -> dict[str, Any]:
        return {"task": "linear", "run": run, "method": "ltv", "mse": mse, "mse_own": mse,
                "parse_rate": parsed / 4, "mse_zero_fill": 1.0, "kl_first": 0.5, "n": 4,
                "parsed": parsed, "echoes": 0, "echoes_x": 0, "echoes_demo": 0,
                "echo_rate": 0.0, "own_rate": parsed / 4,
                "top_answer": None, "top_count": 1 if parsed else 0, "zeros": 0}

    records = [rec(0, 2.0, 1), rec(1, math.nan, 0), rec(2, 4.0, 2)]
    cfg = {"model": "m", "dtype": "float32", "k": 30, "n": 8, "lam": 5.0, "n_test": 4,
           "runs": 3, "max_new_tokens": 12, "tasks": ["linear"], "methods": ["ltv"]}
    summ = summarise_regression(records, ["linear"], cfg["methods"])
    assert summ["linear"]["ltv"]["mse"] == 3.0 and summ["linear"]["ltv"]["mse_instances"] == 2
    doc = {"config": cfg, "summary": summ,
           "references": {"linear": {key: (1.0, 0.0) for key in REFERENCES}}}
    text = regression_table(doc)
    assert "| LTV | 3.00 ± 1.41 (3 own of 12, on 2 of 3 instances) |" in text
    assert "| LTV | 3 / 0 / 0 / 3 of 12 |" in text


@pytest.mark.parametrize("name,echoes", [("regression_smollm2-135m", (426, 417)),
                                         ("regression_qwen2.5-coder-1.5b", (427, 430))])
def test_committed_regression_reports_recompute_from_their_answers(name, echoes):
    """Every committed regression score recomputes exactly from the answers stored beside
    it (instances redrawn from their seeds), and the echoes agree with a count by string:
    the answer's first number spelled exactly as one of its query's printed coordinates."""
    import re
    from pathlib import Path

    from ltv_vllm.evaluation.regress import regression_table, rescore
    from ltv_vllm.tasks.data import sample_regression_episode

    path = Path(__file__).parent.parent / "benchmarks" / "results" / name / "results.json"
    doc = json.loads(path.read_text())
    new = rescore(doc)
    for old, r in zip(doc["records"], new["records"], strict=True):
        for key in ("mse", "parse_rate", "mse_zero_fill", "n"):
            assert (old[key] == r[key]) or (math.isnan(old[key]) and math.isnan(r[key])), key
    cfg, by_string = doc["config"], {}
    for t in cfg["tasks"]:
        task = RegressionTask.from_dict(cfg["task_specs"][t])
        count = 0
        for r in doc["records"]:
            if r["task"] != t or r["method"] != "zero-shot":
                continue
            test = sample_regression_episode(task, k=cfg["k"], n=1, n_test=cfg["n_test"],
                                             seed=r["seed"]).test
            for text, e in zip(r["texts"], test, strict=True):
                line = next((s.strip() for s in text.split("\n") if s.strip()), "")
                first = re.search(r"[-+]?\d+\.?\d*", line)
                printed = re.findall(r"[-+]?\d+\.\d+", task.query(e.text).split("\n")[-2])
                count += bool(first) and not line.startswith("x:") and first.group() in printed
        by_string[t] = count
    assert tuple(by_string.values()) == echoes
    assert tuple(new["summary"][t]["zero-shot"]["echoes_x_total"] for t in cfg["tasks"]) == echoes
    if "smollm2" in name:  # every-step LTV answered on 2 of 5 linear instances: the table says
        assert "(4 own of 500, on 2 of 5 instances)" in regression_table(new)
    md = (path.parent / "results.md").read_text()
    assert regression_table(new) in md  # the committed report is the rescored one


def test_cli_report_rewrites_a_committed_report_and_refuses_what_is_not_one(tmp_path):
    """`ltv-vllm report DIR` on a copy of a committed regression result writes the same
    report (nothing runs but the scoring); a directory without an evaluation is one line."""
    import shutil
    from pathlib import Path

    from click.testing import CliRunner

    from ltv_vllm.cli import main

    src = Path(__file__).parent.parent / "benchmarks" / "results" / "regression_smollm2-135m"
    shutil.copytree(src, tmp_path / "reg")
    (tmp_path / "reg" / "results.md").unlink()
    r = CliRunner().invoke(main, ["report", str(tmp_path / "reg")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "reg" / "results.md").read_text() == (src / "results.md").read_text()
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(main, ["report", str(tmp_path / "empty")])
    assert r.exit_code == 1 and "does not exist" in r.output
    assert len(r.output.strip().splitlines()) == 1
    (tmp_path / "empty" / "results.json").write_text('{"config": 3}')
    r = CliRunner().invoke(main, ["report", str(tmp_path / "empty")])
    assert r.exit_code == 1 and "is not an evaluation's result" in r.output
