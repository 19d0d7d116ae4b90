"""The wrapper's per-step shift (`vllm_ext.models.LTVMixin._shifted`) against a row-by-row
float64 computation: every row gets its own task's U (Vᵀ h) (+ bias, or the RBF map) and
nothing else, masked rows nothing, whatever mix of tasks a step holds — many small tasks of
one rank (shifted together in two batched products), tasks of another rank, a task with
more rows than the batched path takes, a vector with a bias, an RBF map, logit-space
vectors, rows of the bare model."""

from __future__ import annotations

import random
from collections import OrderedDict

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


VECTORS = {f"s{i}": vector(i, 4) for i in range(12)}  # many small tasks, rank 4
VECTORS |= {"r6": vector(20, 6), "r6b": vector(21, 6),  # another rank
            "big": vector(22, 4),                        # more rows than SMALL
            "bias": vector(23, 4, bias=True), "rbf": vector(24, 5, rbf=True),
            "logit": vector(25, 3, kind="logit"), "logit2": vector(26, 3, kind="logit")}


@pytest.mark.parametrize("batched", [False, True], ids=["per-task", "batched"])
@pytest.mark.parametrize("seed", range(4))
def test_every_row_gets_its_own_task_and_nothing_else(seed, batched, monkeypatch):
    """Both ways of shifting small tasks: one product per task (the CPU's), and batched
    (a GPU's: `batches_small_tasks`), here forced on the CPU."""
    monkeypatch.setattr(models, "batches_small_tasks", lambda _device: batched)
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
    [(total, n)] = shift._shift_sizes.read().values()
    assert n == int(mask.sum()) and total == pytest.approx(want, rel=1e-4)
