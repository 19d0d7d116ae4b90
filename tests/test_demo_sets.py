# ruff: noqa: F811 - pytest fixtures imported from test_extract are parameters here
"""Multi-prompt fitting (`ExtractOptions(demo_sets=M)`): the train target h_icl is the mean
over M demonstration sets. Checked against a hand computation on a tiny random model: each
set's ICL states from transformers' own forward on the whole prompt (no shared cache),
averaged, and the ridge solved directly (W = Y Hᵀ (H Hᵀ + λI)⁻¹); one set is today's vector
bit for bit; the sets are balanced, disjoint from the queries and the validation examples."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_extract import WORDS, model_dir  # noqa: F401 - the tiny model fixture

from conftest import write_toy_task
from ltv_vllm.core.teacher import TeacherOptions
from ltv_vllm.errors import ArgumentError
from ltv_vllm.models.loading import load_model
from ltv_vllm.pipeline.extract import ExtractOptions, extract, plan_episode
from ltv_vllm.tasks.data import load_dataset, sample_episode
from ltv_vllm.tasks.specs import get_task


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    return write_toy_task(tmp_path_factory.mktemp("task"), WORDS)


@pytest.fixture(scope="module")
def task(task_file):
    return get_task(str(task_file))


def test_the_sets_are_balanced_and_one_set_is_todays_episode(task):
    ds = load_dataset(task)
    one = sample_episode(ds, k=6, n=24, n_test=20, seed=3, n_val=4)
    three = sample_episode(ds, k=6, n=24, n_test=20, seed=3, n_val=4, demo_sets=3)
    assert sample_episode(ds, k=6, n=24, n_test=20, seed=3, n_val=4, demo_sets=1) == one
    assert one.extra_demos == () and one.demo_sets == (one.demos,)
    # the first set, the queries, test and validation: as with one set
    assert (three.demos, three.queries, three.test, three.val) == (one.demos, one.queries,
                                                                   one.test, one.val)
    assert len(three.demo_sets) == 3 and three.fingerprint() != one.fingerprint()
    held = {id(e) for e in (*three.queries, *three.val)}
    K = task.num_classes
    for s in three.extra_demos:
        assert Counter(e.label for e in s) == Counter({c: 6 // K for c in range(K)})
        assert not held & {id(e) for e in s}
        assert s != three.demos
    assert three.extra_demos[0] != three.extra_demos[1]
    # the fingerprint of one set is what it was before sets existed
    import hashlib
    import json

    old = json.dumps([[[e.text, e.label] for e in p] for p in (one.demos, one.queries,
                                                                one.test)], ensure_ascii=False)
    assert one.fingerprint() == hashlib.sha256(old.encode()).hexdigest()[:16]


def test_multi_prompt_target_is_the_mean_of_each_sets_states(model_dir, task):
    lm = load_model(str(model_dir), dtype="float32")
    opts = dict(k=6, n=12, lam=5.0, seed=3, n_test=8, batch_size=4, progress=False)
    base = extract(lm, task, "ltv", ExtractOptions(**opts)).artifact
    same = extract(lm, task, "ltv", ExtractOptions(**opts, demo_sets=1)).artifact
    assert torch.equal(base.U, same.U) and torch.equal(base.V, same.V)  # bit for bit
    assert "demo_sets" not in base.meta

    res = extract(lm, task, "ltv", ExtractOptions(**opts, demo_sets=3))
    tv = res.artifact
    assert tv.meta["demo_sets"] == 3
    ep = sample_episode(load_dataset(task), k=6, n=12, n_test=8, seed=3, n_val=32,
                        demo_sets=3)

    def h(prompt: str) -> torch.Tensor:  # transformers' own forward on the whole prompt
        enc = lm.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            return lm.model(**enc, output_hidden_states=True).hidden_states[-1][0, -1].double()

    H = torch.stack([h(task.query(e.text)) for e in ep.queries]).T  # (d, N)
    icl = torch.stack([torch.stack([h(task.demos_text(s) + task.query(e.text))
                                    for e in ep.queries]) for s in ep.demo_sets]).mean(0).T
    Y = icl - H
    W = Y @ H.T @ torch.linalg.inv(H @ H.T + 5.0 * torch.eye(H.shape[0], dtype=H.dtype))
    got = (tv.U.double() @ tv.V.double().T)
    assert (got - W).abs().max() < 1e-4 * max(1.0, W.abs().max())
    # and it is not the single prompt's fit
    assert (base.U.double() @ base.V.double().T - W).abs().max() > 1e-3


def test_demo_sets_refused_where_no_sets_can_be_drawn(task):
    with pytest.raises(ArgumentError, match="--demo-sets must be at least 1"):
        ExtractOptions(demo_sets=0)
    with pytest.raises(ArgumentError, match="not with --demos/--queries") as e:
        plan_episode(task, ExtractOptions(k=6, n=12, demo_sets=2),
                     demos=sample_episode(load_dataset(task), k=6, n=1, seed=0).demos)
    assert "\n" not in str(e.value)
    with pytest.raises(ArgumentError, match="a transfer"):
        plan_episode(task, ExtractOptions(k=6, n=12, demo_sets=2), transfer=True)


def test_cli_extract_demo_sets(tmp_path, model_dir, task_file, task):
    """`extract --demo-sets 2`: the vector records its sets, and is the library's (the
    labelled queries' gold blended into the sets' mean target by default)."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main
    from ltv_vllm.core.vector import load_task_vector

    out = tmp_path / "toy.pt"
    r = CliRunner().invoke(main, ["extract", "--model", str(model_dir), "--task",
                                  str(task_file), "--k", "6", "--n", "12", "--n-test",
                                  "8", "--seed", "3", "--demo-sets", "2", "--batch-size", "4",
                                  "--quiet", "-o", str(out)])
    assert r.exit_code == 0, r.output
    tv = load_task_vector(out)
    assert tv.meta["demo_sets"] == 2
    lm = load_model(str(model_dir), dtype="float32")
    lib = extract(lm, task, "ltv", ExtractOptions(k=6, n=12, n_test=8, seed=3, batch_size=4,
                                                  progress=False, demo_sets=2,
                                                  teacher=TeacherOptions(gold_weight=0.8))
                  ).artifact
    torch.testing.assert_close(tv.U @ tv.V.T, lib.U @ lib.V.T, atol=1e-5, rtol=1e-4)
    # --gold-weight 0: the paper's fit, the library's default teacher, bit for bit
    r = CliRunner().invoke(main, ["extract", "--model", str(model_dir), "--task",
                                  str(task_file), "--k", "6", "--n", "12", "--n-test",
                                  "8", "--seed", "3", "--demo-sets", "2", "--batch-size", "4",
                                  "--quiet", "--gold-weight", "0", "-o", str(out)])
    assert r.exit_code == 0, r.output
    paper = load_task_vector(out)
    lib = extract(lm, task, "ltv", ExtractOptions(k=6, n=12, n_test=8, seed=3, batch_size=4,
                                                  progress=False, demo_sets=2)).artifact
    assert paper.meta["teacher"]["gold_weight"] == 0.0
    assert torch.equal(paper.U, lib.U) and torch.equal(paper.V, lib.V)
    assert not torch.allclose(paper.U @ paper.V.T, tv.U @ tv.V.T, atol=1e-3)


