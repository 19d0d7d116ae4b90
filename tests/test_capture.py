"""capture: post-norm last-token states, left padding, and the shared demo KV cache."""

from __future__ import annotations

import pytest
import torch

from conftest import make_llama, make_tokenizer
from ltv_vllm.extraction.capture import (
    CaptureError,
    Capturer,
    base_model,
    bucketed,
    label_head,
    lm_head,
)
from ltv_vllm.tasks.specs import Task

TASK = Task("toy", "Review", "Sentiment", ("negative", "positive"), "unused")
TEXTS = [
    "a gorgeous movie",
    "dull",
    "the plot is dull and the acting is worse, and the team wins nothing at all",
    "witty",
    "stocks rally as markets rebound and leaders meet",
    "it is what it is",
    "a new chip",
]
PREFIX = TASK.demo("a witty movie", 1) + TASK.demo("the acting is worse", 0) + TASK.demo("dull", 0)


def test_hidden_is_lm_head_input(tiny_model, tokenizer):
    """h(p) times the LM head is transformers' own last-token logits (post-norm state)."""
    cap = Capturer(tiny_model, tokenizer, batch_size=4, progress=False)
    prompts = [TASK.query(t) for t in TEXTS]
    h = cap.hidden(prompts)
    for i, p in enumerate(prompts):
        ids = tokenizer(p, return_tensors="pt")
        with torch.no_grad():
            ref = tiny_model(**ids).logits[0, -1]
        got = lm_head(tiny_model)(h[i])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bucket", [False, True])
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_left_padded_batch_equals_unbatched(tiny_model, tokenizer, batch_size, bucket):
    cap = Capturer(tiny_model, tokenizer, batch_size=batch_size, progress=False)
    cap.bucket = bucket  # a GPU's default; extra left padding changes no state
    prompts = [TASK.query(t) for t in TEXTS]
    batched = cap.hidden(prompts)
    single = torch.cat([cap.hidden([p]) for p in prompts])
    assert torch.allclose(batched, single, atol=1e-4), (batched - single).abs().max()


@pytest.mark.parametrize("batch_size", [1, 4, 16])
@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("bucket", [False, True])
def test_shared_demo_cache_equals_naive_full_forward(batch_size, bos, pack, attn, bucket):
    tok = make_tokenizer(bos=bos)
    model = make_llama(len(tok), seed=1)
    model.config._attn_implementation = attn
    cap = Capturer(model, tok, batch_size=batch_size, progress=False, pack=pack)
    cap.bucket = bucket  # pad tokens after the packed queries, or more left padding
    assert cap.packed == pack
    prompts = [TASK.query(t) for t in TEXTS]
    cached = cap.icl(PREFIX, prompts)
    naive = cap.naive([PREFIX + p for p in prompts])
    err = (cached - naive).abs().max().item()
    assert err <= 1e-4, err
    # and the ICL state really differs from zero-shot (the prefix is not ignored)
    assert (cached - cap.hidden(prompts)).abs().max() > 1e-2


def test_bucketed_lengths():
    """At most 1/8 more than asked, a multiple of 8 or of a power of two ≥ n/16."""
    assert [bucketed(n) for n in (1, 8, 9, 17, 64, 65, 127, 128, 129, 2000, 2049)] == \
        [8, 8, 16, 24, 64, 72, 128, 128, 144, 2048, 2304]
    for n in range(1, 5000):
        b = bucketed(n)
        assert n <= b <= max(n + 7, n * 9 // 8 + 1)


@pytest.mark.parametrize("pack", [True, False])
def test_a_gpu_capture_feeds_bucketed_lengths(tiny_model, tokenizer, pack):
    """With buckets (a GPU's default) every forward's length is a bucket's: the passes reuse
    a few shapes instead of one per batch."""
    cap = Capturer(tiny_model, tokenizer, batch_size=2, progress=False, pack=pack)
    assert cap.bucket is False  # the CPU's default
    cap.bucket = True
    widths: list[int] = []
    handle = base_model(tiny_model).register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        cap.icl(PREFIX, [TASK.query(t) for t in TEXTS])
        cap.hidden([TASK.query(t) for t in TEXTS])
    finally:
        handle.remove()
    prefix_pass = 1
    assert len(widths) > prefix_pass + 2
    assert all(w == bucketed(w) for w in widths[prefix_pass:]), widths


def test_prefix_boundary_merge_falls_back_to_full_prompt(tiny_model, tokenizer):
    """When prefix+query tokenises across the boundary, the full prompt is run instead."""
    cap = Capturer(tiny_model, tokenizer, batch_size=4, progress=False)
    prefix = "Review: a gorg"  # "gorg" + "eous" merges into other tokens in the full string
    prompts = ["eous movie", "\nSentiment:"]
    full_ids = tokenizer(prefix + prompts[0])["input_ids"]
    assert full_ids[: len(tokenizer(prefix)["input_ids"])] != tokenizer(prefix)["input_ids"]
    got = cap.icl(prefix, prompts)
    ref = cap.naive([prefix + p for p in prompts])
    assert torch.allclose(got, ref, atol=1e-4)


def test_prefix_ending_in_a_whitespace_run_is_cached_up_to_the_boundary(tiny_model):
    """"...\n\n" alone ends in one token, but before "x:" the pre-tokenizer splits the run
    ("\n", "\nx"...): the demos' cache stops where the two tokenisations part, so every query
    still reuses it (instead of all running in full), and h equals the full forward."""
    # a tokenizer that learnt "\n\n" as one token (SmolLM2's does: "ĊĊ")
    tokenizer = make_tokenizer(corpus=["x: [1.0000, -2.5000]\ny: 0.1234\n\n" * 4] * 40)
    assert len(tokenizer) <= tiny_model.config.vocab_size
    cap = Capturer(tiny_model, tokenizer, batch_size=4, progress=False)
    prefix = "x: [1.0000]\ny: 2.0000\n\nx: [-3.0000]\ny: -6.0000\n\n"
    prompts = ["x: [0.5000]\ny:", "x: [-0.2500]\ny:"]
    alone = tokenizer(prefix)["input_ids"]
    full = tokenizer(prefix + prompts[0])["input_ids"]
    assert full[: len(alone)] != alone  # the boundary merges: the old path ran every prompt full
    pre = cap.encode_prefix(prefix, then=prompts[0])
    assert 0 < len(pre.ids) < len(alone) and full[: len(pre.ids)] == pre.ids
    assert all(tokenizer(prefix + p)["input_ids"][: len(pre.ids)] == pre.ids for p in prompts)
    got = cap.icl(prefix, prompts)
    torch.testing.assert_close(got, cap.naive([prefix + p for p in prompts]), atol=1e-4,
                               rtol=1e-4)


def test_prompt_longer_than_context_is_a_clear_error(tiny_model, tokenizer):
    cap = Capturer(tiny_model, tokenizer, progress=False, max_length=16)
    with pytest.raises(CaptureError, match="exceeds the model context of 16"):
        cap.hidden([TASK.query(TEXTS[2])])


def test_label_head_rows(tiny_model):
    w, b = label_head(tiny_model, [5, 7])
    torch.testing.assert_close(w, tiny_model.lm_head.weight[[5, 7]].float())
    assert torch.equal(b, torch.zeros(2))
