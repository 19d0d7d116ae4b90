"""Where the cost of K distinct tasks in one step sits: the wrapper's shift alone, timed.

`benchmarks/k_tasks.py` times whole engines; this times one decode step's shift — the
wrapper's own `_shifted` (`engine.models.LTVMixin`), the code the engine runs — for R rows
split over K tasks (row i names task i mod K), beside the LM head's product for the same
rows (what every step pays anyway), at a model's real shapes with random weights built on
the device. It needs torch only (and Triton for the grouped kernel): on a machine without
vLLM (the GPU machine) the vLLM classes the wrapper module subclasses are stand-ins
(`_stand_in_vllm`), never called here.

Per rank and K it times each of `--paths`, host work included (the index lists the engine
builds every step), the fastest of `--repeats`:

  served    what an engine on this device selects (`uses_grouped_shift`)
  grouped   the grouped kernel (`engine.grouped_shift`), forced
  batched   without it: small tasks in two batched products on a GPU, one product per task
            on a CPU (`batches_small_tasks`)
  loop      a gather, a product and a scatter per task (the code before either)

and beside them the floor, reading each distinct task's U and V once: K · 2 · d · r
elements, in bf16 (2 bytes) and in the slots' float32, at the bandwidth of a device copy
timed in the same run. `--variants SLOTS:PRECISION,...` times the grouped kernels alone
(`grouped_shift.launch`) for other slot dtypes and Triton dot precisions, captured in a CUDA
graph and replayed (device time, no host work; on a CPU: eager, Triton's interpreter), each
with its largest error against a float64 shift.

`--decode SHAPE[:L1,L2]` times one decode step of that shape (tests/fixtures/configs; random
bf16 weights built on the device) at `--decode-batch` rows after a prefill of
`--decode-ctx` tokens each, through transformers (eager, no CUDA graphs: above what vLLM
takes), and its roofline (weights and KV cache read once at the copy bandwidth). With two
layer counts the step is measured at both and extrapolated linearly to the shape's depth
(a 70B model's weights do not fit one GPU beside its cache).

    python benchmarks/k_tasks_shift.py --hidden 576 --vocab 49152 --ranks 256 --rows 256
    python benchmarks/k_tasks_shift.py --device cuda --hidden 4096 --vocab 128256 \\
        --ranks 16,64,256 --rows 256 --dtype bfloat16 \\
        --variants float32:ieee,float32:tf32x3,bfloat16:ieee --decode llama-3.1-8b
    python benchmarks/k_tasks_shift.py --report RESULT.json... > results.md

`--layer` times layer tasks instead: one decoder block's maps (`engine.layer_rows.
LayerRows._layer_maps`, the engine's code) for R rows over K distinct layer-map tasks of
rank r, by `served`, `grouped` (the kernel forced: one slot per task and block) and `loop`
(one request group at a time), each with its largest error against a float64 shift.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from collections import OrderedDict


def _stand_in_vllm() -> None:
    """Empty modules for the vLLM names `engine.models` and `engine.steps` import, where
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--ranks", "--rank", default="256", help="comma-separated ranks")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dtype", default="float32", help="the hidden states' dtype")
    ap.add_argument("--ks", default="1,8,64,256")
    ap.add_argument("--paths", default=None,
                    help="served,grouped,batched,loop (default: all a device runs well: "
                         "grouped only on CUDA)")
    ap.add_argument("--variants", default="",
                    help="slot dtype:Triton dot precision pairs, e.g. float32:ieee,"
                         "bfloat16:tf32 (the grouped kernels alone)")
    ap.add_argument("--decode", action="append", default=[],
                    help="SHAPE or SHAPE:L1,L2 (repeatable): a decode step of that shape")
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--decode-ctx", default="512,128",
                    help="context lengths timed, longest first (one prefill, then cropped)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--layer", action="store_true",
                    help="layer tasks: one decoder block's maps of K tasks (not the head's)")
    ap.add_argument("--stand-in", action="store_true",
                    help="use the vLLM stand-ins even where vLLM is installed (to test them)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    if a.stand_in:
        _stand_in_vllm()
    else:
        try:
            import vllm  # noqa: F401
        except ImportError:
            _stand_in_vllm()
    import torch

    from ltv_vllm.core.vector import ModelIdentity, TaskVector
    from ltv_vllm.serving.engine import grouped_shift, models
    from ltv_vllm.serving.engine.models import LTVMixin

    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    ks = [int(k) for k in a.ks.split(",")]
    ranks = [int(r) for r in a.ranks.split(",")]
    cuda = dev.type == "cuda"
    paths = (a.paths.split(",") if a.paths else
             ["served", "grouped", "batched", "loop"] if cuda else ["served", "loop"])
    ident = ModelIdentity("random", a.hidden, a.vocab, "none")

    def vectors(k: int, rank: int) -> dict[str, TaskVector]:
        out = {}
        for t in range(k):  # drawn on the device (the engine's casts are then no-ops)
            g = torch.Generator(device=dev).manual_seed(t)
            out[f"t{t}"] = TaskVector(
                "hidden", 0.02 * torch.randn(a.hidden, rank, generator=g, device=dev),
                torch.randn(a.hidden, rank, generator=g, device=dev) / a.hidden ** 0.5, None,
                ident, (0,), {"task": {"name": f"t{t}"}})
        return out

    class Shift(LTVMixin):
        """The wrapper's shift with K named tasks, nothing else of a model."""

        def __init__(self, vecs: dict[str, TaskVector], grouped: bool | None) -> None:
            self._ltv, self._store, self._casts = None, None, {}
            self._cast_keys = OrderedDict()
            self._sizes = (a.hidden, a.vocab)
            self._shift_sizes = None
            self._vectors = vecs
            self._grouped_choice, self._slot_tables = grouped, {}

    def per_task_loop(shift, h, plan):
        """The shift before `_shifted` gathered the tasks' rows once: a gather, a rank-r
        product and a scatter per task."""
        out = h.float()
        for task, rows in plan.items():
            idx = torch.tensor(rows if rows is not None else range(h.shape[0]),
                               dtype=torch.long)
            idx = idx if not cuda else idx.pin_memory().to(dev, non_blocking=True)
            delta = shift._ltv_delta(h.index_select(0, idx), task=task)
            out[idx, : delta.shape[-1]] += delta
        return out

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        """The fastest of `repeats` calls after one warm-up, seconds, host work included."""
        fn()
        sync()
        best = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t)
        return best

    def copy_bandwidth() -> float:
        """Bytes through memory per second (read + written) by a device copy of 1 GiB
        (64 MiB on a CPU), the best of a few: reading B bytes once takes at least B / this."""
        n = (1 << 28) if cuda else (1 << 24)
        x = torch.empty(n, device=dev, dtype=torch.float32)
        y = torch.empty_like(x)
        return 2 * 4 * n / timed(lambda: y.copy_(x))

    bw = copy_bandwidth()
    print(f"device copy: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    if a.layer:
        return finish(a, argv, torch, cuda, models, bw,
                      {"layer_rows": layer_maps(a, torch, models, paths, ks, ranks, dev, dtype,
                                                timed, bw)})

    h = torch.randn(a.rows, a.hidden, device=dev, dtype=dtype)
    head = torch.randn(a.vocab, a.hidden, device=dev, dtype=dtype) / a.hidden ** 0.5
    lm_head = timed(lambda: h @ head.T)
    choices = {"served": None, "grouped": True, "batched": False}
    rows, kernel_rows = [], []
    for rank in ranks:
        for k in ks:
            vecs = vectors(k, rank)
            plan = ({"t0": None} if k == 1 else
                    {f"t{t}": [r for r in range(a.rows) if r % k == t] for t in range(k)})
            plan = {t: r for t, r in plan.items() if r != []}
            n_tasks = len(plan)
            floor = {f"floor_ms_{name}": round(1e3 * n_tasks * 2 * a.hidden * rank * b / bw,
                                               4) for name, b in (("bf16", 2), ("float32", 4))}
            row = {"K": k, "rank": rank, "distinct_tasks": n_tasks, **floor,
                   "lm_head_ms": round(lm_head * 1e3, 4)}
            for path in paths:
                shift = Shift(vecs, choices.get(path))
                if path == "loop":
                    fn = lambda shift=shift, plan=plan: per_task_loop(shift, h, plan)  # noqa: E731
                else:
                    fn = lambda shift=shift, plan=plan: shift._shifted(  # noqa: E731
                        h, plan, "hidden", h)
                row[f"{path}_ms"] = round(timed(fn) * 1e3, 4)
                if path == "served":
                    row["served_is_grouped"] = bool(shift._grouped_shift(dev))
                del shift
            rows.append(row)
            print(f"r={rank:3d} K={k:4d} ({n_tasks:3d} tasks) "
                  + "  ".join(f"{p} {row[p + '_ms']:8.3f}" for p in paths)
                  + f"  | floor bf16 {row['floor_ms_bf16']:.3f} f32 {row['floor_ms_float32']:.3f}"
                  f"  LM head {row['lm_head_ms']:.3f} ms", flush=True)
            if a.variants:
                kernel_rows += kernel_variants(a, torch, grouped_shift, vecs, plan, h, rank,
                                               dev, bw)
            del vecs
    decode = [decode_step(a, torch, spec, dev, bw) for spec in a.decode]
    return finish(a, argv, torch, cuda, models, bw,
                  {"rows": rows, "kernels": kernel_rows, "decode": decode})


def finish(a, argv, torch, cuda, models, bw, found: dict) -> dict:
    """The run's record (written to --out): command, machine, arguments and `found`."""
    import importlib.util

    from ltv_vllm.models.hardware import hardware

    triton = (importlib.import_module("triton").__version__
              if importlib.util.find_spec("triton") else None)
    argv = list(argv if argv is not None else sys.argv[1:])
    out = None
    if a.out:  # results record the file's name, not where the run kept it
        argv = [os.path.basename(x) if x == a.out else x for x in argv]
        a.out, out = os.path.basename(a.out), a.out
    res = {"command": " ".join(["python", "benchmarks/k_tasks_shift.py", *argv]),
           "machine": {**hardware(), "device": torch.cuda.get_device_name()
                       if cuda else "cpu", "torch": torch.__version__, "triton": triton},
           "args": vars(a), "copy_bandwidth_bytes_per_s": bw, **found,
           "grouped_default_env": models.GROUPED_ENV}
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    return res


def layer_maps(a, torch, models, paths, ks, ranks, dev, dtype, timed, bw) -> list[dict]:
    """One block's layer maps of K distinct tasks (row i: task i mod K) by each path, timed
    (the fastest of `repeats`, host work included) and checked against a float64 shift."""
    from ltv_vllm.core.layer_task import LayerTask
    from ltv_vllm.core.vector import ModelIdentity

    ident = ModelIdentity("random", a.hidden, a.vocab, "none", 1)
    choice = {"served": None, "grouped": True, "loop": False}
    out = []
    for rank in ranks:
        for k in ks:
            tasks = {}
            for t in range(k):
                g = torch.Generator(device=dev).manual_seed(t)
                tasks[f"t{t}"] = LayerTask(
                    layers=(0,), bias=None, model=ident,
                    U=0.02 * torch.randn(1, a.hidden, rank, generator=g, device=dev),
                    V=torch.randn(1, a.hidden, rank, generator=g, device=dev) / a.hidden ** .5)
            maps = [(((f"t{t}", 1.0),),
                     torch.tensor([r for r in range(a.rows) if r % k == t], device=dev))
                    for t in range(min(k, a.rows))]
            hidden = torch.randn(a.rows, a.hidden, device=dev, dtype=dtype)
            residual = torch.randn(a.rows, a.hidden, device=dev, dtype=dtype)
            x = hidden.double() + residual.double()
            want = hidden.double().clone()
            for (parts, idx) in maps:
                lt = tasks[parts[0][0]]
                want[idx] += (x[idx] @ lt.V[0].double()) @ lt.U[0].double().T
            row = {"K": k, "rank": rank, "distinct_tasks": len(maps),
                   "floor_ms_float32": round(1e3 * len(maps) * 2 * a.hidden * rank * 4 / bw, 4)}
            for path in [p for p in paths if p in choice]:
                rows = models.LTVMixin.__new__(models.LTVMixin)
                rows._layer_tasks, rows._layer_casts, rows._layer_slots = tasks, {}, {}
                rows._grouped_choice = choice[path]
                if choice[path] is None:
                    rows._grouped_choice = models.uses_grouped_shift(dev)
                h = hidden.clone()
                rows._layer_maps(h, residual, maps, 0)
                scale = float((want - hidden.double()).abs().max())
                row[f"{path}_max_rel_error"] = float((h.double() - want).abs().max()) / scale
                row[f"{path}_ms"] = round(1e3 * timed(
                    lambda rows=rows, hidden=hidden, residual=residual, maps=maps:
                    rows._layer_maps(hidden.clone(), residual, maps, 0)), 4)
            out.append(row)
            print(f"layer r={rank:3d} K={k:4d} " + "  ".join(
                f"{p} {row[p + '_ms']:8.3f} ms (err {row[p + '_max_rel_error']:.1e})"
                for p in paths if p in choice), flush=True)
    return out


def kernel_variants(a, torch, grouped_shift, vecs, plan, h, rank, dev, bw) -> list[dict]:
    """The grouped kernels alone per slot dtype and dot precision: device time of a CUDA
    graph's replay (eager on a CPU) and the largest error against a float64 shift."""
    cuda = dev.type == "cuda"
    tasks = list(plan)
    rows = [r for t in tasks for r in (range(h.shape[0]) if plan[t] is None else plan[t])]
    starts = [0]
    for t in tasks:
        starts.append(starts[-1] + (h.shape[0] if plan[t] is None else len(plan[t])))
    most = max(e - s for s, e in zip(starts, starts[1:], strict=False))
    # the reference: every row's own task in float64
    h64 = h.double()
    ref = torch.zeros(h.shape[0], a.hidden, dtype=torch.float64, device=dev)
    for t in tasks:
        idx = list(range(h.shape[0])) if plan[t] is None else plan[t]
        tv = vecs[t]
        ref[idx] = (h64[idx] @ tv.V.double()) @ tv.U.double().T
    scale = float(ref.abs().max())
    out_rows = []
    for spec in a.variants.split(","):
        slot_dtype, precision = spec.split(":")
        table = grouped_shift.TaskSlots(a.hidden, a.hidden, rank, dev,
                                        dtype=getattr(torch, slot_dtype), capacity=len(tasks))
        slots = [table.of(t, vecs[t].U, vecs[t].V, set(tasks)) for t in tasks]
        idx = torch.tensor([*rows, *starts, *slots], dtype=torch.int32, device=dev)
        rows_t, start_t, slot_t = idx.split([len(rows), len(starts), len(slots)])
        out = torch.zeros(h.shape[0], a.hidden, device=dev, dtype=torch.float32)

        def run(table=table, out=out, rows_t=rows_t, start_t=start_t, slot_t=slot_t,
                precision=precision):
            grouped_shift.launch(h, rows_t, start_t, slot_t, most, table.v, table.u, out,
                                 precision=precision)

        run()  # compiles
        err = float((out.double() - ref).abs().max()) / scale
        if cuda:
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            n = max(a.repeats, 50)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / n
            captured = True
        else:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
            ms, captured = 1e3 * min(times), False
        factor_bytes = len(tasks) * 2 * a.hidden * rank * table.v.element_size()
        row = {"K": len(plan), "rank": rank, "slots": slot_dtype, "precision": precision,
               "kernel_ms": round(ms, 4), "graph_captured": captured,
               "max_rel_error": err,
               "factor_GBps": round(factor_bytes / (ms / 1e3) / 1e9, 1),
               "of_copy_bandwidth": round(factor_bytes / (ms / 1e3) / bw, 3)}
        print(f"    kernels {slot_dtype}:{precision:7s} {ms:8.3f} ms  factors at "
              f"{row['factor_GBps']:7.1f} GB/s ({row['of_copy_bandwidth']:.2f} of a copy's "
              f"rate)  max rel error {err:.1e}", flush=True)
        out_rows.append(row)
        del table, out
    return out_rows


def decode_step(a, torch, spec: str, dev, bw) -> dict:
    """One decode step of a shape at `decode_batch` rows, per context length: the fastest of
    a few (the cache cropped back after each), and its roofline."""
    from ltv_vllm.bench.device_extraction import build_on_device, shape_config

    shape, _, layer_spec = spec.partition(":")
    cfg = shape_config(shape)
    depth, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    layer_counts = [int(x) for x in layer_spec.split(",")] if layer_spec else [depth]
    ctxs = [int(c) for c in a.decode_ctx.split(",")]
    cuda = dev.type == "cuda"
    wdtype = torch.bfloat16 if cuda else torch.float32
    b = a.decode_batch
    measured: dict[int, dict[int, float]] = {}
    weight_bytes: dict[int, int] = {}
    kv_per_token_layer = 2 * int(cfg["num_key_value_heads"]) * int(
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) * 2
    for layers in layer_counts:
        model = build_on_device(shape, vocab, str(dev), wdtype, layers)
        # what a step reads: every weight but the input embedding (one row per sequence)
        weight_bytes[layers] = sum(p.numel() * p.element_size()
                                   for name, p in model.named_parameters()
                                   if "embed_tokens" not in name)
        g = torch.Generator(device=dev).manual_seed(0)
        ids = torch.randint(0, vocab, (b, ctxs[0]), device=dev, generator=g)
        nxt = torch.randint(0, vocab, (b, 1), device=dev, generator=g)
        measured[layers] = {}
        with torch.no_grad():
            cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values

            def crop(ctx: int, cache=cache) -> None:  # a negative crop drops that many
                if (extra := cache.get_seq_length() - ctx) > 0:
                    cache.crop(-extra)

            for ctx in ctxs:
                crop(ctx)
                times = []
                for _ in range(6):
                    if cuda:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    model(nxt, past_key_values=cache, use_cache=True)
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                    crop(ctx)
                measured[layers][ctx] = min(times[1:])
        del model, cache, ids
        if cuda:
            torch.cuda.empty_cache()
        print(f"  decode {shape} at {layers} layers, batch {b}: "
              + ", ".join(f"ctx {c}: {1e3 * t:.2f} ms" for c, t in measured[layers].items()),
              flush=True)
    rows = []
    for ctx in ctxs:
        if len(layer_counts) == 1:
            step = measured[layer_counts[0]][ctx]
            wbytes = weight_bytes[layer_counts[0]]
        else:
            (l1, l2) = layer_counts[:2]
            per_layer = (measured[l2][ctx] - measured[l1][ctx]) / (l2 - l1)
            step = measured[l2][ctx] + (depth - l2) * per_layer
            per_layer_bytes = (weight_bytes[l2] - weight_bytes[l1]) / (l2 - l1)
            wbytes = int(weight_bytes[l2] + (depth - l2) * per_layer_bytes)
        kv = depth * b * ctx * kv_per_token_layer
        rows.append({"shape": shape, "layers": depth, "measured_layers": layer_counts,
                     "batch": b, "ctx": ctx, "step_ms": round(1e3 * step, 3),
                     "weights_GB": round(wbytes / 1e9, 2), "kv_GB": round(kv / 1e9, 2),
                     "roofline_ms": round(1e3 * (wbytes + kv) / bw, 3),
                     "extrapolated": len(layer_counts) > 1,
                     "per_ctx_measured_ms": {str(lc): round(1e3 * m[ctx], 3)
                                             for lc, m in measured.items()}})
        how = ", extrapolated" if len(layer_counts) > 1 else ""
        print(f"  decode {shape} ({depth} layers{how})"
              f" batch {b} ctx {ctx}: {rows[-1]['step_ms']:.2f} ms, roofline "
              f"{rows[-1]['roofline_ms']:.2f} ms (weights {rows[-1]['weights_GB']} GB, KV "
              f"{rows[-1]['kv_GB']} GB)", flush=True)
    return {"shape": shape, "rows": rows}


def report(paths: list[str]) -> str:
    """results.md from result files of this script (one per model width): the shift per
    path, rank and K against the floor, and what it costs a decode step at K = 256."""
    docs = [json.loads(open(p).read()) for p in paths]
    m = docs[0]["machine"]
    bws = [d["copy_bandwidth_bytes_per_s"] for d in docs]
    out = ["# One step's shift of K distinct tasks, against the floor and a decode step", "",
           "```", *(d["command"] for d in docs), "```", "",
           f"{m.get('device')} (torch {m.get('torch')}, Triton {m.get('triton')}); random "
           f"weights built on the device; {docs[0]['args']['rows']} rows, bf16 hidden states, "
           "row i naming task i mod K. Times in ms: host work included for the paths (the "
           "fastest of 20), device time alone for the kernels (a CUDA graph's replay). The "
           "floor reads each distinct task's U and V once at a device copy's rate "
           f"({', '.join(f'{bw / 1e12:.2f}' for bw in bws)} TB/s, read + written).", ""]
    for d in docs:
        a = d["args"]
        kern = {(r["rank"], r["K"], r["slots"], r["precision"]): r for r in d["kernels"]}
        out += [f"## Width {a['hidden']}, vocabulary {a['vocab']}", "",
                "| rank | K | served | grouped | batched | loop | kernels alone | of a copy's "
                "rate | floor float32 | floor bf16 | bf16 slots, kernels | LM head |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in d["rows"]:
            k32 = kern.get((r["rank"], r["distinct_tasks"], "float32", "tf32x3"), {})
            k16 = kern.get((r["rank"], r["distinct_tasks"], "bfloat16", "tf32"), {})
            out.append(f"| {r['rank']} | {r['K']} | {r.get('served_ms', '–')} | "
                       f"{r.get('grouped_ms', '–')} | {r.get('batched_ms', '–')} | "
                       f"{r.get('loop_ms', '–')} | {k32.get('kernel_ms', '–')} | "
                       f"{k32.get('of_copy_bandwidth', '–')} | {r['floor_ms_float32']} | "
                       f"{r['floor_ms_bf16']} | {k16.get('kernel_ms', '–')} | "
                       f"{r['lm_head_ms']} |")
        errs = {}
        for r in d["kernels"]:
            errs.setdefault(f"{r['slots']}:{r['precision']}", []).append(r["max_rel_error"])
        out += ["", "Largest error against a float64 shift, over every rank and K: "
                + ", ".join(f"{v} {max(e):.1e}" for v, e in errs.items()) + ".", ""]
        for dec in d["decode"]:
            out += [f"Decode step of {dec['shape']} at batch {dec['rows'][0]['batch']} "
                    "(transformers, eager"
                    + (", measured at " + " and ".join(map(str, dec["rows"][0]
                                                          ["measured_layers"]))
                       + " layers and extrapolated" if dec["rows"][0]["extrapolated"] else "")
                    + "), and the step-time ratio step / (step + shift) at K = 256:", "",
                    "| ctx | step | roofline | rank | served vs step | kernels vs roofline "
                    "| bf16 floor vs roofline |", "|---|---|---|---|---|---|---|"]
            for row in dec["rows"]:
                for r in d["rows"]:
                    if r["K"] != 256:
                        continue
                    k32 = kern.get((r["rank"], r["distinct_tasks"], "float32", "tf32x3"))
                    shift = r.get("served_ms")
                    ratio = (lambda step, sh: f"{step / (step + sh):.3f}"  # noqa: E731
                             if sh is not None else "–")
                    out.append(f"| {row['ctx']} | {row['step_ms']} | {row['roofline_ms']} | "
                               f"{r['rank']} | {ratio(row['step_ms'], shift)} | "
                               f"{ratio(row['roofline_ms'], k32 and k32['kernel_ms'])} | "
                               f"{ratio(row['roofline_ms'], r['floor_ms_bf16'])} |")
            out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--report"]:
        print(report(sys.argv[2:]))
    else:
        main()