@pytest.fixture(scope="module")
def soft_model_dir(tmp_path_factory, tokenizer):
    """The tiny model with its LM head scaled so the label distributions are far from one-hot
    (KLs between the methods of 1e-2, not 1e-8: a tolerance could hide nothing)."""
    from conftest import make_llama

    d = tmp_path_factory.mktemp("soft-llama")
    model = make_llama(len(tokenizer), seed=9)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def test_evaluate_over_demo_sets_against_hand_scores(soft_model_dir, task):
    """`evaluate` with --demo-sets 3: every row of the table from a hand computation over
    transformers' whole-prompt forwards (no shared cache): single-prompt ICL the mean of the
    three prompts' accuracies; the ensemble the mean of their label distributions; the mean
    state; the paper's LTV fitted to the first set, multi-prompt LTV to the sets' mean; d_NTP
    against one prompt (the mean KL over the three) and against the ensemble."""
    import ltv_vllm.evaluation.evaluate as ev
    from ltv_vllm.extraction.capture import label_head
    from ltv_vllm.tasks.specs import label_token_ids

    lm = load_model(str(soft_model_dir), dtype="float32")
    cfg = ev.EvalConfig(k=6, n=12, n_test=10, runs=1, n_val=4, cost_samples=0, batch_size=4,
                        demo_sets=3, lam=0.05)  # a small λ: the two fits far apart
    doc = ev.evaluate(lm, [task], [], cfg, progress=False)
    assert doc["config"]["methods"] == ["zero-shot", "icl", "icl-ensemble", "ltv", "ltv-multi",
                                        "mean"]
    got = {r["method"]: r for r in doc["records"]}

    ep = sample_episode(load_dataset(task), k=6, n=12, n_test=10, seed=0, n_val=4,
                        demo_sets=3)
    w_c, b_c = label_head(lm.model, label_token_ids(task, lm.tokenizer))
    labels = torch.tensor([e.label for e in ep.test])

    def h(prompt: str) -> torch.Tensor:
        enc = lm.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            return lm.model(**enc, output_hidden_states=True).hidden_states[-1][0, -1].double()

    def states(prefix: str, examples) -> torch.Tensor:
        return torch.stack([h(prefix + task.query(e.text)) for e in examples])

    def probs(hs: torch.Tensor) -> torch.Tensor:
        return torch.softmax(hs @ w_c.double().T + b_c.double(), -1)

    def kl(p: torch.Tensor, q: torch.Tensor) -> float:
        return float((p * (p.log() - q.log())).sum(-1).mean())

    def acc(p: torch.Tensor) -> float:
        return float((p.argmax(-1) == labels).double().mean())

    H = states("", ep.queries).T  # (d, N)
    prefixes = [task.demos_text(s) for s in ep.demo_sets]
    train = [states(p, ep.queries).T for p in prefixes]
    test_zs = states("", ep.test)
    test = [states(p, ep.test) for p in prefixes]
    p_sets = [probs(t) for t in test]
    p_ens = torch.stack(p_sets).mean(0)

    def ridge(target: torch.Tensor) -> torch.Tensor:
        Y = target - H
        W = Y @ H.T @ torch.linalg.inv(H @ H.T + 0.05 * torch.eye(H.shape[0], dtype=H.dtype))
        return test_zs + test_zs @ W.T

    want = {"zero-shot": probs(test_zs), "icl-ensemble": p_ens,
            "ltv": probs(ridge(train[0])), "ltv-multi": probs(ridge(sum(train) / 3))}
    for m, p in want.items():
        assert got[m]["accuracy"] == acc(p), m
        assert got[m]["d_ntp"] == pytest.approx(sum(kl(q, p) for q in p_sets) / 3,
                                                abs=1e-7, rel=1e-4), m
        assert got[m]["d_ntp_ensemble"] == pytest.approx(kl(p_ens, p), abs=1e-7, rel=1e-4), m
    icl = got["icl"]
    assert icl["params"]["set_accuracy"] == [acc(p) for p in p_sets]
    assert icl["accuracy"] == pytest.approx(sum(acc(p) for p in p_sets) / 3)
    assert icl["d_ntp"] == 0.0
    assert icl["d_ntp_ensemble"] == pytest.approx(sum(kl(p_ens, q) for q in p_sets) / 3,
                                                  abs=1e-7, rel=1e-4)
    # the two fits differ far beyond the tolerance (else the table could not tell them apart)
    d_one, d_multi = kl(p_ens, want["ltv"]), kl(p_ens, want["ltv-multi"])
    assert abs(d_one - d_multi) > 1e-2 * d_one
    assert min(kl(p_ens, p) for p in p_sets) > 1e-3  # the prompts disagree
    table = ev.markdown_table(doc)
    assert "against the 3-prompt ICL ensemble" in table and "Share of the ensemble's gain" in table

    # the mean-state reference, asked for by name
    doc = ev.evaluate(lm, [task], ["icl-states"], cfg, progress=False)
    states_rec = next(r for r in doc["records"] if r["method"] == "icl-states")
    assert states_rec["accuracy"] == acc(probs(sum(test) / 3))

    # one set: the single-prompt table of before, its ICL the first set's prompt
    one = ev.evaluate(lm, [task], ["ltv"], ev.EvalConfig(
        k=6, n=12, n_test=10, runs=1, n_val=4, cost_samples=0, batch_size=4, lam=0.05),
        progress=False)
    rec = {r["method"]: r for r in one["records"]}
    assert rec["icl"]["accuracy"] == acc(p_sets[0]) and "d_ntp_ensemble" not in rec["ltv"]
    assert rec["ltv"]["accuracy"] == got["ltv"]["accuracy"]
    assert rec["ltv"]["d_ntp"] == pytest.approx(kl(p_sets[0], want["ltv"]), abs=1e-7, rel=1e-4)


