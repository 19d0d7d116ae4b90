"""The wrapper's per-step shift (`vllm_ext.models.LTVMixin._shifted`) against a row-by-row
float64 computation: every row gets its own task's U (Vᵀ h) (+ bias, or the RBF map) and
nothing else, masked rows nothing, whatever mix of tasks a step holds — many small tasks of
one rank (shifted together in two batched products), tasks of another rank, a task with
more rows than the batched path takes, a vector with a bias, an RBF map, logit-space
vectors, rows of the bare model."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import pytest
import torch

from ltv_vllm.core.vector import ModelIdentity, TaskVector
from ltv_vllm.serving.engine import models
from ltv_vllm.serving.engine.models import SMALL, LTVMixin
from ltv_vllm.serving.engine.shift_sizes import ShiftSizes

D, VOCAB = 24, 40
IDENT = ModelIdentity("random", D, VOCAB, "none")


def vector(seed: int, rank: int, kind: str = "hidden", bias: bool = False,
           rbf: bool = False) -> TaskVector:
    g = torch.Generator().manual_seed(seed)
    d_out = D if kind == "hidden" else VOCAB
    return TaskVector(kind, torch.randn(d_out, rank, generator=g),
                      torch.randn(D, rank, generator=g),
                      torch.randn(d_out, generator=g) if bias else None, IDENT, (0,),
                      map="rbf" if rbf else "linear", gamma=0.05 if rbf else None)


class Shift(LTVMixin):
    def __init__(self, vectors: dict[str, TaskVector]) -> None:
        self._ltv, self._store, self._casts = None, None, {}
        self._cast_keys = OrderedDict()
        self._sizes = (D, VOCAB)
        self._vectors = vectors
        self._shift_sizes = ShiftSizes()
        self._grouped_choice, self._slot_tables = None, {}


VECTORS = {f"s{i}": vector(i, 4) for i in range(12)}  # many small tasks, rank 4
VECTORS |= {"r6": vector(20, 6), "r6b": vector(21, 6),  # another rank
            "big": vector(22, 4),                        # more rows than SMALL
            "bias": vector(23, 4, bias=True), "rbf": vector(24, 5, rbf=True),
            "logit": vector(25, 3, kind="logit"), "logit2": vector(26, 3, kind="logit")}


@pytest.mark.parametrize("batched", [False, True], ids=["per-task", "batched"])
@pytest.mark.parametrize("seed", range(4))
def test_every_row_gets_its_own_task_and_nothing_else(seed, batched, monkeypatch):
    """Both ways of shifting small tasks on a CPU engine: one product per task (the CPU's),
    and batched (`batches_small_tasks`, a GPU's without the grouped kernel), forced here."""
    monkeypatch.setattr(models, "batches_small_tasks", lambda _device: batched)
    monkeypatch.setenv(models.GROUPED_ENV, "off")
    check_rows(seed)


def test_the_grouped_kernel_gives_every_row_its_own_task_and_nothing_else():
    """The grouped kernel a GPU engine selects (`engine.grouped_shift`), forced on
    (`LTV_VLLM_GROUPED_SHIFT=on`) and run through Triton's interpreter, which Triton reads
    when it is first imported: in a process of its own, every seed of the test above."""
    grouped_in_interpreter("from ltv_vllm.serving.engine import models\n"
                           "assert models.uses_grouped_shift(t.torch.device('cpu'))\n"
                           "for seed in range(4):\n    t.check_rows(seed, grouped=True)\n")


def grouped_in_interpreter(code: str) -> None:
    """`code` (this module imported as `t`) in a fresh interpreter with the grouped kernel
    forced on and Triton's interpreter (read when Triton is first imported); it must finish."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1", models.GROUPED_ENV: "on",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", f"import test_shift_rows as t\n{code}"
                        "print('checked')"], env=env, cwd=here, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "checked" in r.stdout, r.stderr[-3000:]


def check_rows(seed: int, grouped: bool = False) -> None:
    """One step of 51 rows over every kind of task against a row-by-row float64 shift."""
    rng = random.Random(seed)
    tasks = [*VECTORS, "", ""]  # "": the bare model (no vector: FUSED in multi-task serving)
    rows = ["big"] * (SMALL + 3) + [rng.choice(tasks) for _ in range(40)]
    rng.shuffle(rows)
    plan: dict[str, list[int]] = {}
    for r, t in enumerate(rows):
        plan.setdefault(t, []).append(r)
    h = torch.randn(len(rows), D, generator=torch.Generator().manual_seed(seed))
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed + 9))
    mask = torch.tensor([rng.random() < 0.8 for _ in rows])
    shift = Shift(dict(VECTORS))
    for m in (None, mask):
        shift._shift_sizes = ShiftSizes()
        got_h = shift._shifted(h, dict(plan), "hidden", h, m)
        got_logits = shift._shifted(h, dict(plan), "logit", logits, m)
        want_h, want_logits = h.double().clone(), logits.double().clone()
        sizes: dict[str, list[float]] = {}  # ‖delta‖ / ‖h‖ summed, rows: hidden tasks only
        for r, t in enumerate(rows):
            tv = VECTORS.get(t)
            if tv is None or (m is not None and not m[r]):
                continue
            x = h[r].double()
            if tv.map == "rbf":
                k = torch.exp(-tv.gamma * ((tv.V.double().T - x) ** 2).sum(-1))
                d = tv.U.double() @ k
            else:
                d = tv.U.double() @ (tv.V.double().T @ x)
            if tv.bias is not None:
                d = d + tv.bias.double()
            (want_h if tv.kind == "hidden" else want_logits)[r] += d
            if tv.kind == "hidden":
                acc = sizes.setdefault(t, [0.0, 0.0])
                acc[0] += float(d.norm() / x.norm())
                acc[1] += 1
        assert (got_h.double() - want_h).abs().max() < 1e-4
        assert (got_logits.double() - want_logits).abs().max() < 1e-4
        got = {t: v for t, v in shift._shift_sizes.read().items() if v[1]}
        assert got.keys() == sizes.keys()
        for t, (total, n) in sizes.items():
            assert got[t][1] == n and got[t][0] == pytest.approx(total, rel=1e-4), t
    assert torch.equal(h, h.clone())  # vLLM's buffer itself is never written
    # the grouped kernel ran, one slot table per rank of the linear tasks without a bias
    assert sorted(shift._slot_tables) == ([4, 6] if grouped else [])


def test_one_task_on_every_row_sums_its_shifted_rows_only():
    """The one-product path (a step whose every row has one task) with a row mask (V2's):
    the shift sizes count the masked rows and sum their ‖U Vᵀ h‖ / ‖h‖, nothing else."""
    h = torch.randn(9, D, generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([True, False, True, True, False, True, False, True, True])
    shift = Shift({"s0": VECTORS["s0"]})
    shift._shifted(h, {"s0": None}, "hidden", h, mask)
    tv = VECTORS["s0"]
    want = sum(float((tv.U.double() @ (tv.V.double().T @ h[r].double())).norm()
                     / h[r].double().norm()) for r in range(9) if mask[r])
    [(total, n, span, span_n)] = shift._shift_sizes.read().values()
    assert n == int(mask.sum()) and total == pytest.approx(want, rel=1e-4)
    assert span == span_n == 0  # no row carried a readout: no re-ask to measure


def test_re_asked_rows_sum_their_off_span_share_per_task():
    """The rows with a label readout (live fidelity's re-asks) on a linear task's side add
    ‖h − Q Qᵀ h‖ / ‖h‖ to their task's sum — Q from numpy's SVD of V here, not the engine's
    QR — and no other row does: not a row without a readout, not the bare model's (a task
    without a vector), not a kernel map's."""
    import numpy as np

    from ltv_vllm.serving.engine import steps

    h = torch.randn(8, D, generator=torch.Generator().manual_seed(9))
    shift = Shift({k: VECTORS[k] for k in ("s0", "s1", "rbf")})
    plan = {"s0": [0, 1, 2], "s1": [3, 4], "rbf": [5], "": [6, 7]}
    old = steps.PLAN.readout
    try:
        steps.PLAN.readout = {1: (0,), 2: (0,), 4: (0,), 5: (0,), 6: (0,)}
        shift._record_span(h, plan)
        shift._record_span(h, plan)  # a second step: the sums add up
    finally:
        steps.PLAN.readout = old

    def by_hand(task: str, rows: list[int]) -> float:
        u, sv, _ = np.linalg.svd(VECTORS[task].V.double().numpy(), full_matrices=False)
        q = torch.from_numpy(u[:, sv > sv.max() * 1e-10])
        return sum(float((h[r].double() - q @ (q.T @ h[r].double())).norm()
                         / h[r].double().norm()) for r in rows)

    got = {t: v[2:] for t, v in shift._shift_sizes.read().items() if v[3]}
    assert got.keys() == {"s0", "s1"}
    assert got["s0"][1] == 4 and got["s0"][0] == pytest.approx(2 * by_hand("s0", [1, 2]),
                                                                rel=1e-5)
    assert got["s1"][1] == 2 and got["s1"][0] == pytest.approx(2 * by_hand("s1", [4]),
                                                                rel=1e-5)


def test_task_slots_write_once_evict_the_least_recently_used_and_pad_ranks():
    """`grouped_shift.TaskSlots`: a task's factors land in a slot on first use and stay
    (growing the tables keeps them); past capacity the least recently used task not in this
    step gives up its slot, whose stale columns a lower-rank task does not inherit; a step
    with more tasks than slots is refused."""
    from ltv_vllm.serving.engine.grouped_shift import TaskSlots

    vs = {f"t{i}": vector(40 + i, 4 if i != 3 else 2) for i in range(5)}
    table = TaskSlots(D, D, 4, torch.device("cpu"), capacity=3)

    def put(task: str, step: set[str]) -> int:
        return table.of(task, vs[task].U, vs[task].V, step)

    def holds(task: str) -> None:
        s, r = table.slot[task], vs[task].U.shape[1]
        assert torch.equal(table.v[s, :, :r], vs[task].V)
        assert torch.equal(table.u[s, :, :r], vs[task].U)
        assert not table.v[s, :, r:].any() and not table.u[s, :, r:].any()

    first = put("t0", {"t0"})
    put("t1", {"t1"})
    put("t2", {"t2"})
    assert put("t0", {"t0"}) == first  # written once: the same slot, t0 now most recent
    put("t3", {"t3"})  # evicts t1, the least recently used; rank 2 into a rank-4 slot
    assert set(table.slot) == {"t0", "t2", "t3"}
    for t in ("t0", "t2", "t3"):
        holds(t)
    put("t4", {"t4", "t2"})  # t2 is in this step: t0 goes instead
    assert set(table.slot) == {"t2", "t3", "t4"}
    for t in ("t2", "t3", "t4"):
        holds(t)
    with pytest.raises(RuntimeError, match="4 tasks in one step, over the 3 slots"):
        put("t0", {"t0", "t2", "t3", "t4"})
    with pytest.raises(ValueError, match="do not fit slots"):
        table.of("wide", torch.zeros(D, 5), torch.zeros(D, 5), set())


# ---------------------------------------------------------------------------------------
# Layer tasks' maps at a block (`engine.layer_rows`): per group, and through the grouped kernel


def layer_task(seed: int, layers: tuple[int, ...], rank: int | None, bias: bool) -> Any:
    from ltv_vllm.core.layer_task import LayerTask

    g = torch.Generator().manual_seed(seed)
    n = len(layers)
    return LayerTask(layers=layers, bias=torch.randn(n, D, generator=g) if bias else None,
                     U=torch.randn(n, D, rank, generator=g) * 0.1 if rank else None,
                     V=torch.randn(n, D, rank, generator=g) * 0.1 if rank else None,
                     model=ModelIdentity("random", D, VOCAB, "none", 3))


LAYER_TASKS = {"m4": layer_task(1, (0, 2), 4, False), "m4b": layer_task(2, (2,), 4, True),
               "m6": layer_task(3, (1, 2), 6, False), "m6c": layer_task(4, (2,), 6, False),
               "add": layer_task(5, (1, 2), None, True), "add2": layer_task(6, (2,), None, True)}


class Layers(models.LTVMixin):
    def __init__(self, grouped: bool) -> None:
        self._layer_tasks, self._layer_casts, self._layer_slots = dict(LAYER_TASKS), {}, {}
        self._grouped_choice = grouped


def check_layer_maps(seed: int, grouped: bool) -> None:
    """One block's map requests (each a task with a scale and perhaps additive tasks mixed
    in; a task that does not act at the block; rows of several groups of one task) against
    a row-by-row float64 shift of h = hidden + residual; `hidden` alone is written."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    hidden, residual = torch.randn(30, D, generator=g), torch.randn(30, D, generator=g)
    rows = list(range(30))
    rng.shuffle(rows)
    asks = [(("m4", 1.0),), (("m4", -0.5), ("add", 2.0)), (("m4b", 1.5),),
            (("m6", 1.0), ("add2", 0.25)), (("m6c", 2.0),), (("m6", 0.5),)]
    maps, at = [], 0
    for parts in asks:
        k = rng.randint(1, 5)
        maps.append((parts, torch.tensor(sorted(rows[at:at + k]))))
        at += k
    for layer in (0, 1, 2):
        h = hidden.clone()
        Layers(grouped)._layer_maps(h, residual, maps, layer)
        want = hidden.double().clone()
        for parts, idx in maps:
            for r in idx.tolist():
                x = hidden[r].double() + residual[r].double()
                for task, scale in parts:
                    lt = LAYER_TASKS[task]
                    if layer not in lt.layers:
                        continue
                    i = lt.layers.index(layer)
                    d = torch.zeros(D, dtype=torch.float64)
                    if lt.U is not None:
                        d += lt.U[i].double() @ (lt.V[i].double().T @ x)
                    if lt.bias is not None:
                        d += lt.bias[i].double()
                    want[r] += scale * d
        assert (h.double() - want).abs().max() < 1e-4, (grouped, layer)


def slot_ranks() -> list[int]:
    """The grouped path's slot tables after one block of two maps of ranks 4 and 6."""
    s = Layers(True)
    h = torch.randn(6, D)
    s._layer_maps(h, h, [((("m4", 1.0),), torch.tensor([0, 1])),
                         ((("m6c", 1.0),), torch.tensor([2]))], 2)
    return sorted(s._layer_slots)


@pytest.mark.parametrize("seed", range(3))
def test_layer_maps_give_every_row_its_own_map_scale_and_mix(seed):
    check_layer_maps(seed, grouped=False)


def test_the_grouped_kernel_gives_every_layer_map_row_its_own():
    """`_grouped_maps` (a GPU engine's), forced on and run through Triton's interpreter in a
    process of its own: every seed of the test above, and one slot table per rank."""
    grouped_in_interpreter("for seed in range(3):\n    t.check_layer_maps(seed, grouped=True)\n"
                           "assert t.slot_ranks() == [4, 6]\n")


def test_the_device_script_times_and_checks_layer_maps(tmp_path, monkeypatch):
    """`benchmarks/k_tasks_shift.py --layer` (the GPU machine's step, `scripts/device_checks.sh`)
    on this CPU at a tiny width: every path's block of K layer maps within float32 of a
    float64 shift, the record written."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    import k_tasks_shift

    out = tmp_path / "layer.json"
    res = k_tasks_shift.main(["--layer", "--hidden", "32", "--vocab", "100", "--ranks", "4,8",
                              "--ks", "1,8", "--rows", "16", "--repeats", "1", "--out",
                              str(out)])
    assert [(r["K"], r["rank"]) for r in res["layer_rows"]] == [(1, 4), (8, 4), (1, 8), (8, 8)]
    for r in res["layer_rows"]:
        assert r["served_max_rel_error"] < 1e-5 and r["loop_max_rel_error"] < 1e-5, r
    assert json.loads(out.read_text())["command"].startswith(
        "python benchmarks/k_tasks_shift.py --layer")
    sys.modules.pop("k_tasks_shift", None)
