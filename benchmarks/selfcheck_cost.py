"""What the start-up self-check itself costs, apart from the engine's first-request warm-up:
the same probe batch (`ltv_vllm.serving.offline.selfcheck`) sent `--repeats` times through one
offline engine with the probes, as a server holds them (processed logprobs).

    python benchmarks/selfcheck_cost.py --model smollm2-135m --out benchmarks/results/selfcheck_cost

The first pass pays the warm-up any first request would; the later ones are the check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/selfcheck_cost"))
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM

    from ltv_vllm.models.hardware import hardware, machine_line, resolve_for_model
    from ltv_vllm.models.resolve import resolve_model
    from ltv_vllm.serving.launcher.recipe import task_engine
    from ltv_vllm.serving.store.probes import probe_tokens, probe_vectors
    from ltv_vllm.serving.store.selfcheck_rows import probe_batch, probe_params, verdict
    model_dir = str(resolve_model(a.model))
    dtype = resolve_for_model(a.dtype, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tokens = probe_tokens(tok)
    with tempfile.TemporaryDirectory() as d:
        paths = {n: tv.save(Path(d) / f"{n}.safetensors")
                 for n, tv in probe_vectors(model_dir, tokens).items()}
        engine = task_engine(model_dir, paths)
        os.environ.update(engine.env)
        llm = LLM(**engine.kwargs, dtype=dtype, enforce_eager=True, max_model_len=2048,
                  logprobs_mode="processed_logprobs")
        batch = probe_batch(tok, None, 2048)
        params = [probe_params(p) for p in batch]
        passes = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            outs = llm.generate([p.prompt for p in batch], params, use_tqdm=False)
            passes.append(round(time.perf_counter() - t0, 2))
            checked = verdict(batch, outs, tokens, "offline")
    hw = hardware()
    res = {"command": " ".join(["python", "benchmarks/selfcheck_cost.py", *sys.argv[1:]]),
           "model": a.model, "dtype": dtype, "machine": hw, "machine_line": machine_line(hw),
           "rows": checked["rows"], "tokens": checked["tokens"], "seconds_per_pass": passes}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    line = (f"{a.model}, {dtype}: the probe batch ({checked['rows']} rows, {checked['tokens']} "
            f"tokens) took {', '.join(f'{s} s' for s in passes)} in {a.repeats} passes "
            "through one engine (the first pays the engine's first-request warm-up)")
    (a.out / "README.md").write_text(f"# Self-check cost\n\n`{res['command']}`\n\n"
                                     f"{res['machine_line']}\n\n{line}\n")
    print(line)