def test_demo_sets_methods_refused_without_sets():
    import ltv_vllm.evaluation.evaluate as ev
    from ltv_vllm.evaluation.ensemble import METHODS

    for m in METHODS:
        with pytest.raises(ArgumentError, match="need --demo-sets 2 or more"):
            ev.resolve_methods([m], transfer=False)
    with pytest.raises(ArgumentError, match="a transfer evaluation"):
        ev.resolve_methods(None, transfer=True, demo_sets=2)
    with pytest.raises(ArgumentError, match="--demo-sets must be at least 1"):
        ev.EvalConfig(demo_sets=0)


def test_episode_checkpoint_keeps_every_set(tmp_path):
    """An interrupted evaluation over sets resumes with each set's states (not their mean)."""
    import ltv_vllm.evaluation.evaluate as ev
    from ltv_vllm.pipeline.extract import Captures

    g = torch.Generator().manual_seed(0)
    t = [torch.randn(3, 5, 4, generator=g) for _ in range(2)]
    c = Captures(torch.randn(5, 4), t[0].mean(0), torch.randn(2, 4), t[1][0], 1.0, 2.0,
                 t[0], t[1])
    ck = tmp_path / "partial.json"
    ev._save_episode(ck, "key", "toy", 0, c, None)
    back, _ = ev._load_episode(ck, "key", "toy", 0)
    assert torch.equal(back.h_icl_sets, t[0]) and torch.equal(back.h_icl_test_sets, t[1])
    assert torch.equal(back.first_set().h_icl, t[0][0])


