"""Quantized serving: a task vector extracted from the unquantized model, served on the model
vLLM quantizes as it loads it (online quantization, `--quantization SCHEME`).

Per scheme (none first), on the packaged model and the task's held-out queries:

  served        a vLLM engine with the vector fused answers each query's label-restricted
                question (processed logprobs, what `classify` reads); a bare engine answers
                zero-shot
  reference     vLLM's pooling runner with the same scheme captures the quantized model's own
                final hidden state h_q on the same prompts (`offline.capture`); the reference
                answer is log_softmax((h_q + W h_q) · W_labels) over the label rows of the LM
                head, read from the checkpoint (vLLM's online schemes leave the LM head
                unquantized)

`max |served − reference|` says whether the shift is exact on the quantized model; accuracy
says what quantization costs, zero-shot and with the vector.

    python benchmarks/quantized.py --schemes none,int8_per_channel_weight_only,fp8_per_tensor \\
        --out benchmarks/results/quantized_smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def engine_job(job: dict) -> dict:
    """In a fresh process: one engine (the vector fused, or bare), every prompt's restricted
    label logprobs, in label order."""
    from ltv_vllm import make_llm
    from ltv_vllm.serving.offline.llm import classification_params

    engine_args = {"max_model_len": 1024, "seed": 0, **job.get("engine_args", {})}
    if job["scheme"] != "none":
        engine_args["quantization"] = job["scheme"]
    t0 = time.perf_counter()
    llm = make_llm(job["model"], job["vector"], dtype=job["dtype"], engine_args=engine_args)
    start = time.perf_counter() - t0
    ids = job["label_ids"]
    t0 = time.perf_counter()
    outs = llm.generate(job["prompts"], classification_params(ids), use_tqdm=False)
    rows = []
    for o in outs:
        top = {int(k): v.logprob for k, v in o.outputs[0].logprobs[0].items()}
        rows.append([top.get(i, float("-inf")) for i in ids])
    return {"logprobs": rows, "start_seconds": start,
            "generate_seconds": time.perf_counter() - t0}


def run_engine(job: dict, work: Path, name: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{name}.job.json").write_text(json.dumps(job))
    log = work / f"{name}.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, __file__, "--job", str(work / f"{name}.job.json"),
                            str(work / f"{name}.out.json")], stdout=f, stderr=subprocess.STDOUT,
                           env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                "VLLM_CPU_KVCACHE_SPACE": "2"})
    text = log.read_text()
    if r.returncode != 0:
        errors = [x for x in text.splitlines() if "Error" in x]
        return {"error": (errors or text.strip().splitlines() or ["failed"])[-1].strip()}
    quantized = re.findall(r"Quantizing (\d+) layers", text)
    return {**json.loads((work / f"{name}.out.json").read_text()),
            "layers_quantized": int(quantized[-1]) if quantized else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="trec")
    ap.add_argument("--vector", type=Path, default=None,
                    help="The task's vector [default: extracted here, `ltv-vllm extract`].")
    ap.add_argument("--schemes",
                    default="none,fp8_per_channel,fp8_per_tensor,int8_per_channel_weight_only")
    ap.add_argument("--n-test", type=int, default=500)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="Both engines run one prompt per step, no prefix cache: the same "
                         "shapes, so bf16 rounding no longer differs between them.")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quantized"))
    a = ap.parse_args()
    if a.job:
        out = engine_job(json.loads(Path(a.job[0]).read_text()))
        Path(a.job[1]).write_text(json.dumps(out))
        return

    import torch

    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.models.checkpoint import read_lm_head
    from ltv_vllm.models.hardware import hardware, machine_line, resolve_for_model
    from ltv_vllm.models.loading import load_tokenizer, local_model_dir
    from ltv_vllm.pipeline.extract import ExtractOptions, plan_episode
    from ltv_vllm.serving.offline.capture import CaptureEngine, capture_states
    from ltv_vllm.tasks.specs import get_task, label_token_ids

    t_start = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ltv-quantized-"))  # engine logs: not results
    model_dir = local_model_dir(a.model)
    dtype = resolve_for_model(a.dtype, model_dir)
    vector = a.vector or work / f"{a.task}.pt"
    if not vector.exists():  # extracted from the unquantized model with transformers
        subprocess.run([sys.executable, "-m", "ltv_vllm.cli", "extract", "--model", a.model,
                        "--task", a.task, "--dtype", dtype, "--quiet", "-o", str(vector)],
                       check=True)
    tv = load_task_vector(vector)
    task = get_task(a.task)
    tok = load_tokenizer(str(model_dir))
    ids = label_token_ids(task, tok)
    ep = plan_episode(task, ExtractOptions(n_test=a.n_test))
    prompts = [task.zero_shot(e.text) for e in ep.test]
    labels = torch.tensor([e.label for e in ep.test])
    head = read_lm_head(model_dir).float()[ids]                           # (K, d)
    rows = []
    for scheme in a.schemes.split(","):
        alone = ({"max_num_seqs": 1, "enable_prefix_caching": False} if a.one_at_a_time
                 else {})
        job = {"model": str(model_dir), "scheme": scheme, "dtype": dtype, "prompts": prompts,
               "label_ids": ids, "engine_args": alone}
        bare = run_engine({**job, "vector": None}, work, f"{scheme}-bare")
        shifted = run_engine({**job, "vector": str(vector)}, work, f"{scheme}-ltv")
        row = {"scheme": scheme}
        if "error" in bare or "error" in shifted:
            row["error"] = bare.get("error") or shifted.get("error")
            rows.append(row)
            print(scheme, row["error"], flush=True)
            continue
        served = torch.tensor(shifted["logprobs"], dtype=torch.float64)
        zs = torch.tensor(bare["logprobs"], dtype=torch.float64)
        extra = {} if scheme == "none" else {"quantization": scheme}
        engine = CaptureEngine(dtype=dtype, enable_prefix_caching=not a.one_at_a_time,
                               extra={**extra, **({"max_num_seqs": 1} if a.one_at_a_time
                                                  else {})})
        h, _ = capture_states(str(model_dir), prompts, engine, work / f"{scheme}-capture")
        ref = torch.log_softmax(logits(tv, h, head, dtype), -1)
        ref_zs = torch.log_softmax(logits(None, h, head, dtype), -1)
        ref32 = torch.log_softmax((tv.shift_hidden(h) @ head.T).double(), -1)
        row.update({
            "zero_shot_accuracy": float((zs.argmax(-1) == labels).float().mean()),
            "ltv_accuracy": float((served.argmax(-1) == labels).float().mean()),
            "max_abs_diff_ltv": float((served - ref).abs().max()),
            "max_abs_diff_zero_shot": float((zs - ref_zs).abs().max()),
            "max_abs_diff_ltv_float32_ref": float((served - ref32).abs().max()),
            "layers_quantized": shifted["layers_quantized"],
            "answers_equal_reference": float((served.argmax(-1) == ref.argmax(-1))
                                             .float().mean()),
            "engine_start_seconds": round(shifted["start_seconds"], 1),
            "generate_seconds": round(shifted["generate_seconds"], 2)})
        rows.append(row)
        print(scheme, {k: v for k, v in row.items() if k != "scheme"}, flush=True)
    doc = {"command": "python benchmarks/quantized.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
               if k != "job" and v is not None),
           "machine": hardware(), "dtype": dtype, "task": a.task, "n_test": len(prompts),
           "vector": {"rank": tv.rank, "provenance_dtype": tv.provenance.dtype,
                      "metrics": tv.provenance.metrics},
           "wall_seconds": round(time.perf_counter() - t_start, 1), "rows": rows}
    (a.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (a.out / "results.md").write_text(report(doc, machine_line(doc["machine"])))


def logits(tv, h, head, dtype: str):
    """The engine's label logits from its own h, computed as the wrapper computes them in the
    engine's dtype: h + (h V) Uᵀ, then the LM head's rows, each product rounded to `dtype`
    (float64 out)."""
    import torch

    dt = getattr(torch, dtype)
    x = h.to(dt)
    if tv is not None:
        x = x + (x @ tv.V.to(dt)) @ tv.U.to(dt).T
    return (x @ head.to(dt).T).double()


def report(doc: dict, machine: str) -> str:
    lines = ["# A task vector served on a model vLLM quantizes at load", "",
             f"`{doc['command']}`", "", f"{machine}; engine dtype {doc['dtype']}; "
             f"{doc['task']}, {doc['n_test']} held-out queries; {doc['wall_seconds']:.0f} s", "",
             "One vector, extracted from the unquantized model (transformers). *served − ref*: "
             "the largest difference of a label-restricted logprob between the served answer "
             "and the reference from the quantized engine's own final hidden states h_q "
             "(vLLM's pooling runner, same scheme): log_softmax((h_q + h_q V Uᵀ) · W_labelsᵀ) "
             "computed in the engine's dtype, as the wrapper computes it (*float32 ref*: the "
             "same in float32). *layers*: linear layers vLLM quantized.", "",
             "| scheme | layers | zero-shot | LTV | served − ref (LTV) | "
             "served − ref (zero-shot) | served − float32 ref (LTV) | same answer as ref |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if "error" in r:
            lines.append(f"| {r['scheme']} | failed: {r['error'][:160]} | | | | | | |")
            continue
        lines.append(f"| {r['scheme']} | {r['layers_quantized']} | "
                     f"{100 * r['zero_shot_accuracy']:.1f} | {100 * r['ltv_accuracy']:.1f} | "
                     f"{r['max_abs_diff_ltv']:.1e} | {r['max_abs_diff_zero_shot']:.1e} | "
                     f"{r['max_abs_diff_ltv_float32_ref']:.1e} | "
                     f"{100 * r['answers_equal_reference']:.1f} % |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
