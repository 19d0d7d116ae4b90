"""docs/your-task.md run as written: its spec file and CSV header, its extract, serve and
classify commands (through bash, as a reader pastes them), on a tiny random model standing in
for the packaged one; the served answer is the label the vector gives in transformers."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_server import start_server, stop

from conftest import make_vllm_llama

pytestmark = pytest.mark.slow(seconds=70)  # see conftest's ordering

PAGE = Path(__file__).parent.parent / "docs" / "your-task.md"
FENCE = re.compile(r"```(\w+)\n(.*?)\n```", re.DOTALL)


def blocks(lang: str) -> list[str]:
    return [code for kind, code in FENCE.findall(PAGE.read_text()) if kind == lang]


def write_data(d: Path, header: list[str], shown: list[list[str]]) -> None:
    """The page's CSV rows, then enough rows of the same shape for k, N and the test split;
    my_demos.csv and unlabeled.csv for the page's second extract."""
    rows = [*shown, *([f"Speaker {i} plays a song.", f"Music {i} is heard.", "yes"]
                      if i % 2 else [f"Speaker {i} plays a song.", f"Room {i} is silent.", "no"]
                      for i in range(300))]
    for name, part, cols in (("nli.csv", rows, header), ("my_demos.csv", rows[3:9], header),
                             ("unlabeled.csv", rows[9:41], header[:2])):
        with open(d / name, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            w.writerows(r[:len(cols)] for r in part)


def bash(line: str, d: Path, model: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A command line of the page through bash, `ltv-vllm` as this interpreter's module and
    the packaged model replaced by the tiny one."""
    line = line.replace("ltv-vllm", f"{sys.executable} -m ltv_vllm.cli", 1)
    line = line.replace("--model smollm2-135m", f"--model {model}")
    return subprocess.run(["bash", "-c", line], cwd=d, env=env, capture_output=True,
                          text=True, timeout=600)


def test_csv_to_served_task(tmp_path, tokenizer):
    from ltv_vllm.core.vector import load_task_vector
    from ltv_vllm.extraction.apply import task_vector_applied
    from ltv_vllm.tasks.specs import get_task, label_token_ids

    model = make_vllm_llama(tokenizer, seed=9)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    table = list(csv.reader(blocks("csv")[0].splitlines()))
    write_data(tmp_path, table[0], table[1:])
    (tmp_path / "nli.yaml").write_text(blocks("yaml")[0] + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "LTV_VLLM_CACHE": str(tmp_path / "cache")}
    first, second = blocks("bash")[:2]
    lines = first.splitlines()
    extract = next(x for x in lines if x.startswith("ltv-vllm extract"))
    r = bash(extract + " --quiet", tmp_path, model_dir, env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "nli on" in r.stdout and "k=8 demos, N=64" in r.stdout and "40 test" in r.stdout
    tv = load_task_vector(tmp_path / "nli.pt")
    task = get_task(str(tmp_path / "nli.yaml"))
    assert tv.meta["task"]["instruction"] == task.instruction  # the spec travels with it
    # the page's server: its vector under its name (the test's own port and engine settings)
    serve = next(x for x in lines if x.startswith("ltv-vllm serve"))
    name, path = re.search(r"--task-vector (\S+)", serve)[1].split("=", 1)
    proc, url, log = start_server(model_dir, [f"{name}={tmp_path / path}"], tmp_path)
    try:
        line = next(x for x in lines if x.startswith("ltv-vllm classify"))
        r = bash(line.replace("http://localhost:8123", url), tmp_path, model_dir, env)
        assert r.returncode == 0, r.stderr[-2000:]
        label, probs, text = r.stdout.strip().split("\t", 2)
        assert text == "Premise: A cat sleeps.\nHypothesis: An animal rests."
        # what the vector answers in transformers on the prompt written out by hand
        prompt = (f"{task.instruction}\n{text}\nAnswer:")
        ids = label_token_ids(task, tokenizer)
        with torch.no_grad(), task_vector_applied(model, tv):
            logits = model(torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0, -1]
        assert label == task.labels[int(logits[ids].argmax())], (label, probs)
    finally:
        stop(proc, log)
    # the page's second extract: the user's demonstrations and queries
    r = bash(second.strip() + " --quiet", tmp_path, model_dir, env)
    assert r.returncode == 0, r.stderr[-2000:]
    pv = load_task_vector(tmp_path / "nli.pt").provenance
    assert (pv.k_used, pv.n) == (6, 32)
