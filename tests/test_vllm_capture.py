"""`serving.capture`: h of each prompt's last token from vLLM's pooling runner equals
transformers' final post-norm hidden state (`hidden_states[-1]`), float32, for zero-shot
prompts and for ICL prompts that share the demonstrations as a cached prefix, at tensor
parallelism 1 and 2 (on this CPU: two ranks, a core each)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_vllm_llama
from ltv_vllm.serving.capture import CaptureEngine
from ltv_vllm.serving.jobs import run_job

pytestmark = pytest.mark.slow(seconds=60)  # see conftest's ordering

DEMOS = "Review: a warm and funny film\nSentiment: positive\n\nReview: boring and slow\n" \
        "Sentiment: negative\n\n"
QUERIES = ["the plot is dull", "great acting", "so so"]


def capture(model_dir, prompts, work, tp: int = 1):
    """h from a capture job (`serving.capture`) at tensor-parallel size `tp`."""
    engine = CaptureEngine(dtype="float32", max_model_len=256, enforce_eager=True,
                           tensor_parallel_size=tp)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    if tp > 1:  # the CPU backend wants one NUMA node per rank; on one node, a core per rank
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    out = run_job("ltv_vllm.serving.capture",
                  {"model_dir": str(model_dir), "prompts": prompts,
                   "engine": asdict(engine),
                   "out": str(work / f"h-tp{tp}.safetensors")},
                  work, f"capture-tp{tp}", env=env)
    h = load_file(str(work / f"h-tp{tp}.safetensors"))["h"]
    assert out["shape"] == list(h.shape)
    return h


def test_vllm_h_equals_transformers_h_at_tp1_and_tp2(tmp_path, tokenizer):
    model = make_vllm_llama(tokenizer, seed=7)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    zs = [f"Review: {q}\nSentiment:" for q in QUERIES]
    prompts = [*zs, *(DEMOS + p for p in zs)]  # the ICL prompts share the demos as a prefix
    with torch.no_grad():
        ref = torch.stack([
            model(tokenizer(p, return_tensors="pt").input_ids,
                  output_hidden_states=True).hidden_states[-1][0, -1] for p in prompts])
    # the two kinds of prompt really differ, so matching both is not one check twice
    assert (ref[:3] - ref[3:]).abs().max() > 1e-2
    for tp in (1, 2):
        h = capture(tmp_path / "m", prompts, tmp_path / "jobs", tp)
        assert list(h.shape) == [len(prompts), model.config.hidden_size]
        assert (h - ref).abs().max() < 1e-5, (tp, float((h - ref).abs().max()))
