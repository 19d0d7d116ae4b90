"""Evaluation sweeps on a Ray cluster (`evaluation.executor`), on a real two-node cluster
started here on the loopback address (`ray.cluster_utils.Cluster`: a head and a worker node,
one CPU each, torn down at the end):

- `evaluate --executor ray` on the packaged model gives the local executor's rows (the same
  seeds, demonstrations and queries; accuracies equal, d_NTP to float tolerance: a worker
  runs torch on its one CPU, the driver on two), in the sweep's order, from both nodes;
- a worker killed (by its pid) while it is inside an episode: the episode runs again on a
  new worker, and every episode comes back exactly once; an episode that raises comes back
  with its error in one line while the others finish;
- the driver killed after its checkpoint holds an episode: started again, it runs only what
  is missing (the kept episodes' records are the first driver's, to the float);
- a cluster that does not answer: one line, before any model loads;
- `bench rank`, `bench scaling` and `bench teachers` give the local executor's rows too.

The worker's episodes in the fault tests wait for a file the test writes (`GatedSpec`), so a
worker is killed inside an episode by construction, never after a guessed delay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import make_llama, make_tokenizer, write_toy_task

pytestmark = pytest.mark.slow(seconds=120)  # see conftest's ordering

WORDS = ["the", "plot", "is", "dull", "and", "acting", "worse", "a", "gorgeous", "movie"]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ltv_vllm.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def both_ways(cluster, tmp_path: Path, args: list[str]) -> tuple[dict, dict]:
    """One `ltv-vllm evaluate` on the local executor and on the cluster: their results."""
    local = cli(*args, "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr[-3000:]
    remote = cli(*args, "--out", str(tmp_path / "ray"), "--executor", "ray",
                 "--ray-address", cluster.address)
    assert remote.returncode == 0, remote.stderr[-3000:]
    return (json.loads((tmp_path / "local" / "results.json").read_text()),
            json.loads((tmp_path / "ray" / "results.json").read_text()))


def rows(doc: dict) -> list[dict]:
    """A result's records without where and how long each ran."""
    return [{k: v for k, v in r.items() if k not in ("extraction_seconds", "episode")}
            for r in doc["records"]]


def test_ray_evaluate_equals_the_local_one(cluster, tmp_path, packaged_smollm2):
    model = str(packaged_smollm2)
    args = ["evaluate", "--model", model, "--tasks", "sst2,trec", "--runs", "2", "--k", "6",
            "--n", "16", "--n-test", "16", "--n-val", "8", "--methods", "zero-shot,icl,ltv,mean",
            "--cost-samples", "0", "--dtype", "float32", "--quiet"]
    a, b = both_ways(cluster, tmp_path, args)
    assert len(a["records"]) == 2 * 2 * 4
    for x, y in zip(rows(a), rows(b), strict=True):
        assert (x["task"], x["run"], x["method"]) == (y["task"], y["run"], y["method"])
        assert {k: v for k, v in x.items() if k != "d_ntp"} == \
            {k: v for k, v in y.items() if k != "d_ntp"}
        assert y["d_ntp"] == pytest.approx(x["d_ntp"], rel=1e-4, abs=1e-7)
    # both nodes ran episodes (one worker each: one CPU per node, one per episode)
    assert len({r["episode"]["ray_node"] for r in b["records"]}) == 2
    assert all(r["episode"]["wall_seconds"] > 0 for r in b["records"])
    assert a["summary"].keys() == b["summary"].keys()


@dataclass(frozen=True)
class GatedSpec:
    """A stand-in for `episodes.RunnerSpec` whose episodes each write their worker's pid to
    GATE/TASK-RUN.pid, then wait for GATE/TASK-RUN.go (the test's); ("bad", 0) raises."""

    gate: str

    def runner(self, lm):  # noqa: ARG002 - the worker loaded a real model for it
        return GatedRunner(self.gate)


