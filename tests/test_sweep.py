"""The resumable task × run loop evaluate, regress and bench rank share."""

from __future__ import annotations

import json

import pytest

from ltv_vllm.errors import ArgumentError
from ltv_vllm.evaluation.sweep import Sweep


def test_an_interrupted_sweep_resumes_where_it_stopped(tmp_path):
    ck = tmp_path / "partial.json"
    config = {"model": "m", "runs": 3}
    first = Sweep(config, ["a", "b"], 3, checkpoint=ck, progress=False)
    seen = []
    for task, run in first:
        seen.append((task, run))
        first.finish(task, run, [{"task": task, "run": run}])
        if len(seen) == 2:
            break  # killed here
    assert seen == [("a", 0), ("a", 1)]
    saved = json.loads(ck.read_text())
    assert saved["done"] == [["a", 0], ["a", 1]] and len(saved["records"]) == 2

    again = Sweep(config, ["a", "b"], 3, checkpoint=ck, progress=False)
    rest = []
    for task, run in again:
        rest.append((task, run))
        again.finish(task, run, [{"task": task, "run": run}])
    assert rest == [("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    assert [(r["task"], r["run"]) for r in again.records] == seen + rest

    with pytest.raises(ArgumentError, match="another configuration"):
        Sweep({"model": "other", "runs": 3}, ["a", "b"], 3, checkpoint=ck, progress=False)
    ck.write_text("{not json")
    with pytest.raises(ArgumentError, match="unreadable"):
        Sweep(config, ["a"], 1, checkpoint=ck, progress=False)


def test_a_sweep_without_a_checkpoint_visits_everything_once():
    s = Sweep({}, ["x", "y"], 2, progress=False)
    order = []
    for task, run in s:
        order.append((task, run))
        s.finish(task, run, [])
    assert order == [("x", 0), ("x", 1), ("y", 0), ("y", 1)] and s.wall_seconds >= 0
