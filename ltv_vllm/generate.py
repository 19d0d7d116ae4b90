"""Greedy generation in transformers: the reference for regression answers.

`greedy(cap, prompts)` decodes every prompt greedily in left-padded batches through
transformers' own `generate`, under whatever hooks the caller holds (a method's `applied`:
LTV, mean shift and the MLP map act on every step that way). `mapping` (h → the state the
LM head sees, e.g. a hidden-space method's `shift`) is applied by `greedy` itself:

  steps="every": at every generated token (the paper's regression setting, and what serving
                 does);
  steps="first": at the first generated token only (what the paper's reference code did: it
                 injected at prefill), an ablation.

With `prefix` (the demos), the prefix's KV cache is computed once and shared by every
batch as `[prefix | pads | query]` (the pads masked out, positions counting real tokens
only), so an ICL prompt costs its query, not its demos; a prompt whose tokenisation does not
start with the prefix's tokens is run in full instead. The output is the generated text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from .capture import Capturer, Prefix, _batches, left_pad, lm_head
from .errors import UserError

STEPS = ("every", "first")


class GenerateError(UserError):
    """Generation that cannot run as asked."""


@contextmanager
def mapped_head(model, mapping: Callable[[torch.Tensor], torch.Tensor],
                steps: str = "every") -> Iterator[Callable[[], None]]:
    """h → mapping(h) at the LM head's input (computed in float32 on h's device). Yields
    `restart()`: call it before each
    `generate`, so that with steps="first" the next LM-head call (the prefill's) is shifted
    and the later ones (one per generated token) are not."""
    if steps not in STEPS:
        raise GenerateError(f"steps must be one of {', '.join(STEPS)}, got {steps!r}")
    head = lm_head(model)
    calls = [0]

    def pre_hook(_mod, args):
        calls[0] += 1
        if steps == "first" and calls[0] > 1:
            return None
        h = args[0]
        return (mapping(h.float()).to(h.dtype), *args[1:])

    def restart() -> None:
        calls[0] = 0

    handle = head.register_forward_pre_hook(pre_hook)
    try:
        yield restart
    finally:
        handle.remove()


def _shared_cache(prefix: Prefix, bsz: int, config) -> DynamicCache:
    # Views of the prefix's tensors, expanded over the batch: generation concatenates new
    # keys onto them (new tensors), so the prefix is never written and serves every batch.
    return DynamicCache(
        ddp_cache_data=[(layer.keys.expand(bsz, -1, -1, -1), layer.values.expand(bsz, -1, -1, -1))
                        for layer in prefix.cache.layers],
        config=config,
    )


@torch.no_grad()
def greedy(
    cap: Capturer,
    prompts: Sequence[str],
    *,
    prefix: str | None = None,
    max_new_tokens: int = 12,
    mapping: Callable[[torch.Tensor], torch.Tensor] | None = None,
    steps: str = "every",
    desc: str = "generate",
) -> list[str]:
    """Greedy continuations of `prefix + p` for each prompt, decoded without special tokens."""
    if max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    model, tok = cap.model, cap.tokenizer
    pre = cap.encode_prefix(prefix, then=prompts[0] if prompts else None) if prefix else None
    seqs, cached = [], []
    for p in prompts:
        full = cap.encode((prefix or "") + p)
        n = len(pre.ids) if pre is not None else 0
        ok = pre is not None and full[:n] == pre.ids and len(full) > n
        seqs.append(full[n:] if ok else full)
        cached.append(ok)
    limit = cap.max_length
    for s, c in zip(seqs, cached, strict=True):
        total = len(s) + (len(pre.ids) if c else 0) + max_new_tokens
        if limit is not None and total > limit:
            raise GenerateError(f"a prompt of {total - max_new_tokens} tokens plus "
                                f"{max_new_tokens} new ones exceeds the model context of {limit}")
    eos = tok.eos_token_id
    gen = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": cap.pad_id,
           "eos_token_id": eos, "temperature": None, "top_p": None, "top_k": None}
    out: list[str | None] = [None] * len(prompts)
    # Same-length prompts together (little padding); cached and full prompts apart.
    order = sorted(range(len(prompts)), key=lambda i: (cached[i], len(seqs[i])))
    groups = [[i for i in order if cached[i] == c] for c in (False, True)]
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not cap.progress,
               leave=False)
    with (mapped_head(model, mapping, steps) if mapping is not None else _noop()) as restart:
        for use_cache, group in zip((False, True), groups, strict=True):
            for idx in _batches(len(group), cap.batch_size):
                rows = [group[i] for i in idx]
                ids, mask = left_pad([seqs[r] for r in rows], cap.pad_id)
                kwargs = {}
                if use_cache:
                    assert pre is not None
                    n = len(pre.ids)
                    ids = torch.cat([torch.tensor([pre.ids] * len(rows)), ids], dim=1)
                    mask = torch.cat([torch.ones(len(rows), n, dtype=mask.dtype), mask], dim=1)
                    kwargs["past_key_values"] = _shared_cache(pre, len(rows), model.config)
                restart()
                res = model.generate(input_ids=ids.to(cap.device),
                                     attention_mask=mask.to(cap.device), **gen, **kwargs)
                new = res[:, ids.shape[1]:].cpu()
                for r, toks in zip(rows, new, strict=True):
                    out[r] = tok.decode(toks, skip_special_tokens=True)
                bar.update(len(rows))
    bar.close()
    return [o if o is not None else "" for o in out]


@contextmanager
def _noop() -> Iterator[Callable[[], None]]:
    yield lambda: None
