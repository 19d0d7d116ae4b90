"""`ltv-vllm bench extraction --shape NAME`: the whole `extract()` (capture, fit, test
scoring) at a real model's shape, on the device, per batch size.

The model is built with random weights at a config's shape (tests/fixtures/configs: decoder
sizes as published; the vocabulary is the tokenizer's, so the LM head is the packaged
model's size, not the real one's) directly on the device in the run's dtype — no checkpoint
on disk, 8B or 32B in a fraction of a second — with the packaged model's real tokenizer, so
the prompts have real lengths. Per batch size it records the wall time of `extract()` and
its parts, the positions the model computed (every token fed to the decoder, padding
included), the achieved FLOP/s counting 2 × body parameters × positions (attention's own
FLOPs left out: a floor), that as a fraction of a square matmul timed in the same run on the
same device and dtype, and the device's peak memory; then the shared-demo capture against
the reference code's naive one (batch 1, every prompt whole) on the same episode.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.models.hardware import machine_line

SHAPES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "configs"


def shapes() -> list[str]:
    return sorted(p.stem for p in SHAPES.glob("*.json"))


def shape_config(shape: str) -> dict[str, Any]:
    """A shape's config fields: a name of SHAPES, or the path of a config.json."""
    path = Path(shape) if shape.endswith(".json") else SHAPES / f"{shape}.json"
    return json.loads(path.read_text())


def build_on_device(shape: str, vocab: int, device: str, dtype: torch.dtype,
                    layers: int | None = None) -> Any:
    """A random-weight causal LM of `shape` (a config of SHAPES) with `vocab` tokens, built
    on `device` in `dtype` (no float32 copy, no host copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = shape_config(shape)
    cfg.update(vocab_size=vocab, pad_token_id=0, torch_dtype=str(dtype).removeprefix("torch."))
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    config = AutoConfig.for_model(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def body_parameters(model: Any) -> int:
    """Parameters of the decoder body: every weight but the embeddings and the LM head."""
    return sum(p.numel() for name, p in model.named_parameters()
               if "embed_tokens" not in name and "lm_head" not in name)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: str, dtype: torch.dtype, n: int | None = None) -> float:
    """FLOP/s of an n × n × n matmul on the device in `dtype` (8192 on a GPU, 1024 on a
    CPU), the best of a few after a warm-up."""
    n = n or (8192 if torch.device(device).type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


@contextmanager
def counted_positions(model: Any):
    """Counts the positions every forward of the decoder body computes (input_ids' size,
    padding included); yields a one-element list holding the count."""
    from ltv_vllm.extraction.capture import base_model

    seen = [0]

    def hook(_module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            seen[0] += int(ids.numel())

    handle = base_model(model).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def peak_memory(device: str) -> float | None:
    """GiB the device allocated at most since the last reset (CUDA), else None."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2 ** 30


