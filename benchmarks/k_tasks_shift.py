"""Where the cost of K distinct tasks in one step sits: the wrapper's shift alone, timed.

`benchmarks/k_tasks.py` times whole engines; this times one decode step's shift — the
wrapper's own `_shifted` (`vllm_ext.models.LTVMixin`), the code the engine runs — for R rows
split over K tasks, beside the LM head's product for the same rows (what every step pays
anyway), at a model's real shapes with random weights built on the device. It needs torch
only: on a machine without vLLM (the lent GPU machine) the vLLM classes the wrapper module
subclasses are stand-ins (`_stand_in_vllm`), never called here.

    python benchmarks/k_tasks_shift.py --hidden 576 --vocab 49152 --rank 256 --rows 256
    python benchmarks/k_tasks_shift.py --device cuda --hidden 4096 --vocab 128256 \\
        --rank 256 --rows 256 --dtype bfloat16        # Llama-3.1-8B's head
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types


def _stand_in_vllm() -> None:
    """Empty modules for the vLLM names `vllm_ext.models` and `engine.steps` import, where
    vLLM is not installed: their classes are only subclassed, never run, by this script."""
    import importlib.abc
    import importlib.machinery

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):  # noqa: ARG002
            if name == "vllm" or name.startswith("vllm."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            mod = types.ModuleType(spec.name)
            mod.__path__ = []

            def attr(name: str):
                if name.startswith("__"):
                    raise AttributeError(name)
                value = type(name, (), {}) if name[:1].isupper() else (lambda *_, **__: None)
                setattr(mod, name, value)
                return value

            mod.__getattr__ = attr
            return mod

        def exec_module(self, module):  # noqa: ARG002
            return None

    sys.meta_path.insert(0, Finder())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ks", default="1,8,64,256")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--stand-in", action="store_true",
                    help="use the vLLM stand-ins even where vLLM is installed (to test them)")
    a = ap.parse_args()
    if a.stand_in:
        _stand_in_vllm()
    else:
        try:
            import vllm  # noqa: F401
        except ImportError:
            _stand_in_vllm()
    import torch

    from ltv_vllm.core.vector import ModelIdentity, TaskVector
    from ltv_vllm.serving.engine.models import LTVMixin

    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    ks = [int(k) for k in a.ks.split(",")]

    ident = ModelIdentity("random", a.hidden, a.vocab, "none")

    class Shift(LTVMixin):
        """The wrapper's shift with K named tasks, nothing else of a model."""

        def __init__(self, k: int) -> None:
            from collections import OrderedDict

            self._ltv, self._store, self._casts = None, None, {}
            self._cast_keys = OrderedDict()
            self._sizes = (a.hidden, a.vocab)
            self._vectors = {}
            for t in range(k):
                g = torch.Generator().manual_seed(t)
                self._vectors[f"t{t}"] = TaskVector(
                    "hidden", 0.02 * torch.randn(a.hidden, a.rank, generator=g),
                    torch.randn(a.hidden, a.rank, generator=g) / a.hidden ** 0.5, None,
                    ident, (0,), {"task": {"name": f"t{t}"}})

    def per_task_loop(shift, h, plan):
        """The shift as it was before `_shifted` gathered the tasks' rows once: a gather,
        a rank-r product and a scatter per task (the baseline the K cost was measured on)."""
        out = h.float()
        for task, rows in plan.items():
            idx = torch.tensor(rows if rows is not None else range(h.shape[0]),
                               dtype=torch.long)
            idx = idx if dev.type == "cpu" else idx.pin_memory().to(dev, non_blocking=True)
            delta = shift._ltv_delta(h.index_select(0, idx), task=task)
            out[idx, : delta.shape[-1]] += delta
        return out

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t)
        return best

    h = torch.randn(a.rows, a.hidden, device=dev, dtype=dtype)
    head = torch.randn(a.vocab, a.hidden, device=dev, dtype=dtype) / a.hidden ** 0.5
    lm_head = timed(lambda: h @ head.T)
    rows = []
    for k in ks:
        shift = Shift(k)
        plan = ({"t0": None} if k == 1 else
                {f"t{t}": [r for r in range(a.rows) if r % k == t] for t in range(k)})
        plan = {t: r for t, r in plan.items() if r != []}
        s = timed(lambda plan=plan, shift=shift: shift._shifted(h, plan, "hidden", h))
        loop = timed(lambda plan=plan, shift=shift: per_task_loop(shift, h, plan))
        rows.append({"K": k, "distinct_tasks": len(plan), "shift_ms": round(s * 1e3, 3),
                     "per_task_loop_ms": round(loop * 1e3, 3),
                     "lm_head_ms": round(lm_head * 1e3, 3),
                     "shift_over_lm_head": round(s / lm_head, 3)})
        print(f"K={k:4d} ({len(plan):3d} distinct) shift {s * 1e3:8.3f} ms (a gather and a "
              f"scatter per task: {loop * 1e3:8.3f} ms)   LM head {lm_head * 1e3:8.3f} ms   "
              f"ratio {s / lm_head:.3f}", flush=True)
        del shift
    from ltv_vllm.models.hardware import hardware

    res = {"command": " ".join(["python", "benchmarks/k_tasks_shift.py", *sys.argv[1:]]),
           "machine": {**hardware(), "device": torch.cuda.get_device_name()
                       if dev.type == "cuda" else "cpu", "torch": torch.__version__},
           "args": vars(a), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
