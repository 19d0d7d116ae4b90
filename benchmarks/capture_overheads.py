"""What bounds `extract()` on a GPU besides the matmuls: one variant of the capture per
process, each process cold, as a user's first extraction is.

At a real model's shape (random weights built on the device, the packaged tokenizer), one
process per variant times the whole `extract()` (trec, k = 30, N = 256, 500 test queries) at
each batch size, then the last one again warm (every shape seen). Variants:

- `code`: the package found first on PYTHONPATH (run it once with an older checkout's
  `ltv_vllm` first on the path for the code before a change);
- `no-buckets`: this code with lengths unbucketed (`capture.bucketed` the identity);
- `efficient`: this code with SDPA held to the memory-efficient kernel (no cuDNN attention).

    python benchmarks/capture_overheads.py --variant code --shape llama-3.1-8b \\
        --tokenizer device-carry/tokenizer --label new --out RESULTS.jsonl

Each call appends one JSON line to --out (machine, variant, label, rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

NAMES = {("code", "old"): "before (one tokenizer call per prompt, a host copy per batch, "
                          "the packed mask built on the host)",
         ("code", "new"): "now (one tokenizer call per pass, one host copy per pass, the mask "
                          "built on the device, lengths in buckets)",
         ("no-buckets", "new"): "now, lengths not bucketed",
         ("efficient", "new"): "now, SDPA's memory-efficient kernel instead of cuDNN's"}


def report(jsonl: Path) -> str:
    """README.md of a results.jsonl: one row per variant, seconds per extract()."""
    docs = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    first = docs[0]
    m = first["machine"]
    cols = [(r["batch_size"], r["warm"]) for r in first["rows"]]
    head = " | ".join(f"batch {b}{', warm' if w else ', cold'} (s)" for b, w in cols)
    lines = [f"# extract() cold, one process per variant: {first['shape']} shape on "
             f"{m.get('gpu') or first['device']}", "",
             "`bash scripts/device_checks.sh` with `STEPS=overheads` (each line of results.jsonl "
             "one `python benchmarks/capture_overheads.py --variant V` process, in this order, "
             "in one call on one machine)", "",
             f"{m.get('gpu')}, torch {first['torch']}, {first['dtype']}; random weights at the "
             f"shape built on the device, the packaged tokenizer; trec, k = 30, N = 256, 500 test "
             "queries; the whole extract() (capture, fit, test scoring). Each process times "
             "its batches in order, cold (every shape new to the process, as a user's first "
             "extraction; the first column also pays the process's first CUDA work), then the "
             "last again warm. `auto` planned 128.", "",
             f"| code | {head} |", "|---" * (len(cols) + 1) + "|"]
    for d in docs:
        name = NAMES.get((d["variant"], d["label"]), f"{d['variant']} ({d['label']})")
        lines.append(f"| {name} | " + " | ".join(f"{r['seconds']:.2f}" for r in d["rows"])
                     + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=["code", "no-buckets", "efficient"], default="code")
    ap.add_argument("--label", default="")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--tokenizer", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-sizes", default="16,auto")
    ap.add_argument("--task", default="trec")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--n-test", type=int, default=500)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", action="store_true",
                    help="Only write README.md beside --out (a results.jsonl) from it.")
    a = ap.parse_args()
    if a.report:
        (a.out.parent / "README.md").write_text(report(a.out))
        return

    import torch

    import ltv_vllm
    from ltv_vllm.bench.device_extraction import build_on_device, sync
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.core.vector import model_identity
    from ltv_vllm.extraction import capture
    from ltv_vllm.models.hardware import resolve_dtype
    from ltv_vllm.models.loading import LoadedModel, load_tokenizer
    from ltv_vllm.pipeline.extract import ExtractOptions, extract, plan_episode
    from ltv_vllm.tasks.specs import get_task

    if a.variant == "no-buckets":
        capture.bucketed = lambda n: n
    held = contextlib.nullcontext()
    if a.variant == "efficient":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        held = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])
    tok = load_tokenizer(a.tokenizer)
    dt = getattr(torch, resolve_dtype("auto", device=a.device))
    model = build_on_device(a.shape, len(tok), a.device, dt, a.layers)
    lm = LoadedModel(model, tok, f"random:{a.shape}", model_identity(model, "random"))
    task = get_task(a.task)
    episode = plan_episode(task, ExtractOptions(k=30, n=a.n, n_test=a.n_test, seed=0))
    sizes = [b if b == "auto" else int(b) for b in a.batch_sizes.split(",")]
    rows = []
    with held:
        for b, warm in [*((b, False) for b in sizes), (sizes[-1], True)]:
            opts = ExtractOptions(k=30, n=a.n, n_test=a.n_test, seed=0, batch_size=b,
                                  progress=False)
            sync(a.device)
            t0 = time.perf_counter()
            r = extract(lm, task, "ltv", opts, episode=episode)
            sync(a.device)
            rows.append({"batch_size": b, "warm": warm, "seconds": time.perf_counter() - t0,
                         "capture_seconds": r.timings["capture_seconds"],
                         "test_seconds": r.timings["test_seconds"],
                         "planned_batch": r.timings.get("batch_size"),
                         "ltv_accuracy": r.metrics["ltv"]["accuracy"]})
            print(a.variant, a.label, rows[-1], flush=True)
    doc = {"variant": a.variant, "label": a.label, "shape": a.shape, "layers": a.layers,
           "device": a.device, "dtype": str(dt),
           "package": os.path.relpath(Path(ltv_vllm.__file__).parent),
           "machine": machine(), "torch": torch.__version__, "rows": rows,
           "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    with a.out.open("a") as f:
        f.write(json.dumps(doc) + "\n")


if __name__ == "__main__":
    main()