@dataclass(frozen=True)
class GatedRunner:
    gate: str

    def run(self, name: str, run: int):
        from ltv_vllm.evaluation.episodes import EpisodeResult

        Path(self.gate, f"{name}-{run}.pid").write_text(str(os.getpid()))
        if name == "bad":
            raise ValueError("the episode's data does not read\n(its second line)")
        while not Path(self.gate, f"{name}-{run}.go").exists():
            time.sleep(0.01)  # a wait for the test's file, not a guess
        return EpisodeResult(name, run, [{"task": name, "run": run, "pid": os.getpid()}])


def wait_for(path: Path, limit: float = 120) -> None:
    end = time.monotonic() + limit
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.02)


def test_a_killed_worker_s_episode_runs_again_and_a_raising_one_is_reported(cluster,
                                                                           tmp_path):
    from ray import cloudpickle

    from ltv_vllm.evaluation.executor import ModelLoad, RayExecutor, RayOptions

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers import no tests
    tok = make_tokenizer()
    make_llama(len(tok), seed=3, layers=2).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    gate = tmp_path / "gate"
    gate.mkdir()
    todo = [("a", 0), ("a", 1), ("bad", 0), ("b", 0)]
    got = []
    ex = RayExecutor(ModelLoad(str(tmp_path / "m"), "float32", "cpu"),
                     RayOptions(address=cluster.address, workers=2))
    t = threading.Thread(target=ex.run, args=(todo, GatedSpec(str(gate)), None, got.append))
    t.start()
    wait_for(gate / "a-0.pid")  # a worker is inside episode a-0
    killed = int((gate / "a-0.pid").read_text())
    os.kill(killed, signal.SIGKILL)
    for name, run in todo:
        (gate / f"{name}-{run}.go").touch()
    t.join(300)
    assert not t.is_alive()
    assert sorted((r.task, r.run) for r in got) == sorted(todo)  # each once: none lost or twice
    by = {(r.task, r.run): r for r in got}
    assert by["a", 0].error is None and by["a", 0].records[0]["pid"] != killed
    assert ex.lost == 1
    assert by["bad", 0].error == "ValueError: the episode's data does not read"
    assert all(by[e].error is None and len(by[e].records) == 1 for e in [("a", 1), ("b", 0)])


