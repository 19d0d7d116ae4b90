"""The vLLM capture at a large model's real width: a random-weight model with a real
config's hidden size, heads, KV heads, MLP width and vocabulary (Qwen2.5-72B's by default)
and as few layers as the machine holds, captured at TP 1 and TP 2, held against the plan
(`models.plan`) and against transformers.

Per layout it records the plan's bytes per rank (weights of the pooling runner, KV, one
step's activations) beside each rank's measured peak RSS; the shapes of h; h against
transformers' h on the same prompts (same dtype); and the label logits from the rows sliced
out of the checkpoint's shards against the model's own logits at those ids.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.models.hardware import machine_line
from ltv_vllm.models.plan import GIB

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "configs"


def build(config_file: Path, layers: int, tokenizer_dir: str, out: Path,
          dtype: torch.dtype) -> dict[str, Any]:
    """A random-weight model of `config_file`'s shape with `layers` decoder layers, written
    as an HF directory with `tokenizer_dir`'s tokenizer; returns its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(config_file.read_text())
    cfg["num_hidden_layers"] = layers
    cfg["max_position_embeddings"] = 4096
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the run's dtype: no float32 copy at 72B width
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out, max_shard_size="2GB")
    for f in Path(tokenizer_dir).glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    del model
    return cfg


