# ruff: noqa: F811 - pytest fixtures imported from test_extract are parameters here
"""Teachers (`core.teacher`, `bench teachers`): each target against a hand computation.

The calibrations from their formulas (batch: minus the mean label log-probability over the
queries; contextual: divided by the content-free inputs' mean probability), the gold blend
from its weights, the state shift checked to give the target distribution exactly and to be
the minimum-norm one; the bench's many-shot states against transformers' whole-prompt forward,
its stored states rescored to the same numbers, and its default teacher's vector against the
pipeline's `extract` on the same episode."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest
import torch
from test_extract import WORDS, model_dir  # noqa: F401 - the tiny model fixture

from conftest import write_toy_task
from ltv_vllm.core.teacher import (
    TeacherOptions,
    calibration_offset,
    label_logprobs,
    shift_to,
    target_logprobs,
    teacher_states,
)
from ltv_vllm.errors import ArgumentError


def final_state(lm, prompt: str) -> torch.Tensor:
    """The final hidden state of the prompt's last token: transformers' own forward on the
    whole prompt (no shared cache, no batching)."""
    enc = lm.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        return lm.model(**enc, output_hidden_states=True).hidden_states[-1][0, -1]


def _head(K: int = 4, d: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(K, d, generator=g), torch.randn(K, generator=g),
            torch.randn(20, d, generator=g) * 2)


def test_shift_reaches_the_target_distribution_with_the_least_change():
    w, b, h = _head()
    target = torch.log_softmax(torch.randn(20, 4, generator=torch.Generator().manual_seed(1)), -1)
    out = shift_to(h, w, b, target)
    torch.testing.assert_close(label_logprobs(out, w, b), target.double(), atol=1e-5, rtol=0)
    # minimum norm over Δh and the free constant: no c does better than ours (pinv by hand)
    delta = target.double() - label_logprobs(h, w, b)
    ours = (out.double() - h.double()).norm(dim=1)
    pinv = torch.linalg.pinv(w.double())
    for c in torch.linspace(-5, 5, 101, dtype=torch.float64):
        other = (pinv @ (delta + c).T).T.norm(dim=1)
        assert (ours <= other + 1e-6).all()
    # the change lies in the label rows' span: orthogonal directions are the prompt's own
    null = torch.linalg.svd(w.double(), full_matrices=True).Vh[4:]  # (d − K, d)
    torch.testing.assert_close((out.double() - h.double()) @ null.T,
                               torch.zeros(20, 8, dtype=torch.float64), atol=1e-6, rtol=0)


def test_calibrations_and_blend_from_their_formulas():
    w, b, h = _head(seed=2)
    logp = label_logprobs(h, w, b)
    p = logp.exp()
    # batch calibration: log p − mean_j log p(·|x_j), renormalised
    opts = TeacherOptions(calibration="batch")
    off = calibration_offset(opts, logp)
    hand = torch.log_softmax(logp - logp.mean(0), -1)
    torch.testing.assert_close(target_logprobs(logp, off, opts), hand)
    # contextual: p / mean_cf p_cf, renormalised (Zhao et al.'s diagonal W = diag(p_cf)⁻¹)
    cf = torch.log_softmax(torch.randn(3, 4, generator=torch.Generator().manual_seed(3)), -1)
    opts = TeacherOptions(calibration="contextual")
    off = calibration_offset(opts, logp, cf.double())
    q = p / cf.exp().double().mean(0)
    torch.testing.assert_close(target_logprobs(logp, off, opts).exp(), q / q.sum(1, keepdim=True))
    # gold: (1 − w) p + w onehot on the first ⌈share·N⌉ rows, the rest untouched
    gold = torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(4))
    opts = TeacherOptions(gold_weight=0.3, gold_share=0.5)
    got = target_logprobs(logp, calibration_offset(opts, logp), opts, gold).exp()
    hand = p.clone()
    hand[:10] = 0.7 * p[:10] + 0.3 * torch.nn.functional.one_hot(gold[:10], 4).double()
    torch.testing.assert_close(got, hand)
    # and the states a vector is fitted to carry exactly that distribution
    st = teacher_states(h, w, b, opts, calibration_offset(opts, logp), gold)
    torch.testing.assert_close(label_logprobs(st, w, b).exp(), hand, atol=1e-5, rtol=0)


def test_default_teacher_is_the_prompt_itself_and_bad_options_are_refused():
    w, b, h = _head()
    opts = TeacherOptions()
    assert opts.is_default and teacher_states(h, w, b, opts, torch.zeros(4)) is h
    for kw, msg in (({"calibration": "platt"}, "--teacher must be one of"),
                    ({"gold_weight": 1.0}, "--gold-weight must be in"),
                    ({"gold_weight": float("nan")}, "--gold-weight must be in"),
                    ({"gold_share": 0.0}, "--gold-share must be in")):
        with pytest.raises(ArgumentError, match=msg):
            TeacherOptions(**kw)


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    return write_toy_task(tmp_path_factory.mktemp("task"), WORDS)


def test_bench_teachers_states_rescore_and_the_default_is_extracts(tmp_path, model_dir,
                                                                   task_file):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from ltv_vllm.cli import main
    from ltv_vllm.core.metrics import accuracy
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, extract, plan_episode
    from ltv_vllm.tasks.data import load_dataset, many_shot_demos
    from ltv_vllm.tasks.specs import get_task

    out = tmp_path / "teachers"
    args = ["bench", "teachers", "--model", str(model_dir), "--tasks", str(task_file), "--k",
            "6", "--many-k", "12", "--n", "12", "--n-test", "8", "--runs", "1",
            "--batch-size", "4", "--dtype", "float32", "--variants",
            "one/icl,many/batch,sets/contextual/0.5", "--out", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    task = get_task(str(task_file))
    st = load_file(str(out / "states" / f"{task.name}_seed0.safetensors"))
    lm = load_model(str(model_dir), dtype="float32")
    ep = plan_episode(task, ExtractOptions(k=6, n=12, n_test=8, seed=0, n_val=0, demo_sets=2))
    many = many_shot_demos(load_dataset(task), ep, 12)
    assert len(many) == 12 and not set(many) & set(ep.queries)

    def h(prompt: str) -> torch.Tensor:
        return final_state(lm, prompt)

    for i in (0, 5):  # the many-shot teacher's train and test states
        torch.testing.assert_close(st["h_icl"][-1][i],
                                   h(task.demos_text(many) + task.query(ep.queries[i].text)),
                                   atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st["h_icl_test"][-1][2],
                               h(task.demos_text(many) + task.query(ep.test[2].text)),
                               atol=1e-4, rtol=1e-4)
    # the default teacher (one/icl): the pipeline's own vector on this episode
    res = extract(lm, task, "ltv", ExtractOptions(k=6, n=12, n_test=8, seed=0, n_val=0,
                                                  batch_size=4, progress=False), episode=ep)
    row = doc["rows"][0]["scores"]
    assert row["one/icl"]["teacher_accuracy"] == pytest.approx(res.metrics["icl"]["accuracy"])
    assert accuracy(res.label_logits["ltv"], torch.tensor([e.label for e in ep.test])) == \
        pytest.approx(row["one/icl"]["accuracy"])
    # many/batch's teacher accuracy from the formula on the stored states
    w_c, b_c = st["w_c"].double(), st["b_c"].double()
    lp = torch.log_softmax(st["h_icl"][-1].double() @ w_c.T + b_c, -1)
    lp_test = torch.log_softmax(st["h_icl_test"][-1].double() @ w_c.T + b_c, -1)
    hand = accuracy(lp_test - lp.mean(0), st["labels_test"])
    assert row["many/batch"]["teacher_accuracy"] == pytest.approx(hand)
    # --rescore from the stored states alone: the same numbers, and new variants scored
    r = CliRunner().invoke(main, [*args[:-4], "--variants",
                                  "one/icl,many/batch,sets/contextual/0.5,many/icl",
                                  "--rescore", "--out", str(out)])
    assert r.exit_code == 0, r.output
    again_doc = json.loads((out / "results.json").read_text())
    again = again_doc["rows"][0]["scores"]
    for v in ("one/icl", "many/batch", "sets/contextual/0.5"):
        assert again[v] == pytest.approx(row[v])
    assert "many/icl" in again and "| many/icl |" in (out / "results.md").read_text()
    r = CliRunner().invoke(main, [*args[:-2], "--rescore", "--seed", "1", "--out", str(out)])
    assert r.exit_code != 0 and "no stored states" in r.output
    # --merge: a run of seed 1 joins seed 0's episodes; each task's figure is their mean
    out1 = tmp_path / "seed1"
    r = CliRunner().invoke(main, [*args[:-2], "--seed", "1", "--merge", str(out),
                                  "--out", str(out1)])
    assert r.exit_code == 0, r.output
    both = json.loads((out1 / "results.json").read_text())
    assert [x["seed"] for x in both["rows"]] == [0, 1] and both["runs"] == 2
    assert both["rows"][0]["scores"]["one/icl"] == pytest.approx(again["one/icl"])
    want = statistics.fmean(x["scores"]["many/batch"]["accuracy"] for x in both["rows"])
    assert both["summary"]["per_task"][task.name]["many/batch"]["accuracy"] == \
        pytest.approx(want)
    assert "merged with the episodes of" in (out1 / "results.md").read_text()
    # the recorded command is one a shell runs again: `--merge PATH`, and none without
    assert f"--merge {out}" in both["command"] and "--merge" not in again_doc["command"]
    # the states are stored per seed: seed 1's beside seed 0's, `--runs 2` rescores both
    # without a capture, to the merged figures
    for f in (out1 / "states").iterdir():
        shutil.copy(f, out / "states" / f.name)
    runs2 = [a if args[i - 1] != "--runs" else "2" for i, a in enumerate(args)]
    r = CliRunner().invoke(main, [*runs2[:-2], "--rescore", "--out", str(out)])
    assert r.exit_code == 0, r.output
    grown = json.loads((out / "results.json").read_text())
    for m, scores in both["summary"]["per_task"][task.name].items():
        assert grown["summary"]["per_task"][task.name][m] == pytest.approx(scores), m
    # refused before any model loads: the same seed twice, another configuration
    for extra, why in ((["--seed", "1", "--merge", str(out1)], "is in this run or another"),
                       (["--merge", str(out1), "--n-test", "9"], "another configuration")):
        r = CliRunner().invoke(main, [*args[:-2], *extra, "--out", str(tmp_path / "x")])
        assert r.exit_code != 0 and why in r.output, r.output


def test_bench_teachers_n_dev_scores_dev_and_chooses_on_it_alone(tmp_path, model_dir,
                                                                  task_file):
    """`--n-dev`: a dev split disjoint from everything else, every variant's dev accuracy
    the fit applied to transformers' own dev states, and a chosen-on-dev row that no test
    label moves (a planted leak, choosing by the test rows, would move it)."""
    from click.testing import CliRunner
    from safetensors.torch import load_file, save_file

    from ltv_vllm.cli import main
    from ltv_vllm.core.metrics import accuracy
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, extract, plan_episode
    from ltv_vllm.tasks.data import load_dataset, many_shot_demos
    from ltv_vllm.tasks.specs import get_task

    out = tmp_path / "teachers"
    variants = "one/icl,many/batch,sets/contextual/0.5,many/icl"
    args = ["bench", "teachers", "--model", str(model_dir), "--tasks", str(task_file), "--k",
            "6", "--many-k", "12", "--n", "12", "--n-test", "8", "--n-dev", "10", "--runs",
            "1", "--batch-size", "4", "--dtype", "float32", "--variants", variants,
            "--out", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    task = get_task(str(task_file))
    ep = plan_episode(task, ExtractOptions(k=6, n=12, n_test=8, seed=0, n_val=10, demo_sets=2))
    many = many_shot_demos(load_dataset(task), ep, 12)
    dev_texts = {e.text for e in ep.val}
    assert len(ep.val) == 10 and not dev_texts & {e.text for e in (*ep.queries, *ep.test,
                                                                  *many, *ep.demos,
                                                                  *ep.extra_demos[0])}
    assert doc["n_dev"] == 10 and "--n-dev 10" in doc["command"]
    assert doc["rows"][0]["splits"] == {"train": 12, "dev": 10, "test": 8, "test_seed": 0}
    st = load_file(str(out / "states" / f"{task.name}_seed0.safetensors"))
    lm = load_model(str(model_dir), dtype="float32")
    torch.testing.assert_close(st["h_icl_dev"][0][3], final_state(
        lm, ep.demo_prefixes()[0] + task.query(ep.val[3].text)), atol=1e-4, rtol=1e-4)
    h_zs_dev = torch.stack([final_state(lm, task.zero_shot(e.text)) for e in ep.val])
    torch.testing.assert_close(st["h_zs_dev"], h_zs_dev, atol=1e-4, rtol=1e-4)
    # one/icl's dev accuracy: the pipeline's own vector applied to those dev states
    res = extract(lm, task, "ltv", ExtractOptions(k=6, n=12, n_test=8, seed=0, n_val=0,
                                                  batch_size=4, progress=False),
                  episode=plan_episode(task, ExtractOptions(k=6, n=12, n_test=8, seed=0,
                                                            n_val=10, demo_sets=1)))
    w_c, b_c = st["w_c"], st["b_c"]
    shifted = res.artifact.shift_hidden(h_zs_dev)
    scores = doc["rows"][0]["scores"]
    assert scores["one/icl"]["dev_accuracy"] == pytest.approx(
        accuracy(shifted @ w_c.T + b_c, torch.tensor([e.label for e in ep.val])))
    # the chosen row: per episode the best dev accuracy (ties: the first listed), its test
    want = max(variants.split(","), key=lambda v: scores[v]["dev_accuracy"])
    dev = doc["summary"]["chosen_on_dev"]
    assert dev["per_task"][task.name]["picks"] == [want]
    assert dev["per_task"][task.name]["accuracy"] == pytest.approx(scores[want]["accuracy"])
    assert "variant chosen on dev" in (out / "results.md").read_text()
    # test labels scrambled in the stored states: every test score moves, the pick does not
    flipped = dict(st)
    flipped["labels_test"] = 1 - st["labels_test"]
    save_file(flipped, str(out / "states" / f"{task.name}_seed0.safetensors"))
    r = CliRunner().invoke(main, [*args[:-2], "--rescore", "--out", str(out)])
    assert r.exit_code == 0, r.output
    again = json.loads((out / "results.json").read_text())
    assert again["summary"]["chosen_on_dev"]["per_task"][task.name]["picks"] == [want]
    for v in variants.split(","):
        assert again["rows"][0]["scores"][v]["dev_accuracy"] == scores[v]["dev_accuracy"]
        assert again["rows"][0]["scores"][v]["accuracy"] == pytest.approx(
            1 - scores[v]["accuracy"])
    # another dev size is another configuration: refused before any model loads
    r = CliRunner().invoke(main, [*args[:-2], "--seed", "1", "--n-dev", "12", "--merge",
                                  str(out), "--out", str(tmp_path / "x")])
    assert r.exit_code != 0 and "another configuration" in r.output and "n_dev" in r.output
    r = CliRunner().invoke(main, [*args[:-2], "--n-dev", "-1", "--out", str(tmp_path / "y")])
    assert r.exit_code != 0 and "--n-dev" in r.output


@pytest.mark.parametrize("teacher", ["batch", "contextual", "gold", "default"])
def test_extract_teacher_vector_is_the_ridge_on_the_hand_made_target(tmp_path, model_dir,
                                                                     task_file, teacher):
    """`extract --teacher batch|contextual` and `--gold-weight`: the file's map is the ridge
    solve on targets made by hand: transformers' whole-prompt forwards, the calibrated (or
    blended) distribution from its formula, and the least state change found by a scalar
    search over the free constant (a ternary search: the norm is convex in it), not by the
    closed form the code uses. `default` (no teacher flag, the task's labelled queries): the
    prompt blended with every query's gold label at 0.8."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main
    from ltv_vllm.core.teacher import CONTENT_FREE
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.extraction.capture import label_head
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
    from ltv_vllm.tasks.specs import get_task, label_token_ids

    out = tmp_path / "toy.pt"
    flags = {"batch": ["--teacher", "batch", "--gold-weight", "0"],
             "contextual": ["--teacher", "contextual", "--gold-weight", "0"],
             "gold": ["--gold-weight", "0.4", "--gold-share", "0.5"], "default": []}[teacher]
    r = CliRunner().invoke(main, ["extract", "--model", str(model_dir), "--task",
                                  str(task_file), "--k", "6", "--n", "12", "--n-test", "8",
                                  "--seed", "3", "--batch-size", "4", "--dtype", "float32",
                                  "--quiet", *flags, "-o", str(out)])
    assert r.exit_code == 0, r.output
    tv = load_task_vector(out)
    rec = tv.meta["teacher"]
    assert rec["calibration"] == (teacher if teacher in ("batch", "contextual") else "icl")
    assert rec["gold_weight"] == {"gold": 0.4, "default": 0.8}.get(teacher, 0.0)
    assert rec["gold_share"] == (0.5 if teacher == "gold" else 1.0)
    assert ("teacher icl+gold(w=0.8, share=1)" in r.output) == (teacher == "default")
    task = get_task(str(task_file))
    lm = load_model(str(model_dir), dtype="float32")
    ep = plan_episode(task, ExtractOptions(k=6, n=12, n_test=8, seed=3))
    w, b = (x.double() for x in label_head(lm.model, label_token_ids(task, lm.tokenizer)))

    def h(prompt: str) -> torch.Tensor:
        return final_state(lm, prompt).double()

    prefix = task.demos_text(ep.demos)
    H = torch.stack([h(task.query(e.text)) for e in ep.queries])  # (N, d)
    icl = torch.stack([h(prefix + task.query(e.text)) for e in ep.queries])
    p = torch.softmax(icl @ w.T + b, -1)
    if teacher == "batch":
        q = p / torch.exp(torch.log(p).mean(0))
    elif teacher == "contextual":
        p_cf = torch.stack([torch.softmax(h(prefix + task.query(t)) @ w.T + b, -1)
                            for t in CONTENT_FREE]).mean(0)
        q = p / p_cf
    else:
        q = p.clone()
        gold = torch.nn.functional.one_hot(torch.tensor([e.label for e in ep.queries]),
                                           task.num_classes).double()
        w_gold, rows = (0.4, 6) if teacher == "gold" else (0.8, len(ep.queries))
        q[:rows] = (1 - w_gold) * p[:rows] + w_gold * gold[:rows]
    q = q / q.sum(1, keepdim=True)
    delta = torch.log(q) - torch.log(p)
    pinv = torch.linalg.pinv(w)
    target = []
    for j in range(len(ep.queries)):
        lo, hi = -50.0, 50.0
        for _ in range(200):
            a, z = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            if (pinv @ (delta[j] + a)).norm() < (pinv @ (delta[j] + z)).norm():
                hi = z
            else:
                lo = a
        c = (lo + hi) / 2
        target.append(icl[j] + pinv @ (delta[j] + c))
    Y = (torch.stack(target) - H).T
    Ht = H.T
    W = Y @ Ht.T @ torch.linalg.inv(Ht @ Ht.T + 5.0 * torch.eye(Ht.shape[0], dtype=Ht.dtype))
    got = tv.U.double() @ tv.V.double().T
    assert (got - W).abs().max() < 1e-4 * max(1.0, W.abs().max())
    # and it is not the plain prompt's fit
    plain = (icl - H).T @ Ht.T @ torch.linalg.inv(Ht @ Ht.T + 5.0 * torch.eye(Ht.shape[0],
                                                                          dtype=Ht.dtype))
    assert (got - plain).abs().max() > 1e-3


def test_extract_teacher_refusals(tmp_path, model_dir, task_file):
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    base = ["extract", "--model", str(model_dir), "--task", str(task_file), "--k", "6",
            "--n", "12", "--n-test", "8", "--quiet"]
    for extra, msg in ((["--gold-weight", "1"], "--gold-weight must be in [0, 1)"),
                       (["--gold-share", "0"], "--gold-share must be in (0, 1]"),
                       (["--teacher", "batch", "--method", "fv"], "shape the states a map")):
        out = tmp_path / ("x.safetensors" if "fv" in extra else "x.pt")
        r = CliRunner().invoke(main, [*base, *extra, "-o", str(out)])
        assert r.exit_code != 0 and msg in r.output, r.output
        assert "\n" not in r.output.strip() and not out.exists()


def test_a_prompt_over_the_context_is_refused_before_any_pass(model_dir, task_file):
    """A many-shot k is bounded by the context: the prompt's tokens counted with the
    tokenizer, refused in one line naming them; the prefix's count returned (recorded)."""
    from ltv_vllm.models.loading import load_tokenizer
    from ltv_vllm.pipeline.extract import ExtractOptions, check_context, plan_episode
    from ltv_vllm.tasks.specs import get_task

    task = get_task(str(task_file))
    tok = load_tokenizer(str(model_dir))
    ep = plan_episode(task, ExtractOptions(k=6, n=12, n_test=8, seed=3))
    prefix = len(tok(task.demos_text(ep.demos))["input_ids"])
    assert check_context(tok, ep, True, 2048) == prefix
    longest = max((e.text for e in (*ep.queries, *ep.test)), key=len)
    total = len(tok(task.demos_text(ep.demos) + task.query(longest))["input_ids"])
    assert check_context(tok, ep, True, total) == prefix
    with pytest.raises(ArgumentError, match=f"takes {total} tokens, over the model's context "
                                            f"of {total - 1}") as e:
        check_context(tok, ep, True, total - 1)
    assert "\n" not in str(e.value)


def test_evaluate_teacher_fits_the_states_methods_and_keeps_the_prompt_as_icl(
        tmp_path, model_dir, task_file):
    """`evaluate --teacher batch`: the ICL row is still the prompt (transformers' forward),
    a Teacher row scores the batch-calibrated prompt (its formula), and LTV is the vector
    `extract --teacher batch` fits on the same episode, scored against the prompt by hand."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.extraction.capture import label_head
    from ltv_vllm.models.loading import load_model
    from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
    from ltv_vllm.tasks.specs import get_task, label_token_ids

    common = ["--model", str(model_dir), "--k", "6", "--n", "12", "--n-test", "8", "--seed",
              "3", "--batch-size", "4", "--dtype", "float32", "--quiet", "--teacher", "batch",
              "--gold-weight", "0"]
    out, vec = tmp_path / "eval", tmp_path / "toy.pt"
    r = CliRunner().invoke(main, ["evaluate", *common, "--tasks", str(task_file), "--methods",
                                  "zero-shot,icl,ltv", "--runs", "1", "--cost-samples", "0",
                                  "--out",
                                  str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["extract", *common, "--task", str(task_file), "-o", str(vec)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["teacher"]["calibration"] == "batch"
    recs = {x["method"]: x for x in doc["records"]}
    assert set(recs) == {"zero-shot", "icl", "teacher", "ltv"}

    task = get_task(str(task_file))
    lm = load_model(str(model_dir), dtype="float32")
    ep = plan_episode(task, ExtractOptions(k=6, n=12, n_test=8, seed=3))
    w, b = (x.double() for x in label_head(lm.model, label_token_ids(task, lm.tokenizer)))

    def h(prompt: str) -> torch.Tensor:
        return final_state(lm, prompt).double()

    prefix = task.demos_text(ep.demos)
    labels = torch.tensor([e.label for e in ep.test])
    lp_train = torch.stack([torch.log_softmax(h(prefix + task.query(e.text)) @ w.T + b, -1)
                            for e in ep.queries])
    lp_icl = torch.stack([torch.log_softmax(h(prefix + task.query(e.text)) @ w.T + b, -1)
                          for e in ep.test])

    def acc(z: torch.Tensor) -> float:
        return (z.argmax(-1) == labels).double().mean().item()

    assert recs["icl"]["accuracy"] == pytest.approx(acc(lp_icl))
    lp_teacher = torch.log_softmax(lp_icl - lp_train.mean(0), -1)
    assert recs["teacher"]["accuracy"] == pytest.approx(acc(lp_teacher))
    kl_teacher = (lp_icl.exp() * (lp_icl - lp_teacher)).sum(-1).mean().item()
    assert kl_teacher > 1e-3 and recs["teacher"]["d_ntp"] == pytest.approx(kl_teacher, rel=1e-3)
    tv = load_task_vector(vec)
    h0 = torch.stack([h(task.query(e.text)) for e in ep.test])
    lp_tv = torch.log_softmax((h0 + h0 @ (tv.U.double() @ tv.V.double().T).T) @ w.T + b, -1)
    kl = (lp_icl.exp() * (lp_icl - lp_tv)).sum(-1).mean().item()
    assert recs["ltv"]["accuracy"] == pytest.approx(acc(lp_tv))
    assert recs["ltv"]["d_ntp"] == pytest.approx(kl, rel=1e-3, abs=1e-5)
    # the teacher needs a method fitted on states; a transfer or regression has none
    r = CliRunner().invoke(main, ["evaluate", *common, "--tasks", str(task_file), "--methods",
                                  "tv", "--runs", "1", "--out", str(tmp_path / "e2")])
    assert r.exit_code != 0 and "--teacher shapes what the methods fitted on states" in r.output
    assert not (tmp_path / "e2" / "results.json").exists()


@pytest.mark.parametrize("flags", [["--teacher", "contextual"],
                                   ["--teacher", "batch", "--gold-weight", "0.5"]])
def test_bench_scaling_teacher_rows_are_evaluate_s(tmp_path, model_dir, task_file, flags):
    """`bench scaling --teacher`: at its largest N, both fits and the teacher's own row equal
    `evaluate --teacher` on the same episode (whose vector and teacher row are checked by
    hand above), the ICL rows stay the prompt's; the config records the teacher."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    common = ["--model", str(model_dir), "--k", "6", "--n-test", "8", "--batch-size", "4",
              "--dtype", "float32", "--lam", "5", *flags]
    out, ev = tmp_path / "scaling", tmp_path / "eval"
    r = CliRunner().invoke(main, ["bench", "scaling", *common, "--tasks", str(task_file),
                                  "--ns", "12,6", "--demo-sets", "2", "--runs", "1", "--out",
                                  str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["evaluate", *common, "--tasks", str(task_file), "--n", "12",
                                  "--demo-sets", "2", "--n-val", "0", "--runs", "1",
                                  "--cost-samples", "0", "--quiet", "--methods",
                                  "zero-shot,icl,ltv,ltv-multi,icl-ensemble", "--out", str(ev)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["teacher"]["calibration"] == flags[1]
    rows = {row["n"]: row["scores"] for row in doc["rows"]}
    recs = {x["method"]: x for x in json.loads((ev / "results.json").read_text())["records"]}
    for m in ("icl", "teacher", "ltv", "ltv-multi"):
        assert rows[12][m]["accuracy"] == pytest.approx(recs[m]["accuracy"]), m
        assert rows[12][m]["d_ntp"] == pytest.approx(recs[m]["d_ntp"], rel=1e-4, abs=1e-7), m
    assert "Teacher " in (out / "results.md").read_text()


def test_evaluate_refuses_a_prompt_over_the_context_before_the_model_loads(
        tmp_path, model_dir, task_file, monkeypatch):
    """A many-shot --k in `evaluate`: every run's prompt counted against the model's
    context, refused in one line before anything loads."""
    import shutil

    from click.testing import CliRunner

    import ltv_vllm.models.loading as loading
    from ltv_vllm.cli import main

    small = tmp_path / "small"
    shutil.copytree(model_dir, small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 40}))

    def no_load(*_args, **_kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    r = CliRunner().invoke(main, ["evaluate", "--model", str(small), "--tasks", str(task_file),
                                  "--k", "6", "--n", "12", "--n-test", "8", "--runs", "2",
                                  "--methods", "zero-shot,icl,ltv", "--out",
                                  str(tmp_path / "e")])
    assert r.exit_code != 0 and "over the model's context of 40" in r.output, r.output
    assert "\n" not in r.output.strip() and not (tmp_path / "e" / "results.json").exists()
