"""Greedy generation in transformers: the reference for regression answers.

`greedy(cap, prompts)` decodes every prompt greedily in left-padded batches through
transformers' own `generate`, under whatever hooks the caller holds (a method's `applied`:
LTV, mean shift and the MLP map act on every step that way). `mapping` (h → the state the
LM head sees, e.g. a hidden-space method's `shift`) is applied by `greedy` itself:

  steps="every": at every generated token (the paper's regression setting, and what serving
                 does);
  steps="first": at the first generated token only (what the paper's reference code did: it
                 injected at prefill), an ablation;
  steps=n:       at the first n generated tokens (the serving step policy's reference).

With `prefix` (the demos), the prefix's KV cache is computed once and shared by every
batch as `[prefix | pads | query]` (the pads masked out, positions counting real tokens
only), so an ICL prompt costs its query, not its demos; a prompt whose tokenisation does not
start with the prefix's tokens is run in full instead. The output is the generated text.

`greedy_states` also returns each prompt's final state at its last token, read from the
prefill (so scoring needs no second forward pass), and `greedy_shared` runs several head maps
(zero-shot, LTV, the mean shift, first-step LTV, ...) over the same prompts with one prefill
per batch: a map at the head's input does not change the prompt's KV cache.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ltv_vllm.errors import UserError
from ltv_vllm.extraction.capture import Capturer, Prefix, _batches, left_pad, lm_head

STEPS = ("every", "first")


class GenerateError(UserError):
    """Generation that cannot run as asked."""


def leading_steps(steps: str | int) -> int | None:
    """`every` | `first` | n ≥ 0 → how many leading generated tokens are mapped (None: all)."""
    if steps in STEPS:
        return None if steps == "every" else 1
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0:
        return steps
    raise GenerateError(f"steps must be one of {', '.join(STEPS)} or a count ≥ 0, got {steps!r}")


@contextmanager
def mapped_head(model, mapping: Callable[[torch.Tensor], torch.Tensor] | None,
                steps: str | int = "every", record: list[torch.Tensor] | None = None
                ) -> Iterator[Callable[[], None]]:
    """h → mapping(h) at the LM head's input (computed in float32 on h's device; None: h
    as it is). Yields `restart()`: call it before each `generate`, so that with steps="first"
    the next LM-head call (the prefill's) is shifted and the later ones (one per generated
    token) are not. `record`: each prefill's state at the last position, before the mapping,
    is appended to it, (B, d) float32 on the CPU."""
    n = leading_steps(steps)
    head = lm_head(model)
    calls = [0]

    def pre_hook(_mod, args):
        calls[0] += 1
        h = args[0]
        if calls[0] == 1 and record is not None:
            record.append(h[:, -1].float().cpu())
        if mapping is None or (n is not None and calls[0] > n):
            return None
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


def _encoded(cap: Capturer, prompts: Sequence[str], prefix: str | None,
             max_new_tokens: int) -> tuple[Prefix | None, list[list[int]], list[bool]]:
    """Each prompt's tokens after the shared prefix (cached) or in full, checked against the
    context before anything runs."""
    if max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
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
    return pre, seqs, cached


def _gen_kwargs(cap: Capturer, max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": cap.pad_id,
            "eos_token_id": cap.tokenizer.eos_token_id, "temperature": None, "top_p": None,
            "top_k": None}


def greedy(cap: Capturer, prompts: Sequence[str], **options: Any) -> list[str]:
    """Greedy continuations of `prefix + p` for each prompt, decoded without special tokens
    (`options` as `greedy_states`: prefix, max_new_tokens, mapping, steps, desc)."""
    return greedy_states(cap, prompts, **options)[0]


@torch.no_grad()
def greedy_states(
    cap: Capturer,
    prompts: Sequence[str],
    *,
    prefix: str | None = None,
    max_new_tokens: int = 12,
    mapping: Callable[[torch.Tensor], torch.Tensor] | None = None,
    steps: str | int = "every",
    desc: str = "generate",
) -> tuple[list[str], torch.Tensor]:
    """`greedy`, and each prompt's final state at its last token, (n, d) float32 on the CPU:
    what `Capturer.hidden` (or `.icl` with the prefix) returns, read from the generation's own
    prefill instead of a second forward pass."""
    model, tok = cap.model, cap.tokenizer
    pre, seqs, cached = _encoded(cap, prompts, prefix, max_new_tokens)
    gen = _gen_kwargs(cap, max_new_tokens)
    out: list[str | None] = [None] * len(prompts)
    states = torch.empty(len(prompts), model.config.hidden_size)
    record: list[torch.Tensor] = []
    # Same-length prompts together (little padding); cached and full prompts apart.
    order = sorted(range(len(prompts)), key=lambda i: (cached[i], len(seqs[i])))
    groups = [[i for i in order if cached[i] == c] for c in (False, True)]
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not cap.progress,
               leave=False)
    with mapped_head(model, mapping, steps, record) as restart:
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
                states[rows] = record.pop()
                new = res[:, ids.shape[1]:].cpu()
                for r, toks in zip(rows, new, strict=True):
                    out[r] = tok.decode(toks, skip_special_tokens=True)
                bar.update(len(rows))
    bar.close()
    return [o if o is not None else "" for o in out], states


Mapping = tuple[Callable[[torch.Tensor], torch.Tensor] | None, str]


@torch.no_grad()
def greedy_shared(
    cap: Capturer,
    prompts: Sequence[str],
    maps: dict[str, Mapping],
    *,
    max_new_tokens: int = 12,
    desc: str = "generate",
) -> tuple[dict[str, list[str]], torch.Tensor]:
    """`greedy` for several head maps over the same prompts, sharing one prefill.

    `maps`: name → (mapping or None, steps). A map that acts only at the LM head's input
    leaves the prompt's KV cache as it is, so each batch's prompts run once; each map then
    takes its first token from the shared last state and continues from a copy of that
    cache. Returns every map's texts (each equal to its own `greedy` run, tested) and the
    unmapped final states, as `greedy_states`."""
    for _, steps in maps.values():
        if steps not in STEPS:
            raise GenerateError(f"steps must be one of {', '.join(STEPS)}, got {steps!r}")
    model, tok = cap.model, cap.tokenizer
    _, seqs, _ = _encoded(cap, prompts, None, max_new_tokens)
    gen = _gen_kwargs(cap, max_new_tokens - 1)
    head, eos = lm_head(model), tok.eos_token_id
    out: dict[str, list[str]] = {name: [""] * len(prompts) for name in maps}
    states = torch.empty(len(prompts), model.config.hidden_size)
    order = sorted(range(len(prompts)), key=lambda i: len(seqs[i]))
    bar = tqdm(total=len(prompts) * len(maps), desc=desc, unit="answer",
               disable=not cap.progress, leave=False)
    for idx in _batches(len(order), cap.batch_size):
        rows = [order[i] for i in idx]
        ids, mask = left_pad([seqs[r] for r in rows], cap.pad_id)
        ids, mask = ids.to(cap.device), mask.to(cap.device)
        # the prefill as `generate` runs it: positions count real tokens, pads sit at 1
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        pref = cap.base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        h = pref.last_hidden_state[:, -1:]
        states[rows] = h[:, 0].float().cpu()
        for name, (mapping, steps) in maps.items():
            h_in = h if mapping is None else mapping(h.float()).to(h.dtype)
            first = head(h_in)[:, -1].float().argmax(-1, keepdim=True)
            new = first.cpu()
            if max_new_tokens > 1:
                every = mapping is not None and steps == "every"
                with mapped_head(model, mapping if every else None) as restart:
                    restart()
                    res = model.generate(
                        input_ids=torch.cat([ids, first], 1),
                        attention_mask=torch.cat([mask, torch.ones_like(first)], 1),
                        past_key_values=copy.deepcopy(pref.past_key_values), **gen)
                new = torch.cat([new, res[:, ids.shape[1] + 1:].cpu()], 1)
            for r, toks in zip(rows, new.tolist(), strict=True):
                if eos in toks:  # what generate does after EOS: nothing more is kept
                    toks = toks[:toks.index(eos) + 1]
                out[name][r] = tok.decode(toks, skip_special_tokens=True)
            bar.update(len(rows))
    bar.close()
    return out, states
