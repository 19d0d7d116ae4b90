"""How large a task's shift is on live traffic, and how far that traffic sits from the
queries its vector was fitted on (runs in vLLM's engine worker processes): ‖W h‖ / ‖h‖ per
shifted row, summed per task key in the engine (`ShiftSizes`, fed by the model wrapper's
`_shifted`); and for the rows of live fidelity's re-asks (those with a label readout, the
vector's side) the share of h outside the span the map reads (`core.metrics.off_span_share`,
fed by the wrapper's `_record_span`: one rank-r product per re-ask, none per client request).
Both are read by the API server now and then (`read_shift_sizes`, through vLLM's
`collective_rpc`, by the worker method name READ) for its `/metrics`
(`api_server.metrics.ShiftSizeCollector`).

The sums stay on the engine's device, added to once per step in one product whatever the
number of tasks (a host copy of the rows' task indices, two norms, two index-adds), so a
step never waits for a device-to-host copy; only a read copies them, a few floats per task.
"""

from __future__ import annotations

from typing import Any

import torch

from ltv_vllm.core.metrics import off_span_share, span_basis

# READ: the worker method the API server's `collective_rpc` names (`serve_reads`)
from ltv_vllm.serving.contract.names import SHIFT_SIZES_RPC as READ
from ltv_vllm.serving.engine.steps import row_index

CAP = 4096  # task keys summed at once; past it the sums start again (a counter reset)
COLUMNS = 4  # sum of ‖W h‖ / ‖h‖, rows shifted; sum of off-span shares, rows re-asked


class ShiftSizes:
    """Per task key: the sum of ‖W h‖ / ‖h‖ over the rows it shifted, and their count; the
    sum of the off-span share over its re-asked rows, and their count."""

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}
        self.acc: torch.Tensor | None = None  # (slots, COLUMNS)
        self.bases: dict[str, torch.Tensor] = {}  # task key → Q of its V (`span_basis`)
        serve_reads()  # made in the worker's process, as its model is built

    def record(self, tasks: list[str], h: torch.Tensor, delta: torch.Tensor,
               weight: torch.Tensor | None, row_task: torch.Tensor | None) -> None:
        """One step's rows: `h` and its hidden-space `delta` (rows, d), `weight` (rows,) 1
        where the row was shifted (None: every row), `row_task` (rows,) the index in `tasks`
        of each row's task (None: one task)."""
        if h.shape[0] == 0:
            return
        ratio = (torch.linalg.vector_norm(delta.float(), dim=1)
                 / torch.linalg.vector_norm(h.float(), dim=1).clamp_min(1e-30))
        w = torch.ones_like(ratio) if weight is None else weight.to(ratio.dtype)
        vals = torch.stack([ratio * w, w], dim=1)
        per = (vals.sum(0, keepdim=True) if row_task is None else
               torch.zeros(len(tasks), 2, device=h.device).index_add_(0, row_task, vals))
        slots = [self._slot(t, h.device) for t in tasks]
        assert self.acc is not None
        self.acc[:, :2].index_add_(0, row_index(slots, h.device), per)

    def record_span(self, task: str, h: torch.Tensor, V: torch.Tensor) -> None:
        """Re-asked rows `h` (rows, d) of `task`, whose linear map reads the span of `V`
        (d, r): their off-span shares added to the task's sum (Q made once per key)."""
        if h.shape[0] == 0:
            return
        q = self.bases.get(task)
        if q is None or q.device != h.device:
            if len(self.bases) >= CAP:
                self.bases = {}
            q = self.bases[task] = span_basis(V.float())
        share = off_span_share(h.float(), q)
        slot = self._slot(task, h.device)
        assert self.acc is not None
        self.acc[slot, 2] += share.sum()
        self.acc[slot, 3] += share.shape[0]

    def _slot(self, task: str, device: torch.device) -> int:
        if task not in self.slots and len(self.slots) >= CAP:
            self.slots, self.acc = {}, None  # keys come and go: start again
        slot = self.slots.setdefault(task, len(self.slots))
        if self.acc is None or self.acc.shape[0] <= slot:
            grown = torch.zeros(max(16, 2 * (slot + 1)), COLUMNS, device=device)
            if self.acc is not None:
                grown[: self.acc.shape[0]] = self.acc
            self.acc = grown
        return slot

    def read(self) -> dict[str, list[float]]:
        """{task key: [sum of ratios, rows, sum of off-span shares, rows re-asked]} (one
        device-to-host copy)."""
        if self.acc is None:
            return {}
        acc = self.acc.tolist()
        return {task: acc[slot] for task, slot in self.slots.items()}


def read_shift_sizes(worker: Any) -> dict[str, Any]:
    """Run on each worker by `collective_rpc`: its model's sums and its ranks (every
    tensor-parallel rank shifts the same rows: the reader keeps rank 0's)."""
    sizes = getattr(worker.get_model(), "_shift_sizes", None)
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        tp = get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no distributed state: one rank
        tp = 0
    config = getattr(worker, "vllm_config", None)
    dp = getattr(getattr(config, "parallel_config", None), "data_parallel_rank", 0) or 0
    return {"tp_rank": tp, "dp_rank": dp, "sizes": sizes.read() if sizes is not None else {}}


def serve_reads() -> None:
    """vLLM's workers (in this process) answer `collective_rpc(READ)` (idempotent). A name,
    not a function: the API server's message to the engine core carries a function only with
    VLLM_ALLOW_INSECURE_SERIALIZATION, and pre-pickled bytes reach a worker in a process of
    its own (MultiprocExecutor) pickled once more, which it cannot call."""
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(WorkerBase, READ, None) is not read_shift_sizes:
        setattr(WorkerBase, READ, read_shift_sizes)
