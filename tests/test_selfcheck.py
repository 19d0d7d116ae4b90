"""`ltv-vllm selfcheck` on a real engine: it passes on this vLLM, runner and CPU, and it
fails, naming the first wrong row, when the row plan is planted with a bug (rows reversed, a
step count off by one)."""

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


@pytest.mark.parametrize("plant", ["reverse", "off-by-one"])
def test_selfcheck_fails_on_a_planted_row_plan_bug(probe_model, tmp_path, plant):
    opts = {"model_dir": str(probe_model), "dtype": "float32", "tensor_parallel_size": 1,
            "max_num_batched_tokens": None, "max_model_len": 256, "enforce_eager": True}
    out = run_worker("selfcheck_planted", {**opts, "plant": plant}, tmp_path)
    assert out["ok"] is False, out
    line = out["error"]
    assert "\n" not in line and line.startswith("selfcheck failed on vLLM 0.32.0, V1 runner, "
                                                "cpu"), line
    assert "first: row " in line, line
