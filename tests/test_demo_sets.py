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
    """`extract --demo-sets 2`: the vector records its sets, and is the library's."""
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
                                                  progress=False, demo_sets=2)).artifact
    torch.testing.assert_close(tv.U @ tv.V.T, lib.U @ lib.V.T, atol=1e-5, rtol=1e-4)
