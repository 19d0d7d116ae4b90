"""Many distinct tasks in one step at one pass over each task's factors: a grouped shift.

Runs in vLLM's engine worker processes (called by `engine.models`' row plan); pure tensor
maths and two Triton kernels, no vLLM import.

The per-request shift h + U (Vᵀ h), each row with its own task, is a LoRA's shrink and
expand on one module. The rows arrive sorted by task (`LTVMixin._shifted` gathers them in
task order), so task t owns the contiguous rows [start_t, start_{t+1}). Each task's factors
live in one slot of a device table (`TaskSlots`: written once, on the task's first use), and

  * `_shrink` computes z = h V for a block of one task's rows, reading that task's V once;
  * `_expand` computes Δ = z Uᵀ for the same rows and a block of output columns, reading
    that task's U once.

So a step reads every distinct task's U and V once: K · (d + d_out) · r elements, the floor
of a grouped matmul. The factors are stored in float32 (`TaskSlots.dtype`) and both
products keep float32's precision (the fidelity rule of `LTVMixin._ltv_delta`):
`PRECISION = "tf32x3"` splits each float32 operand into two TF32 parts and sums three
tensor-core products, accumulating in float32. On an NVIDIA H200 (docs/benchmarks.md, "Many
distinct tasks in one batch") that read the factors at 0.99–1.00 of a device copy's rate at
K = 256, rank 256, with a largest error of 4.7e-7 against a float64 shift over every rank
and K, where Triton's "ieee" products (FMA, no tensor cores) ran 2.8× slower at 2.6e-6;
bfloat16 slots would halve the bytes but err by 3e-3, six thousand times more.

Why our own kernels and not vLLM's `lora_shrink` / `lora_expand` (which do the same
grouping): those take only fp16/bf16 inputs and weights (they assert it), so the float32
shift the serving path promises could not run through them, and their metadata
(`LoRAKernelMeta`) is tied to the LoRA manager's slot mapping and CUDA-graph capture sizes.
"""

from __future__ import annotations

from typing import Any

import torch

PRECISION = "tf32x3"  # Triton dot precision: float32 precision on tensor cores (above)
BLOCK_M = 16  # rows of one task per program (the usual task has one or two rows a step)