def test_cli_evaluate_demo_sets(tmp_path, soft_model_dir, task_file, task):
    """`evaluate --demo-sets 2`: the library's records, and a table with both d_NTP targets."""
    import json

    from click.testing import CliRunner

    import ltv_vllm.evaluation.evaluate as ev
    from ltv_vllm.cli import main

    out = tmp_path / "eval"
    r = CliRunner().invoke(main, ["evaluate", "--model", str(soft_model_dir), "--tasks",
                                  str(task_file), "--k", "6", "--n", "12", "--n-test", "10",
                                  "--runs", "1", "--n-val", "4", "--batch-size", "4",
                                  "--demo-sets", "2", "--cost-samples", "2", "--quiet",
                                  "--dtype", "float32", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["demo_sets"] == 2
    lm = load_model(str(soft_model_dir), dtype="float32")
    lib = ev.evaluate(lm, [task], [], ev.EvalConfig(k=6, n=12, n_test=10, runs=1, n_val=4,
                                                    batch_size=4, cost_samples=0, demo_sets=2),
                      progress=False)

    def scores(d):
        return [{k: v for k, v in rec.items() if k not in ("extraction_seconds", "episode")}
                for rec in d["records"]]

    assert scores(doc) == scores(lib)
    # multi-prompt LTV is timed with LTV's hook; the ensemble (M prompts) is not a forward
    assert set(doc["inference_cost"]["toy"]) == {"zero-shot", "icl", "ltv", "ltv-multi", "mean"}
    md = (out / "results.md").read_text()
    assert "2-prompt ICL ensemble" in md and "| LTV, M prompts |" in md


def _bench_scaling(soft_model_dir, task_file, out, *args: str) -> dict:
    """`ltv-vllm bench scaling` on the toy task (k = 6, 10 test queries), its results.json."""
    import json

    from click.testing import CliRunner

    from ltv_vllm.cli import main

    r = CliRunner().invoke(main, [
        "bench", "scaling", "--model", str(soft_model_dir), "--tasks", str(task_file), "--k",
        "6", "--n-test", "10", "--batch-size", "4", *args, "--out", str(out)])
    assert r.exit_code == 0, r.output
    return json.loads((out / "results.json").read_text())


def _evaluate_records(lm, task, n: int, sets: int, lam: float | str) -> dict:
    """`evaluate --n n --demo-sets sets --lam lam` on the same episode: records by method."""
    import ltv_vllm.evaluation.evaluate as ev

    cfg = ev.EvalConfig(k=6, n=n, n_test=10, runs=1, n_val=0, batch_size=4, cost_samples=0,
                        demo_sets=sets, lam=lam)
    doc = ev.evaluate(lm, [task], ["zero-shot", "ltv", *(["ltv-multi", "icl-ensemble"]
                                                        if sets > 1 else [])], cfg,
                      progress=False)
    return {rec["method"]: rec for rec in doc["records"]}


def test_bench_scaling_rows_are_evaluate_s(tmp_path, soft_model_dir, task_file, task,
                                          monkeypatch):
    """`bench scaling` captures once at the largest N and fits every smaller N on the first
    N queries: its N = 12 rows (the largest) equal `evaluate --n 12 --demo-sets 2`'s, and
    its N = 6 paper's-LTV row equals `evaluate --n 6`'s (the same first set and queries)."""
    from click.testing import CliRunner

    from ltv_vllm.cli import main

    out = tmp_path / "scaling"

    def scaling(runs: int) -> dict:
        return _bench_scaling(soft_model_dir, task_file, out, "--ns", "12,6", "--demo-sets",
                              "2", "--runs", str(runs), "--lam", "0.05")

    doc = scaling(1)
    assert (out / "recovery_vs_n.png").is_file() and not (out / "partial.json").exists()
    rows = {row["n"]: row for row in doc["rows"]}
    assert sorted(rows) == [6, 12]
    lm = load_model(str(soft_model_dir), dtype="float32")

    full = _evaluate_records(lm, task, 12, 2, 0.05)
    for m in ("zero-shot", "icl", "icl-ensemble", "ltv", "ltv-multi"):
        got = rows[12]["scores"][m]
        assert got["accuracy"] == full[m]["accuracy"], m
        assert got["d_ntp"] == pytest.approx(full[m]["d_ntp"], rel=1e-5, abs=1e-9), m
        assert got["d_ntp_ensemble"] == pytest.approx(full[m]["d_ntp_ensemble"], rel=1e-5,
                                                      abs=1e-9), m
    small = _evaluate_records(lm, task, 6, 1, 0.05)
    assert rows[6]["scores"]["ltv"]["accuracy"] == small["ltv"]["accuracy"]
    # both record their splits: the same test subset, no dev split (no choice is made)
    assert (full["ltv"]["n_train"], full["ltv"]["n_dev"], full["ltv"]["test_seed"]) == (12, 0, 0)
    for n, row in rows.items():
        assert row["splits"] == {"train": n, "dev": 0, "test": full["ltv"]["n_test"],
                                 "test_seed": 0}
    assert rows[6]["capture_seconds"]["ltv"] < rows[12]["capture_seconds"]["ltv"]
    assert rows[12]["capture_seconds"]["ltv-multi"] > rows[12]["capture_seconds"]["ltv"]
    md = (out / "results.md").read_text()
    assert "## N = 6" in md and "## N = 12" in md and "LTV, 2 prompts" in md

    # grown by a run on another machine: the finished episode is kept as it was (its timings
    # and the machine that timed them too), one more runs; no capture mean across machines
    import json

    from ltv_vllm.bench import workload
    from ltv_vllm.models.hardware import machine_line

    here = doc["machine"]
    assert {row["machine"] for row in doc["rows"]} == {machine_line(here)}
    there = {**here, "cpu": "Other CPU", "cpu_capability": "AVX2", "cpu_native_bf16": False}
    monkeypatch.setattr(workload, "machine", lambda: there)
    # as written before episodes recorded their machine: the old sweep's machine is theirs
    old = json.loads((out / "results.json").read_text())
    (out / "results.json").write_text(json.dumps(
        {**old, "rows": [{k: v for k, v in row.items() if k != "machine"} for row in old["rows"]]}))
    grown = scaling(2)
    assert [row for row in grown["rows"] if row["run"] == 0] == doc["rows"]
    assert sorted({row["run"] for row in grown["rows"]}) == [0, 1] and len(grown["rows"]) == 4
    assert {row["machine"] for row in grown["rows"] if row["run"] == 1} == {machine_line(there)}
    assert grown["summary"]["12"]["toy"]["ltv"]["capture_seconds"] is None
    md = (out / "results.md").read_text()
    assert "timed on 2 machines" in md
    for row in grown["rows"]:  # each run's own time, beside its own machine
        if row["n"] == 12:
            assert (f"| toy | {row['machine']} | 1 | {row['capture_seconds']['ltv']:.1f} | "
                    f"{row['capture_seconds']['ltv-multi']:.1f} |") in md
    # the plot's capture panel: one line per fit and machine, each named by its machine
    from ltv_vllm.bench import scaling as scaling_mod
    from ltv_vllm.core.fileio import save_figure

    legends = []

    def keep_legend(fig, path):
        legends.append([t.get_text() for t in fig.axes[3].get_legend().get_texts()])
        return save_figure(fig, path)

    monkeypatch.setattr(scaling_mod, "save_figure", keep_legend)
    scaling_mod.scaling_plot(grown, out)
    scaling_mod.scaling_plot(doc, out)
    several, one = legends
    assert len(several) == 4 and all(" · " in label for label in several)
    assert {label.split(" · ")[1] for label in several} == {machine_line(here),
                                                            machine_line(there)}
    assert len(one) == 2 and not any(" · " in label for label in one)
    # re-rendered from results.json alone: the same table
    before = (out / "results.md").read_text()
    r = CliRunner().invoke(main, ["bench", "report", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "results.md").read_text() == before


def test_bench_scaling_lam_auto_is_evaluate_s(tmp_path, soft_model_dir, task_file, task):
    """`bench scaling --lam auto`: each fit's λ by leave-one-out on its own states, the same
    λ and scores as `evaluate --lam auto --demo-sets 2` on the same episode, and the λ
    table in the report."""
    out = tmp_path / "auto"
    (row,) = _bench_scaling(soft_model_dir, task_file, out, "--ns", "12", "--demo-sets", "2",
                            "--runs", "1", "--lam", "auto")["rows"]
    recs = _evaluate_records(load_model(str(soft_model_dir), dtype="float32"), task, 12, 2,
                             "auto")
    for m in ("ltv", "ltv-multi"):
        assert row["lam"][m] == pytest.approx(recs[m]["params"]["lam"], rel=1e-9), m
        assert row["scores"][m]["accuracy"] == recs[m]["accuracy"], m
        assert row["scores"][m]["d_ntp"] == pytest.approx(recs[m]["d_ntp"], rel=1e-5), m
    assert row["lam"]["ltv"] != 5.0 and row["lam"]["ltv-multi"] != 5.0  # not the default
    md = (out / "results.md").read_text()
    assert "λ=auto" in md and "**λ by leave-one-out** (median over runs)" in md
    assert f"{row['lam']['ltv-multi']:.3g}" in md


def test_the_capture_plan_counts_every_sets_prefix(model_dir, task):
    """`--engine vllm --dry-run` over M sets plans the longest prefix of them all."""
    from transformers import AutoTokenizer

    from ltv_vllm.serving.offline.capture import CaptureEngine, plan_capture

    tok = AutoTokenizer.from_pretrained(model_dir)
    ep = sample_episode(load_dataset(task), k=6, n=12, n_test=8, seed=3, demo_sets=3)
    sizes = [len(tok(p)["input_ids"]) for p in ep.demo_prefixes()]
    assert max(sizes) > sizes[0]  # a later set is the longest: the case this checks
    _, req, estimated = plan_capture(str(model_dir), [ep], CaptureEngine(dtype="float32"),
                                     tokenizer=tok)
    assert not estimated and req.prefix_tokens == max(sizes)