def test_a_killed_driver_resumes_and_runs_only_what_is_missing(cluster, tmp_path):
    tok = make_tokenizer()
    make_llama(len(tok), seed=4, layers=2).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    spec = write_toy_task(tmp_path, WORDS)
    out = tmp_path / "out"
    args = [sys.executable, "-m", "ltv_vllm.cli", "evaluate", "--model", str(tmp_path / "m"),
            "--tasks", str(spec), "--runs", "4", "--k", "6", "--n", "24", "--n-test", "12",
            "--n-val", "4", "--methods", "zero-shot,icl,ltv", "--cost-samples", "0",
            "--dtype", "float32", "--quiet", "--out", str(out), "--executor", "ray",
            "--ray-address", cluster.address, "--workers", "1"]
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial = out / "partial.json"
    end = time.monotonic() + 300
    while True:  # until the driver's checkpoint holds an episode (and not all four)
        assert first.poll() is None, first.stderr.read().decode()[-2000:]
        assert time.monotonic() < end, "no episode was checkpointed"
        try:
            held = json.loads(partial.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            held = {"done": []}
        if held["done"]:
            break
        time.sleep(0.05)
    first.kill()
    first.wait()
    held = json.loads(partial.read_text())
    assert 1 <= len(held["done"]) < 4
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert sorted((r["run"], r["method"]) for r in doc["records"]) == sorted(
        (run, m) for run in range(4) for m in ("zero-shot", "icl", "ltv"))
    kept = {(r["run"], r["method"]): r["episode"] for r in held["records"]}
    for r in doc["records"]:  # the first driver's episodes were not run again
        if (r["run"], r["method"]) in kept:
            assert r["episode"] == kept[r["run"], r["method"]]
    assert not partial.exists()


def test_regression_instances_on_the_cluster_equal_the_local_ones(cluster, tmp_path):
    """`evaluate --tasks linear` (answers generated) through the Ray executor: the local
    executor's rows, from both nodes."""
    tok = make_tokenizer()
    make_llama(len(tok), seed=5, layers=2).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    args = ["evaluate", "--model", str(tmp_path / "m"), "--tasks", "linear", "--runs", "2",
            "--k", "4", "--n", "8", "--n-test", "4", "--methods", "zero-shot,icl,ltv",
            "--max-new-tokens", "4", "--dtype", "float32", "--quiet"]
    a, b = both_ways(cluster, tmp_path, args)
    assert len(b["records"]) == 2 * 3
    for x, y in zip(rows(a), rows(b), strict=True):
        assert (x["run"], x["method"], x["texts"]) == (y["run"], y["method"], y["texts"])
        assert y["mse"] == pytest.approx(x["mse"], rel=1e-6, nan_ok=True)
    assert len({r["episode"]["ray_node"] for r in b["records"]}) == 2


# where and how long each ran: may differ
TIMED = ("machine", "capture_seconds", "fit_seconds", "cost", "episode")


def assert_close(x, y, where: str = "rows") -> None:
    """Two results' rows alike: the same keys and strings, numbers to float tolerance (a
    worker runs torch on its one CPU, the driver on two), timings and machines aside."""
    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            if k not in TIMED:
                assert_close(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, list):
        assert isinstance(y, list) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            assert_close(u, v, f"{where}[{i}]")
    elif isinstance(x, float):
        assert y == pytest.approx(x, rel=1e-4, abs=1e-6), where
    else:
        assert x == y, where


def bench_both_ways(cluster, tmp_path: Path, name: str, args: list[str]) -> tuple[dict, dict]:
    """One `ltv-vllm bench NAME` on the local executor and on the cluster: their results."""
    got = []
    for where, extra in (("local", []), ("ray", ["--executor", "ray", "--ray-address",
                                                  cluster.address])):
        r = cli("bench", name, *args, "--out", str(tmp_path / name / where), *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        got.append(json.loads((tmp_path / name / where / "results.json").read_text()))
    return got[0], got[1]


def test_the_bench_sweeps_on_the_cluster_equal_the_local_ones(cluster, tmp_path):
    """`bench rank`, `bench scaling` and `bench teachers` through the Ray executor: the local
    executor's rows, in the sweep's order; the teachers' states are written by the driver
    alone (the workers hand them back), each episode's once."""
    tok = make_tokenizer()
    make_llama(len(tok), seed=6, layers=2).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    task = str(write_toy_task(tmp_path, WORDS))
    common = ["--model", str(tmp_path / "m"), "--tasks", task, "--runs", "2", "--k", "6",
              "--n-test", "8", "--dtype", "float32"]

    a, b = bench_both_ways(cluster, tmp_path, "rank", [*common, "--n", "12", "--ranks", "2,4"])
    assert len(a["rows"]) == 2 * 3
    assert_close(a["rows"], b["rows"])

    a, b = bench_both_ways(cluster, tmp_path, "scaling",
                           [*common, "--ns", "8,16", "--demo-sets", "2"])
    assert [(r["run"], r["n"]) for r in b["rows"]] == [(0, 8), (0, 16), (1, 8), (1, 16)]
    assert_close(a["rows"], b["rows"])

    a, b = bench_both_ways(cluster, tmp_path, "teachers",
                           [*common, "--n", "12", "--many-k", "12", "--variants",
                            "one/icl,many/batch"])
    assert [r["run"] for r in b["rows"]] == [0, 1]
    assert_close(a["rows"], b["rows"])
    states = sorted(p.name for p in (tmp_path / "teachers" / "ray" / "states").iterdir())
    assert states == sorted(p.name for p in (tmp_path / "teachers" / "local" / "states").iterdir())
    assert len(states) == 2 * 2  # each episode's tensors and their record, once


def test_an_unreachable_cluster_is_one_line_before_any_model(tmp_path):
    r = cli("evaluate", "--model", str(tmp_path / "nothing"), "--tasks", "sst2", "--runs", "1",
            "--executor", "ray", "--ray-address", "127.0.0.1:9", "--out", str(tmp_path / "o"),
            timeout=120)
    assert r.returncode == 1 and "--ray-address 127.0.0.1:9: no Ray cluster answers" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o").exists()