def _kernels() -> tuple[Any, Any]:
    """The two Triton kernels, compiled on first use (Triton imported only here: a CPU
    engine never reaches this)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def shrink(h_ptr, v_ptr, z_ptr, rows_ptr, start_ptr, slot_ptr, D, R,
               stride_h, stride_vs, stride_vd, stride_z,
               PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_K: tl.constexpr):
        seg = tl.program_id(0)
        start = tl.load(start_ptr + seg)
        end = tl.load(start_ptr + seg + 1)
        m0 = start + tl.program_id(1) * BLOCK_M
        if m0 < end:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            in_m = offs_m < end
            rows = tl.load(rows_ptr + offs_m, mask=in_m, other=0)  # sorted position → row
            slot = tl.load(slot_ptr + seg).to(tl.int64)
            offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + offs_k[None, :],
                            mask=in_m[:, None] & (offs_k[None, :] < D), other=0.0)
                b = tl.load(v_ptr + slot * stride_vs + offs_k[:, None] * stride_vd
                            + offs_r[None, :],
                            mask=(offs_k[:, None] < D) & (offs_r[None, :] < R), other=0.0)
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
            tl.store(z_ptr + offs_m[:, None].to(tl.int64) * stride_z + offs_r[None, :], acc,
                     mask=in_m[:, None] & (offs_r[None, :] < R))

    @triton.jit
    def expand(z_ptr, u_ptr, out_ptr, rows_ptr, start_ptr, slot_ptr, DOUT, R,
               stride_z, stride_us, stride_ud, stride_out,
               PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_R: tl.constexpr):
        seg = tl.program_id(0)
        start = tl.load(start_ptr + seg)
        end = tl.load(start_ptr + seg + 1)
        m0 = start + tl.program_id(1) * BLOCK_M
        if m0 < end:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            in_m = offs_m < end
            rows = tl.load(rows_ptr + offs_m, mask=in_m, other=0)
            slot = tl.load(slot_ptr + seg).to(tl.int64)
            offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, R, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                z = tl.load(z_ptr + offs_m[:, None].to(tl.int64) * stride_z + offs_r[None, :],
                            mask=in_m[:, None] & (offs_r[None, :] < R), other=0.0)
                u = tl.load(u_ptr + slot * stride_us + offs_n[None, :] * stride_ud
                            + offs_r[:, None],
                            mask=(offs_r[:, None] < R) & (offs_n[None, :] < DOUT), other=0.0)
                acc += tl.dot(z, u.to(tl.float32), input_precision=PRECISION)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + offs_n[None, :],
                     acc, mask=in_m[:, None] & (offs_n[None, :] < DOUT))

    _KERNELS = (shrink, expand)
    return _KERNELS


_KERNELS: tuple[Any, Any] | None = None


def _block(n: int, most: int) -> int:
    """The smallest power of two ≥ n, between 16 (tl.dot's least) and `most`."""
    b = 16
    while b < n and b < most:
        b *= 2
    return b


def grouped_delta(h: torch.Tensor, rows: list[int], starts: list[int], slots: list[int],
                  v_table: torch.Tensor, u_table: torch.Tensor, out: torch.Tensor, *,
                  precision: str = PRECISION) -> None:
    """out[rows[i]] = U_s (V_sᵀ h[rows[i]]) for the slot s of the task owning position i.

    `h` (n, d): the step's states (any float dtype); `rows`: the rows of h (and of `out`)
    to shift, sorted by task; `starts` (T + 1,): task t owns positions [starts[t],
    starts[t+1]) of `rows`; `slots` (T,): its slot in the tables; `v_table` (S, d, r),
    `u_table` (S, d_out, r): every slot's V and U (a task of lower rank zero-padded);
    `out` (n, ≥ d_out) float32, its other rows untouched."""
    m = len(rows)
    if m == 0 or not slots:
        return
    # one host→device copy of the step's small index tensors, from pinned memory so the
    # host does not wait for it (as `steps.row_index`)
    idx = torch.tensor([*rows, *starts, *slots], dtype=torch.int32)
    if h.device.type != "cpu":
        idx = idx.pin_memory().to(h.device, non_blocking=True)
    rows_t, start_t, slot_t = idx.split([m, len(starts), len(slots)])
    most = max(e - s for s, e in zip(starts, starts[1:], strict=False))
    launch(h, rows_t, start_t, slot_t, most, v_table, u_table, out, precision=precision)


def launch(h: torch.Tensor, rows_t: torch.Tensor, start_t: torch.Tensor, slot_t: torch.Tensor,
           most: int, v_table: torch.Tensor, u_table: torch.Tensor, out: torch.Tensor, *,
           precision: str = PRECISION) -> None:
    """The two kernels of `grouped_delta` on index tensors already on the device (int32:
    `rows_t` (m,), `start_t` (T + 1,), `slot_t` (T,)); `most`: the most rows of one task.
    No host→device copy, so a CUDA graph can capture it (`benchmarks/k_tasks_shift.py`)."""
    shrink, expand = _kernels()
    m, d = rows_t.shape[0], h.shape[1]
    r, d_out, n_tasks = v_table.shape[2], u_table.shape[1], slot_t.shape[0]
    assert out.dtype == torch.float32 and out.stride(1) == 1 and h.stride(1) == 1
    z = torch.empty(m, r, device=h.device, dtype=torch.float32)  # in `rows`' order
    block_r = _block(r, 64)
    grid_m = -(-most // BLOCK_M)
    shrink[(n_tasks, grid_m, -(-r // block_r))](
        h, v_table, z, rows_t, start_t, slot_t, d, r, h.stride(0), v_table.stride(0),
        v_table.stride(1), z.stride(0), PRECISION=precision, BLOCK_M=BLOCK_M,
        BLOCK_R=block_r, BLOCK_K=_block(d, 64))
    block_n = _block(d_out, 128)
    expand[(n_tasks, grid_m, -(-d_out // block_n))](
        z, u_table, out, rows_t, start_t, slot_t, d_out, r, z.stride(0), u_table.stride(0),
        u_table.stride(1), out.stride(0), PRECISION=precision, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_R=_block(r, 32))


class TaskSlots:
    """Device tables of tasks' factors for `grouped_delta`: V (S, d, r) and U (S, d_out, r),
    a task written into a free slot on its first use and kept until it is the least
    recently used of more than `capacity` (the tables grow by doubling up to it). Ranks
    below `rank` are zero-padded (their extra columns add nothing)."""

    def __init__(self, d: int, d_out: int, rank: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, capacity: int = 256) -> None:
        self.d, self.d_out, self.rank, self.capacity = d, d_out, rank, capacity
        self.device, self.dtype = device, dtype
        self.v = torch.zeros(0, d, rank, device=device, dtype=dtype)
        self.u = torch.zeros(0, d_out, rank, device=device, dtype=dtype)
        self.slot: dict[str, int] = {}  # task → slot, least recently used first
        self.free: list[int] = []

    def of(self, task: str, U: torch.Tensor, V: torch.Tensor, pinned: set[str]) -> int:
        """`task`'s slot, its factors written there on first use. `pinned`: the tasks of
        this step, never evicted to make room (more of them than `capacity`: an error)."""
        if task in self.slot:
            self.slot[task] = self.slot.pop(task)  # most recently used
            return self.slot[task]
        if U.shape[1] > self.rank or U.shape[0] != self.d_out or V.shape[0] != self.d:
            raise ValueError(f"task {task!r}: factors {tuple(U.shape)}, {tuple(V.shape)} do not "
                             f"fit slots of ({self.d_out}, {self.d}) at rank ≤ {self.rank}")
        if not self.free:
            if self.v.shape[0] < self.capacity:
                self._grow()
            else:
                victim = next((t for t in self.slot if t not in pinned), None)
                if victim is None:
                    raise RuntimeError(f"{len(pinned)} tasks in one step, over the "
                                       f"{self.capacity} slots of the grouped shift")
                self.free.append(self.slot.pop(victim))
        s = self.free.pop()
        r = U.shape[1]
        self.v[s].zero_()
        self.u[s].zero_()
        self.v[s, :, :r].copy_(V)
        self.u[s, :, :r].copy_(U)
        self.slot[task] = s
        return s

    def _grow(self) -> None:
        old = self.v.shape[0]
        new = min(self.capacity, max(8, 2 * old))
        v = torch.zeros(new, self.d, self.rank, device=self.device, dtype=self.dtype)
        u = torch.zeros(new, self.d_out, self.rank, device=self.device, dtype=self.dtype)
        v[:old].copy_(self.v)
        u[:old].copy_(self.u)
        self.v, self.u = v, u
        self.free.extend(range(new - 1, old - 1, -1))
