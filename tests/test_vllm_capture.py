"""`serving.capture`: h of each prompt's last token from vLLM's pooling runner equals
transformers' final post-norm hidden state (`hidden_states[-1]`), float32, for zero-shot
prompts and for ICL prompts that share the demonstrations as a prefix, with the prefix cache
(and seen to be used) and without it. Tensor parallelism 2 (an engine whose two workers
each import vLLM afresh) is checked once, on an extraction episode's prompts:
`test_vllm_extract.py::test_tp2_gives_the_tp1_vector`."""

from __future__ import annotations

import pytest
import torch

from conftest import make_vllm_llama
from ltv_vllm.serving.offline.capture import CaptureEngine, capture_states

pytestmark = pytest.mark.slow(seconds=6)  # see conftest's ordering

# long enough to fill whole KV blocks (vLLM caches full blocks only)
DEMOS = ("Review: a warm and funny film\nSentiment: positive\n\nReview: boring and slow\n"
         "Sentiment: negative\n\n") * 12
QUERIES = ["the plot is dull", "great acting", "so so"]


def test_vllm_h_equals_transformers_h(tmp_path, tokenizer):
    model = make_vllm_llama(tokenizer, seed=7)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    zs = [f"Review: {q}\nSentiment:" for q in QUERIES]
    prompts = [*zs, *(DEMOS + p for p in zs)]  # the ICL prompts share the demos as a prefix
    n_prefix = len(tokenizer(DEMOS).input_ids)
    with torch.no_grad():
        ref = torch.stack([
            model(tokenizer(p, return_tensors="pt").input_ids,
                  output_hidden_states=True).hidden_states[-1][0, -1] for p in prompts])
    # the two kinds of prompt really differ, so matching both is not one check twice
    assert (ref[:3] - ref[3:]).abs().max() > 1e-2
    for tp, cache in ((1, True), (1, False)):
        engine = CaptureEngine(dtype="float32", max_model_len=1024, enforce_eager=True,
                               tensor_parallel_size=tp, enable_prefix_caching=cache)
        h, report = capture_states(str(tmp_path / "m"), prompts, engine,
                                   tmp_path / f"jobs-{tp}-{cache}")
        assert list(h.shape) == [len(prompts), model.config.hidden_size]
        assert (h - ref).abs().max() < 1e-5, (tp, cache, float((h - ref).abs().max()))
        cached = report["cached_tokens"]
        if cache:  # the later ICL prompts found the demos' full blocks in the cache
            assert all(0 < c <= n_prefix for c in cached[4:]), cached
        else:
            assert not any(cached), cached
