"""Do `ltv-vllm serve` + `classify` predict what `ltv-vllm evaluate` (transformers) predicts?

Extracts (or loads) a task vector, scores the task's balanced test subset with the
transformers reference path (h_zs + W h_zs → label-restricted argmax, as `evaluate` does),
then starts the real OpenAI server with the vector fused and classifies the same texts
through it. Reports agreement, both accuracies and the largest gap in label probabilities.

    python benchmarks/serve_agreement.py --model smollm2-135m --task sst2 --n-test 500
    python benchmarks/serve_agreement.py --model qwen2.5-coder-1.5b-l14 --task sst2 \
        --vector sst2.transfer.pt --n-test 100      # a cross-model (logit-space) vector
    python benchmarks/serve_agreement.py --task trec --format chat --n-test 200 \
        --out benchmarks/results/serve_agreement_chat   # fitted and asked through chat
    python benchmarks/serve_agreement.py --task trec --demo-sets 4 --dtype float32 \
        --n-test 200 --out benchmarks/results/serve_agreement_multi   # multi-prompt vector
    python benchmarks/serve_agreement.py --task sst2 --k 90 --teacher batch --gold-weight 0.5 \
        --dtype float32 --n-test 200 --out benchmarks/results/serve_agreement_teacher
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx
import torch

from ltv_vllm.core.vector import load_task_vector
from ltv_vllm.extraction.capture import Capturer, label_head
from ltv_vllm.models.hardware import hardware, machine_line
from ltv_vllm.models.loading import load_model
from ltv_vllm.pipeline.extract import ExtractOptions, extract
from ltv_vllm.serving.client import classify
from ltv_vllm.tasks.chat import chat_task
from ltv_vllm.tasks.data import load_dataset, sample_test
from ltv_vllm.tasks.specs import get_task


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@click.command()
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True)
@click.option("--task", "task_name", default="sst2", show_default=True)
@click.option("--vector", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Existing vector [default: extract one with seed 0].")
@click.option("--n-test", default=500, show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--out", default="benchmarks/results/serve_agreement", show_default=True)
@click.option("--format", "prompt_format", type=click.Choice(["completion", "chat"]),
              default="completion", show_default=True,
              help="chat: the vector fitted through the model's chat template, the server "
                   "asked through /v1/chat/completions (no opt-in).")
@click.option("--demo-sets", default=1, show_default=True,
              help="Extract a multi-prompt vector: fitted to the mean ICL state over this many "
                   "demonstration sets (`extract --demo-sets`).")
@click.option("--k", type=int, default=None,
              help="Demonstrations of the extracted vector's prompt [default: extract's].")
@click.option("--teacher", default="icl", show_default=True,
              type=click.Choice(["icl", "batch", "contextual"]),
              help="What the extracted vector imitates (`extract --teacher`).")
@click.option("--gold-weight", default=0.0, show_default=True,
              help="Blend the train queries' gold labels in (`extract --gold-weight`).")
def main(model_spec: str, task_name: str, vector: Path | None, n_test: int, dtype: str,
         out: str, prompt_format: str, demo_sets: int, k: int | None, teacher: str,
         gold_weight: float) -> None:
    from ltv_vllm.core.teacher import TeacherOptions

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plain = get_task(task_name)
    lm = load_model(model_spec, dtype=dtype)
    task = chat_task(plain, lm.tokenizer) if prompt_format == "chat" else plain
    dtype = str(lm.model.dtype).removeprefix("torch.")  # resolved: the server gets the same
    if vector is None:
        opts = ExtractOptions(k=k, n_test=n_test, demo_sets=demo_sets,
                              teacher=TeacherOptions(teacher, gold_weight))
        tv = extract(lm, task, "ltv", opts).artifact
        vector = tv.save(out_dir / f"{task.name}.safetensors")
    tv = load_task_vector(vector)
    test = sample_test(load_dataset(task), n_test=n_test)
    texts = [e.text for e in test]
    labels = torch.tensor([e.label for e in test])

    cap = Capturer(lm.model, lm.tokenizer, special_tokens=task.special_tokens)
    w, b = label_head(lm.model, tv.label_token_ids)
    h = cap.hidden([task.zero_shot(t) for t in texts], desc="transformers ltv")
    if tv.kind == "hidden":
        z = tv.shift_hidden(h) @ w.T + b
    else:  # a cross-model transfer vector: z_zs + W̃ h on the label rows
        z = h @ w.T + b + tv.delta(h, rows=torch.tensor(tv.label_token_ids))
    ref_probs = torch.softmax(z.double(), -1)  # (n, K)
    ref_pred = ref_probs.argmax(-1)
    del lm, cap

    port = _port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    cmd = [sys.executable, "-m", "ltv_vllm.cli", "serve", "--model", model_spec, "--task-vector",
           str(vector), "--port", str(port), "--dtype", dtype, "--enforce-eager"]
    log = open(out_dir / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise click.ClickException("server exited; see server.log")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        startup = time.time() - t0
        t1 = time.time()
        res = classify(url, plain, texts, model=tv.task_name, concurrency=16,
                       chat=prompt_format == "chat")
        classify_s = time.time() - t1
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()

    srv_probs = torch.tensor([[r.probs[lab] for lab in task.labels] for r in res],
                             dtype=torch.float64)
    srv_pred = srv_probs.argmax(-1)
    agree = (srv_pred == ref_pred).double().mean().item()
    disagree = [
        {"text": texts[i], "transformers": ref_probs[i].tolist(), "server": srv_probs[i].tolist()}
        for i in torch.nonzero(srv_pred != ref_pred).flatten().tolist()
    ]
    doc = {
        "command": "python " + " ".join(sys.argv),
        "model": model_spec, "task": task.name, "n": len(texts), "format": prompt_format,
        "dtype": dtype,
        "machine": hardware(),
        "agreement": agree,
        "accuracy_transformers": (ref_pred == labels).double().mean().item(),
        "accuracy_server": (srv_pred == labels).double().mean().item(),
        "vector_kind": tv.kind,
        "demo_sets": tv.meta.get("demo_sets", 1),  # a multi-prompt vector's sets
        "k": tv.provenance.k, "teacher": tv.provenance.teacher,  # what the vector imitates
        "accuracy_recorded_at_extraction": (tv.provenance.metrics or {}).get(
            tv.provenance.method or "ltv", {}).get("accuracy"),
        "max_abs_prob_gap": (srv_probs - ref_probs).abs().max().item(),
        "mean_abs_prob_gap": (srv_probs - ref_probs).abs().mean().item(),
        "server_startup_seconds": startup,
        "classify_seconds": classify_s,
        "disagreements": disagree,
    }
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    rec = doc["teacher"] or {}
    taught = TeacherOptions(rec.get("calibration", "icl"), rec.get("gold_weight", 0.0),
                            rec.get("gold_share", 1.0))
    fitted = ("" if taught.is_default else
              f"a vector fitted to the {taught.name} teacher of a {doc['k']}-shot prompt, ")
    summary = (f"{task.name} on {model_spec} ({doc['dtype']}; {machine_line(doc['machine'])}), "
               f"{'through chat, ' if prompt_format == 'chat' else ''}"
               + (f"a multi-prompt vector ({doc['demo_sets']} demonstration sets), "
                  if doc["demo_sets"] > 1 else "")
               + fitted +
               f"{len(texts)} test texts: server vs "
               f"transformers agreement {100 * agree:.1f}%, "
               f"accuracy {100 * doc['accuracy_server']:.1f}% "
               f"vs {100 * doc['accuracy_transformers']:.1f}%, "
               f"max |Δp| {doc['max_abs_prob_gap']:.4f}, "
               f"mean |Δp| {doc['mean_abs_prob_gap']:.4f}; startup {startup:.0f} s, "
               f"classify {classify_s:.0f} s")
    (out_dir / "results.md").write_text(
        f"# serve + classify vs evaluate\n\n```\n{doc['command']}\n```\n\n{summary}\n"
    )
    click.echo(summary)


if __name__ == "__main__":
    main()