def bench_real_width(config_name: str, layers: int, tokenizer_model: str, *, tps: list[int],
                     dtype: str, work: Path, out_dir: Path, command: str,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ltv_vllm.bench import report
    from ltv_vllm.bench.workload import machine
    from ltv_vllm.models.checkpoint import read_label_rows
    from ltv_vllm.models.hardware import resolve_dtype
    from ltv_vllm.models.loading import local_model_dir
    from ltv_vllm.pipeline.extract import episode_prompts
    from ltv_vllm.serving.offline.capture import CaptureEngine, capture_states, plan_capture
    from ltv_vllm.tasks.data import load_dataset, sample_episode
    from ltv_vllm.tasks.specs import get_task, label_token_ids

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    dtype = resolve_dtype(dtype, device="cpu", checkpoint="bfloat16")
    model_dir = work / f"{config_name}-l{layers}"
    t0 = time.perf_counter()
    cfg = build(CONFIGS / f"{config_name}.json", layers, local_model_dir(tokenizer_model),
                model_dir, getattr(torch, dtype))
    log(f"built {model_dir} in {time.perf_counter() - t0:.0f} s")
    tok = AutoTokenizer.from_pretrained(model_dir)
    task = get_task("sst2")
    ep = sample_episode(load_dataset(task), k=4, n=16, n_test=8, seed=0)
    prompts = episode_prompts(ep)
    label_ids = label_token_ids(task, tok)
    rows: list[dict[str, Any]] = []
    states: dict[int, torch.Tensor] = {}
    for tp in tps:
        engine = CaptureEngine(dtype=dtype, tensor_parallel_size=tp, enforce_eager=True,
                               max_model_len=1024)
        plan, req, _ = plan_capture(str(model_dir), [ep], engine, tokenizer=tok)
        h, rep = capture_states(str(model_dir), prompts, engine, work / f"tp{tp}")
        states[tp] = h
        # each rank's process: at TP 1 the job itself (less what it held before the engine:
        # the forkserver's imports), at TP > 1 vLLM's worker processes (fresh interpreters)
        if tp == 1:
            ranks = [{k: v - rep["memory_at_start"].get(k, 0) if k == "anon" else v
                      for k, v in rep["memory"][0].items()}]
        else:
            ranks = [m for m in rep["memory"][1:] if m.get("anon", 0) > GIB // 4]
        rows.append({"tp": tp, "shape": rep["shape"], "startup_seconds": rep["startup_seconds"],
                     "capture_seconds": rep["capture_seconds"],
                     "plan_weights_bytes": plan.weight_bytes_per_device,
                     "plan_kv_bytes": plan.kv_bytes_per_device,
                     "plan_activation_bytes": plan.activation_bytes_per_device,
                     "kv_cache_space_bytes": 2 * GIB,  # VLLM_CPU_KVCACHE_SPACE of the job
                     "ranks": ranks, "memory": rep["memory"]})
        log(f"TP {tp}: h {rep['shape']}, plan weights {plan.weight_bytes_per_device / GIB:.2f} "
            f"GiB per rank, anonymous memory per rank "
            + ", ".join(f"{r['anon'] / GIB:.2f}" for r in ranks) + " GiB")
    # transformers on the same prompts, after the engines (one copy of the weights at a time)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        ref, logits = [], []
        for p in prompts:
            o = model(tok(p, return_tensors="pt").input_ids, output_hidden_states=True)
            ref.append(o.hidden_states[-1][0, -1].float())
            logits.append(o.logits[0, -1, label_ids].float())
    ref_h, ref_z = torch.stack(ref), torch.stack(logits)
    w_c, b_c = read_label_rows(model_dir, label_ids)
    for r in rows:
        h = states[r["tp"]]
        r["rel_diff_h"] = float((h - ref_h).norm() / ref_h.norm())
        z = h @ w_c.T + b_c
        r["rel_diff_label_logits"] = float((z - ref_z).norm() / ref_z.norm())
    exact = float(((ref_h @ w_c.T + b_c) - ref_z).abs().max())
    doc = {"command": command, "machine": machine(), "started": started,
           "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "config": cfg, "dtype": dtype,
           "prompts": len(prompts), "label_ids": label_ids,
           "label_rows_exact_max_abs": exact, "rows": rows}
    report.write(doc, out_dir, markdown(doc))
    shutil.rmtree(model_dir, ignore_errors=True)
    return doc


def markdown(doc: dict[str, Any]) -> str:
    c = doc["config"]
    lines = [
        "# The vLLM capture at a real model's width", "", "```", doc["command"], "```", "",
        (f"{machine_line(doc['machine'])}, torch {doc['machine']['torch']}. A random-weight "
         f"{c['model_type']} with hidden {c['hidden_size']}, {c['num_attention_heads']} heads "
         f"({c['num_key_value_heads']} KV), MLP {c['intermediate_size']}, vocabulary "
         f"{c['vocab_size']} and {c['num_hidden_layers']} layer(s), {doc['dtype']}; "
         f"{doc['prompts']} SST-2 prompts (k = 4). Plan = `models.plan` for this shape "
         "(weights as the pooling runner holds them, no LM head; KV of this run; one step's "
         "activations, an estimate). Measured per rank after the capture, from /proc: "
         "anonymous memory (weights, the KV cache allocated whole at VLLM_CPU_KVCACHE_SPACE = "
         "2 GiB, the runtime's heap; at TP 1 less what the job held before its engine, at "
         "TP 2 a fresh worker's whole heap), the checkpoint's file pages still mapped, and "
         "the peak RSS (file pages included: each rank reads through the whole checkpoint, "
         "the LM head it skips too)."), "",
        "| TP | h shape | plan: weights / rank (GiB) | plan: + KV cache allocated (GiB) | "
        "measured: anonymous / rank (GiB) | file pages / rank (GiB) | peak RSS / rank (GiB) "
        "| h vs transformers (rel.) | label logits vs the model's (rel.) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    def per(r: dict[str, Any], key: str) -> str:
        return ", ".join(f"{x.get(key, 0) / GIB:.2f}" for x in r["ranks"])

    for r in doc["rows"]:
        lines.append(
            f"| {r['tp']} | {r['shape']} | {r['plan_weights_bytes'] / GIB:.2f} | "
            f"{(r['plan_weights_bytes'] + r['kv_cache_space_bytes']) / GIB:.2f} | "
            f"{per(r, 'anon')} | {per(r, 'file')} | {per(r, 'peak')} | "
            f"{r['rel_diff_h']:.2e} | {r['rel_diff_label_logits']:.2e} |")
    lines += ["", f"Label rows sliced from the shards, applied to transformers' own h: max abs "
              f"difference from its logits {doc['label_rows_exact_max_abs']:.2e}."]
    return "\n".join(lines) + "\n"
