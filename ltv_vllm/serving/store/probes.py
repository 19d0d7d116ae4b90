"""The self-check's probe tasks, as a vector file and as a server's engine holds them. Pure
of vLLM: `serve` plans them (`served_probes`), `selfcheck` runs them.

A probe is a rank-1 logit-space vector with zero factors and a bias of +BIAS on a token of
its own (the last ordinary tokens of the vocabulary): its shift is the same on every row,
whatever the state, and shows in the step's distribution (`selfcheck.check_rows`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.errors import UserError

BIAS = 1000.0  # logits: certain at any temperature, exact in float16 and bf16
# probe name → its default step policy (the vector's meta.shift_steps)
PROBES = {"selfcheck-first": "first", "selfcheck-all": "all", "selfcheck-two": "2"}


class ProbeError(UserError):
    """Probes cannot be built for this model."""


def probe_tokens(tokenizer: Any, k: int = len(PROBES)) -> list[int]:
    """The last `k` ordinary tokens of the vocabulary (rare merges: never a bare model's
    likely answer), one per probe."""
    special = set(tokenizer.all_special_ids)
    out: list[int] = []
    for t in range(len(tokenizer) - 1, -1, -1):
        if t not in special and tokenizer.decode([t]).strip():
            out.append(t)
            if len(out) == k:
                return out
    raise ProbeError("the tokenizer has too few ordinary tokens for the probes")


def probe_vectors(model_dir: str | Path, tokens: list[int]) -> dict[str, Any]:
    """Each probe as a rank-1 logit-space TaskVector with zero factors and a +BIAS on its
    token: its shift is the same on every row, whatever the state."""
    from ltv_vllm.core.vector import TaskVector
    from ltv_vllm.models.checkpoint import identity_from_dir

    ident = identity_from_dir(model_dir)
    out = {}
    for (name, steps), token in zip(PROBES.items(), tokens, strict=True):
        bias = torch.zeros(ident.vocab_size)
        bias[token] = BIAS
        out[name] = TaskVector("logit", torch.zeros(ident.vocab_size, 1),
                               torch.zeros(ident.hidden_size, 1), bias, ident, (token,),
                               {"task": {"name": name}, "shift_steps": steps,
                                "method": "selfcheck"})
    return out


# LoRA mode: an adapter has no bias, so its probe cannot add a constant. Each is a rank-4
# logit-space vector U = LORA_SCALE · Σ_j (e_{T+j} − e_{T−j}) v_jᵀ over four orthonormal
# directions v_j (seeded): whatever the sign of v_jᵀh, one token of each pair rises by
# LORA_SCALE·|v_jᵀh|, and with four random directions some |v_jᵀh| beats the model's own
# logit gaps (tens of logits) by far. So at every step the step's best token is one of the
# probe's own eight, and never one of them on a bare row (`selfcheck.check_lora_rows`).
LORA_PROBES = ("selfcheck-lora-a", "selfcheck-lora-b", "selfcheck-lora-c")
LORA_PAIRS = 4
LORA_SCALE = 1000.0
LORA_TOKENS = 2 * LORA_PAIRS * len(LORA_PROBES)


def lora_probe_vectors(model_dir: str | Path, tokens: list[int]) -> dict[str, Any]:
    """The LoRA probes (above) as TaskVectors; `tokens`: LORA_TOKENS of `probe_tokens`,
    each probe's own eight in turn (its `label_token_ids`)."""
    from ltv_vllm.core.vector import TaskVector
    from ltv_vllm.models.checkpoint import identity_from_dir

    ident = identity_from_dir(model_dir)
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, name in enumerate(LORA_PROBES):
        own = tokens[2 * LORA_PAIRS * i: 2 * LORA_PAIRS * (i + 1)]
        U = torch.zeros(ident.vocab_size, LORA_PAIRS)
        for j in range(LORA_PAIRS):
            U[own[2 * j], j], U[own[2 * j + 1], j] = LORA_SCALE, -LORA_SCALE
        V = torch.linalg.qr(torch.randn(ident.hidden_size, LORA_PAIRS, generator=g))[0]
        out[name] = TaskVector("logit", U, V.contiguous(), None, ident, tuple(own),
                               {"task": {"name": name}, "method": "selfcheck"})
    return out


SERVED_PREFIX = "@"  # a server holds the probes as "@selfcheck-...": no client may name one


@dataclass(frozen=True)
class ServedProbes:
    """The probes a server's engine holds: `config` as its `ltv_tasks` wants them (served
    name → {"path", "steps"}); `write()` puts their files in the model cache (a few hundred
    KB, the same bytes every time) — a dry run plans them without writing."""

    config: dict[str, dict[str, str]]
    vectors: dict[str, Any]  # path → TaskVector

    def write(self) -> None:
        for path, tv in self.vectors.items():
            if not Path(path).is_file():
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                tv.save(path)  # atomic


@dataclass(frozen=True)
class ServedLoraProbes:
    """The LoRA probes a LoRA-mode server checks at start: `adapters` (name → PEFT adapter
    directory in the model cache) as the endpoint plugin sends them (`selfcheck.
    engine_selfcheck`); `write()` exports them (the same bytes every time) — a dry run plans
    them without writing."""

    model_dir: str
    adapters: dict[str, str]
    vectors: dict[str, Any]  # name → TaskVector

    def write(self) -> None:
        from ltv_vllm.serving.store.lora import export_lora

        for name, tv in self.vectors.items():
            path = Path(self.adapters[name])
            if (path / "adapter_model.safetensors").is_file():
                continue
            # written beside, then renamed: a killed start leaves no half adapter there
            tmp = path.parent / f".{name}.{os.getpid()}"
            export_lora(tv, self.model_dir, tmp, base_model=self.model_dir)
            if path.exists():  # another start wrote it meanwhile
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, path)


def served_lora_probes(model_dir: str | Path) -> ServedLoraProbes:
    import hashlib

    from transformers import AutoTokenizer

    from ltv_vllm.models.cache import cache_dir

    tokens = probe_tokens(AutoTokenizer.from_pretrained(model_dir), LORA_TOKENS)
    key = hashlib.sha256(f"lora:{Path(model_dir).resolve()}:{tokens}".encode()).hexdigest()[:12]
    vectors = lora_probe_vectors(model_dir, tokens)
    root = cache_dir() / "selfcheck" / key
    return ServedLoraProbes(str(model_dir), {n: str(root / n) for n in vectors}, vectors)


def served_probes(model_dir: str | Path) -> ServedProbes:
    import hashlib

    from transformers import AutoTokenizer

    from ltv_vllm.models.cache import cache_dir

    tokens = probe_tokens(AutoTokenizer.from_pretrained(model_dir))
    key = hashlib.sha256(f"{Path(model_dir).resolve()}:{tokens}".encode()).hexdigest()[:12]
    root = cache_dir() / "selfcheck" / key
    config, vectors = {}, {}
    for name, tv in probe_vectors(model_dir, tokens).items():
        path = str(root / f"{name}.safetensors")
        config[SERVED_PREFIX + name] = {"path": path, "steps": PROBES[name]}
        vectors[path] = tv
    return ServedProbes(config, vectors)
