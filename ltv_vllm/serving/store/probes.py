"""The self-check's probe tasks, as a vector file and as a server's engine holds them. Pure
of vLLM; runs in the launcher's process (`serve` plans and writes them: `served_probes`),
the self-check's job process (`offline.selfcheck`) and vLLM's API-server process (the names
and layer signatures its start-up check reads: `api_server.selfcheck`).

A probe is a rank-1 logit-space vector with zero factors and a bias of +BIAS on a token of
its own (the last ordinary tokens of the vocabulary): its shift is the same on every row,
whatever the state, and shows in the step's distribution (`selfcheck.check_rows`); a layer
probe (below) is a layer task whose shifted steps all show one distribution.
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


# Layer probes (a server that serves layer tasks, and `ltv-vllm selfcheck`): a layer task at
# the last decoder block whose bias is so large that the final RMSNorm sees it alone, so the
# step's distribution is softmax(W_lm (γ ⊙ b / rms(b)) + b_lm) whatever the context: computed
# here from the checkpoint's LM head and final norm (its `Signature`: best token, second,
# their gap) and read back off each step (`selfcheck_rows.check_rows`). The bias points along
# a token's own head row (over γ), the token chosen for a wide gap and a clear second. Not on
# float16 engines, whose range cannot hold a bias that drowns every state.
LAYER_PROBES = {"selfcheck-layer-last": "last", "selfcheck-layer-all": "all",
                "selfcheck-layer-two": "2"}
LAYER_BIAS_RMS = 1e8  # drowns any residual state in bfloat16 and float32


@dataclass(frozen=True)
class Signature:
    """What a step a layer probe shifted shows: its best and second tokens and their gap
    (nats), within `tol` of the gap (the engine dtype's rounding of the logits)."""

    token: int
    second: int
    gap: float
    tol: float

    def shows(self, token: int, second: int, gap: float) -> bool:
        return token == self.token and second == self.second and abs(gap - self.gap) <= self.tol

    def record(self) -> list[float]:
        return [self.token, self.second, self.gap, self.tol]

    @classmethod
    def from_record(cls, r: list[float]) -> Signature:
        return cls(int(r[0]), int(r[1]), float(r[2]), float(r[3]))


def _tolerance(dtype: str, top: float) -> float:
    """How far an engine's gap may sit from the float32 prediction: the logits' rounding."""
    return 1e-3 + 1e-4 * abs(top) if dtype == "float32" else 0.05 + abs(top) / 64


def layer_probe_tasks(model_dir: str | Path, dtype: str) -> dict[str, tuple[Any, Signature]]:
    """Each layer probe (LAYER_PROBES) as a LayerTask and its signature; ProbeError where the
    engine dtype cannot hold one or no token of the head gives a clear signature."""
    from ltv_vllm.core.layer_task import LayerPolicy, LayerTask
    from ltv_vllm.core.vector import Provenance
    from ltv_vllm.models.checkpoint import (
        identity_from_dir,
        read_final_norm,
        read_lm_head,
        read_lm_head_bias,
    )

    if dtype not in ("float32", "bfloat16"):
        raise ProbeError(f"layer probes need a bfloat16 or float32 engine, not {dtype}")
    ident = identity_from_dir(model_dir)
    head, gamma = read_lm_head(model_dir), read_final_norm(model_dir).float()
    lm_bias = read_lm_head_bias(model_dir)
    cast = getattr(torch, dtype)
    found: dict[str, tuple[Any, Signature]] = {}
    names = iter(LAYER_PROBES.items())
    name, positions = next(names)
    norms = torch.cat([w.float().norm(dim=1) for w in head.split(16384)])  # (a slice at a time)
    for t in norms.topk(min(256, head.shape[0])).indices.tolist():
        x = head[t].float() / gamma  # after the norm: γ ⊙ x / rms(x) ∝ the head row of t
        if not torch.isfinite(x).all():
            continue
        b = (x * (LAYER_BIAS_RMS / x.pow(2).mean().sqrt())).to(cast).float()  # as served
        z = _logits(head, gamma * b / b.pow(2).mean().sqrt(), lm_bias)
        top = z.topk(3)
        v, i = top.values.tolist(), top.indices.tolist()
        tol = _tolerance(dtype, v[0])
        if i[0] in {s.token for _, s in found.values()} or v[0] - v[1] < 4 * tol \
                or v[1] - v[2] < 2 * tol:
            continue
        sig = Signature(i[0], i[1], v[0] - v[1], tol)
        task = LayerTask(layers=(int(ident.num_layers) - 1,), bias=b[None], U=None, V=None,
                         model=ident, policy=LayerPolicy.parse(positions),
                         label_token_ids=(i[0],),
                         provenance=Provenance(method="selfcheck",
                                               extra={"task": {"name": name},
                                                      "signature": sig.record()}))
        found[name] = (task, sig)
        if len(found) == len(LAYER_PROBES):
            return found
        name, positions = next(names)
    raise ProbeError("no token of the LM head gives a layer probe a clear signature")


def _logits(head: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W_lm y (+ b) in float32, the head read a slice at a time (a large vocabulary's head in
    float32 at once would double its memory)."""
    z = torch.cat([w.float() @ y for w in head.split(16384)])
    return z + bias.float() if bias is not None else z


SERVED_PREFIX = "@"  # a server holds the probes as "@selfcheck-...": no client may name one


@dataclass(frozen=True)
class ServedProbes:
    """The probes a server's engine holds: `config` as its `ltv_tasks` wants them (served
    name → {"path", "steps"}); `write()` puts their files in the model cache (a few hundred
    KB, the same bytes every time) — a dry run plans them without writing. `layer`: the
    layer probes' signatures (served name → `Signature.record()`), where the server serves
    layer tasks."""

    config: dict[str, dict[str, str]]
    vectors: dict[str, Any]  # path → TaskVector or LayerTask
    layer: dict[str, list[float]] | None = None

    def write(self) -> None:
        for path, tv in self.vectors.items():
            if not Path(path).is_file():
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                tv.save(path)  # atomic

    def layer_tasks(self) -> dict[str, tuple[str, bool]]:
        """The layer probes as an engine lists its layer tasks (`contract.wire.
        layer_tasks_env`): served name → (positions, additive)."""
        from ltv_vllm.core.layer_task import LayerTask

        return {name: (str(tv.policy), tv.additive) for name, c in self.config.items()
                if isinstance(tv := self.vectors[c["path"]], LayerTask)}


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


def served_probes(model_dir: str | Path, layer_dtype: str | None = None) -> ServedProbes:
    """The probes a server holds; with `layer_dtype` (the engine's, where it serves layer
    tasks) the layer probes too."""
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
    if layer_dtype is None:
        return ServedProbes(config, vectors)
    from ltv_vllm.models.checkpoint import identity_from_dir

    # named by what its bias was computed from: a file is never another head's probe
    head = identity_from_dir(model_dir).lm_head_fingerprint[:12]
    paths = {name: root / f"{name}.{layer_dtype}.{head}.safetensors" for name in LAYER_PROBES}
    signatures = {}
    for name, (task, sig) in _layer_probes(model_dir, layer_dtype, paths).items():
        config[SERVED_PREFIX + name] = {"path": str(paths[name]), "steps": LAYER_PROBES[name]}
        vectors[str(paths[name])] = task
        signatures[SERVED_PREFIX + name] = sig.record()
    return ServedProbes(config, vectors, signatures)


def _layer_probes(model_dir: str | Path, dtype: str,
                  paths: dict[str, Path]) -> dict[str, tuple[Any, Signature]]:
    """The layer probes as an earlier start wrote them to `paths` (their signatures in their
    provenance: no pass over the LM head again), else computed (`layer_probe_tasks`); files
    that do not read back are removed first, so the computed ones replace them."""
    from ltv_vllm.core.layer_task import load_layer_task
    from ltv_vllm.core.vector import VectorError

    if all(p.is_file() for p in paths.values()):
        try:
            return {name: (task, Signature.from_record(task.provenance.extra["signature"]))
                    for name, p in paths.items() for task in (load_layer_task(p),)}
        except (VectorError, KeyError, TypeError, ValueError, IndexError):
            for p in paths.values():
                p.unlink(missing_ok=True)
    return layer_probe_tasks(model_dir, dtype)
