"""apply: the transformers reference path, h_tv = h + W h before the LM head, every step."""

from __future__ import annotations

import torch

from ltv_vllm.core.vector import TaskVector, model_identity
from ltv_vllm.extraction.apply import generate_with_task_vector, task_vector_applied
from ltv_vllm.extraction.capture import Capturer
from ltv_vllm.tasks.specs import BUILTIN_TASKS

PROMPT = "Review: the plot is dull\nSentiment:"


def vector(model, kind="hidden", rank=4, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    d = model.config.hidden_size
    d_out = d if kind == "hidden" else model.config.vocab_size
    return TaskVector(kind, scale * torch.randn(d_out, rank, generator=g),
                      torch.linalg.qr(torch.randn(d, rank, generator=g))[0],
                      None, model_identity(model), (1, 2),
                      {"task": BUILTIN_TASKS["sst2"].to_dict()})


def test_hidden_shift_exactly_before_lm_head(tiny_model, tokenizer):
    tv = vector(tiny_model)
    h = Capturer(tiny_model, tokenizer, progress=False).hidden([PROMPT])  # (1, d)
    W = tv.U @ tv.V.T
    expected = tiny_model.lm_head(h + h @ W.T)  # independent: dense W, manual projection
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        plain = tiny_model(**ids).logits[0, -1]
        with task_vector_applied(tiny_model, tv):
            shifted = tiny_model(**ids).logits[0, -1]
        restored = tiny_model(**ids).logits[0, -1]
    torch.testing.assert_close(shifted, expected[0], atol=1e-4, rtol=1e-4)
    assert (shifted - plain).abs().max() > 1e-2
    assert torch.equal(restored, plain)  # the hook removed itself


def test_logit_kind_adds_to_logits(tiny_model, tokenizer):
    tv = vector(tiny_model, kind="logit")
    h = Capturer(tiny_model, tokenizer, progress=False).hidden([PROMPT])
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        plain = tiny_model(**ids).logits[0, -1]
        with task_vector_applied(tiny_model, tv):
            got = tiny_model(**ids).logits[0, -1]
    torch.testing.assert_close(got, plain + (h @ tv.V @ tv.U.T)[0], atol=1e-4, rtol=1e-4)


def test_generation_shifts_every_step(tiny_model, tokenizer):
    """Greedy decoding with the hook equals a hand-written loop that shifts every step."""
    tv = vector(tiny_model, scale=2.0, seed=3)
    cap = Capturer(tiny_model, tokenizer, progress=False)
    text = PROMPT
    ids = tokenizer(PROMPT)["input_ids"]
    for _ in range(6):
        h = cap.forward_last(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        ids = ids + [int(tiny_model.lm_head(tv.shift_hidden(h)).argmax())]
    manual = tokenizer.decode(ids[len(tokenizer(text)["input_ids"]):], skip_special_tokens=True)
    got = generate_with_task_vector(tiny_model, tokenizer, PROMPT, tv, max_new_tokens=6)
    plain = generate_with_task_vector(tiny_model, tokenizer, PROMPT, None, max_new_tokens=6)
    assert got == manual
    assert got != plain
    # shifting only the first token (the reference code's defect) gives another output
    first_only = [*tokenizer(PROMPT)["input_ids"]]
    for step in range(6):
        h = cap.forward_last(torch.tensor([first_only]),
                              torch.ones(1, len(first_only), dtype=torch.long))
        h = tv.shift_hidden(h) if step == 0 else h
        first_only.append(int(tiny_model.lm_head(h).argmax()))
    assert tokenizer.decode(first_only[len(tokenizer(text)["input_ids"]):]) != got


def test_wrong_model_refused(tiny_model, tokenizer):
    import pytest

    from conftest import make_llama
    from ltv_vllm.core.vector import VectorError

    tv = vector(tiny_model)
    other = make_llama(len(tokenizer), seed=11)
    with pytest.raises(VectorError), task_vector_applied(other, tv):
        pass
