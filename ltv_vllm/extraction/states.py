"""Captured states looked up by prompt: the `hidden` / `icl` interface of `Capturer`, over
a table another engine filled (vLLM's pooling runner, `offline.capture`).

An extraction on vLLM knows every prompt it needs before anything runs (the episode's
zero-shot and ICL prompts, train and test), so the CLI sends them to one engine in one job
and the pipeline reads the result through this table: the engine starts once per run, not
once per pass, and the pipeline never imports the engine (data flows one way).

    states = PromptStates(prompts, h)            # h[i] is h(prompts[i])
    states.icl(prefix, queries)                  # h(prefix + q) for each q, (n, d)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ltv_vllm.errors import UserError


class StatesError(UserError):
    """A prompt the table was not filled with (the caller planned other prompts)."""


class PromptStates:
    """h(p) of a fixed set of prompts, float32 (n, d); asked for any other prompt, refuses."""

    def __init__(self, prompts: Sequence[str], h: torch.Tensor) -> None:
        if h.ndim != 2 or h.shape[0] != len(prompts):
            raise StatesError(f"{h.shape[0] if h.ndim else 0} states for {len(prompts)} prompts")
        self.h = h.float()
        self.row = {p: i for i, p in enumerate(prompts)}

    @property
    def width(self) -> int:
        return int(self.h.shape[1])

    def hidden(self, prompts: Sequence[str], desc: str = "") -> torch.Tensor:
        """h(p) for each prompt, in order. (n, d)"""
        missing = [p for p in prompts if p not in self.row]
        if missing:
            raise StatesError(f"{len(missing)} prompt(s) were not captured"
                              f"{f' ({desc})' if desc else ''}, e.g. {missing[0][-80:]!r}")
        idx = torch.tensor([self.row[p] for p in prompts], dtype=torch.long)
        return self.h.index_select(0, idx) if len(prompts) else self.h.new_zeros(0, self.width)

    def icl(self, prefix: str, prompts: Sequence[str], desc: str = "") -> torch.Tensor:
        """h(prefix + p) for each prompt. (n, d)"""
        return self.hidden([prefix + p for p in prompts], desc)