def bench_device_extraction(shape: str, tokenizer_model: str, *, device: str, dtype: str,
                            batch_sizes: Sequence[int | str], task_name: str, k: int, n: int,
                            n_test: int, seed: int, naive: bool, out_dir: Path, command: str,
                            layers: int | None = None,
                            log: Callable[[str], None] = print) -> dict[str, Any]:
    from ltv_vllm.bench import report
    from ltv_vllm.bench.extraction import time_paths
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.core.vector import model_identity
    from ltv_vllm.extraction.capture import Capturer
    from ltv_vllm.models.hardware import resolve_dtype
    from ltv_vllm.models.loading import LoadedModel, load_tokenizer
    from ltv_vllm.pipeline.extract import ExtractOptions, extract, plan_episode
    from ltv_vllm.tasks.specs import get_task

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    dt = getattr(torch, resolve_dtype(dtype, device=device))
    tok = load_tokenizer(tokenizer_model)
    t0 = time.perf_counter()
    model = build_on_device(shape, len(tok), device, dt, layers)
    sync(device)
    build_s = time.perf_counter() - t0
    lm = LoadedModel(model, tok, f"random:{shape}", model_identity(model, f"random:{shape}"))
    task = get_task(task_name)
    episode = plan_episode(task, ExtractOptions(k=k, n=n, n_test=n_test, seed=seed))
    rate = matmul_rate(device, dt)
    body = body_parameters(model)
    log(f"{shape} ({body / 1e9:.2f} B body parameters, {dt}) on {device}: built in "
        f"{build_s:.2f} s; matmul {rate / 1e12:.1f} TFLOP/s")
    import transformers

    doc = {"command": command, "shape": shape, "layers": model.config.num_hidden_layers,
           "tokenizer": tokenizer_model, "vocab": len(tok), "device": device,
           "dtype": str(dt).removeprefix("torch."), "body_parameters": body,
           "build_seconds": build_s, "matmul_tflops": rate / 1e12, "task": task_name, "k": k,
           "n": n, "n_test": n_test, "seed": seed,
           "machine": {**machine(), "transformers": transformers.__version__},
           "started": started, "finished": None, "rows": [], "paths": None}
    rows = doc["rows"]
    # one untimed pass first, so the first timed row pays no kernel selection or allocator
    # growth the others do not
    extract(lm, task, "ltv", ExtractOptions(k=k, n=min(n, 16), n_test=min(n_test, 16),
                                            seed=seed, batch_size=16, progress=False))
    cuda = torch.device(device).type == "cuda"
    for b in batch_sizes:
        opts = ExtractOptions(k=k, n=n, n_test=n_test, seed=seed, batch_size=b, progress=False)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        try:
            with counted_positions(model) as seen:
                sync(device)
                t0 = time.perf_counter()
                r = extract(lm, task, "ltv", opts, episode=episode)
                sync(device)
                wall = time.perf_counter() - t0
        except torch.OutOfMemoryError:
            # a fixed batch too large for this card at this shape is a row, not the end of
            # the run (`auto` plans from free memory and should never land here)
            if cuda:
                torch.cuda.empty_cache()
            rows.append({"batch_size": b, "out_of_memory": True})
            log(f"batch {b}: out of device memory")
            report.write(doc, out_dir, markdown(doc))
            continue
        achieved = 2 * body * seen[0] / wall
        rows.append({
            "batch_size": b, "planned_batch": r.timings.get("batch_size"),
            "seconds": wall, "capture_seconds": r.timings["capture_seconds"],
            "fit_seconds": r.timings["fit_seconds"], "test_seconds": r.timings["test_seconds"],
            "positions": seen[0], "achieved_tflops": achieved / 1e12,
            "fraction_of_matmul": achieved / rate, "peak_gib": peak_memory(device),
            "ltv_accuracy": r.metrics["ltv"]["accuracy"]})
        row = rows[-1]
        log(f"batch {b}: {wall:.2f} s (capture {row['capture_seconds']:.2f} s, test "
            f"{row['test_seconds']:.2f} s), {100 * row['fraction_of_matmul']:.0f} % of the "
            f"matmul rate")
        report.write(doc, out_dir, markdown(doc))  # each row lands as it is measured
    paths = None
    if naive:  # the shared demo cache against the naive path, on the train prompts
        cap = Capturer(model, tok, batch_size=16, progress=False)
        paths = time_paths(cap, task_name, k, n, seed, naive=True)
        log(f"shared demos {paths['ours_capture_seconds']:.2f} s, naive "
            f"{paths['naive_capture_seconds']:.2f} s ({paths['speedup']:.1f}×)")
    doc["paths"] = paths
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report.write(doc, out_dir, markdown(doc))
    return doc


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [f"# extract() at the {doc['shape']} shape on {doc['device']}", "",
             f"`{doc['command']}`", "",
             (f"{m['gpu']} ({machine_line(m)})" if m.get("gpu") else machine_line(m))
             + f"; torch {m.get('torch')}, "
             f"transformers "
             f"{m.get('transformers')}; random {doc['dtype']} weights at the shape "
             f"({doc['layers']} layers, {doc['body_parameters'] / 1e9:.2f} B body parameters; "
             f"vocabulary {doc['vocab']}, {doc['tokenizer']}'s tokenizer), built on the device "
             f"in {doc['build_seconds']:.2f} s. {doc['task']}, k = {doc['k']}, N = {doc['n']}, "
             f"{doc['n_test']} test queries; a square matmul ran at "
             f"{doc['matmul_tflops']:.1f} TFLOP/s here.", "",
             "| batch | planned | extract() s | capture s | fit s | test s | positions | "
             "TFLOP/s (2·body·positions) | of the matmul | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r.get("out_of_memory"):
            lines.append(f"| {r['batch_size']} | – | out of device memory |" + " – |" * 7)
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "–"
        planned = int(r["planned_batch"]) if r["planned_batch"] is not None else "–"
        lines.append(f"| {r['batch_size']} | {planned} | {r['seconds']:.2f} | "
                     f"{r['capture_seconds']:.2f} | {r['fit_seconds']:.2f} | "
                     f"{r['test_seconds']:.2f} | {r['positions']:,} | "
                     f"{r['achieved_tflops']:.1f} | {100 * r['fraction_of_matmul']:.0f} % | "
                     f"{peak} |")
    p = doc.get("paths")
    if p:
        lines += ["", f"Train capture, shared demo cache (batch 16) {p['ours_capture_seconds']:.2f}"
                  f" s against the naive path (batch 1, whole prompts) "
                  f"{p['naive_capture_seconds']:.2f} s: {p['speedup']:.1f}× (the fit included "
                  f"on both sides); states agree to {p['rel_diff_h_icl']:.1e} (relative)."]
    return "\n".join(lines) + "\n"
