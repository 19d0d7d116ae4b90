"""LayerTask: a shift of the residual stream at the output of decoder blocks (a layer task).

For each of its layers ℓ (a 0-based decoder-block index), at the positions its policy names:

    h_ℓ ← h_ℓ + scale · (U_ℓ (V_ℓᵀ h_ℓ) + b_ℓ)

h_ℓ is the residual stream leaving block ℓ, before any final norm (transformers'
`hidden_states[ℓ + 1]`, except for the last block, whose entry there is after the norm).
An additive task (a control vector, a steering vector, a mean shift) has only b_ℓ; a fitted
one (LTV at layer ℓ) has the low-rank map U_ℓ V_ℓᵀ too. One model per task: a file records
the model it was made for, and refuses another's width or depth in one line.

Positions, in the vocabulary of the final-layer step policies (`vector.parse_steps`): a
policy is (prompt, steps). `steps` counts the rows that produce generated tokens, as
`ltv_steps` always has: the last prompt token produces the first generated token, generated
token i (fed back) produces token i + 1. `prompt` adds every prompt token. So

    last (= first)  the last prompt token only          (prompt=False, steps=1)
    N               the first N token-producing rows    (prompt=False, steps=N)
    generated       every token-producing row           (prompt=False, steps=all)
    prompt          every prompt token, no decode row   (prompt=True,  steps=1)
    all             every token, prompt and generated   (prompt=True,  steps=all)

In a prefill, the prompt's rows (all of them with `prompt`, else its last); in a decode step,
the fed-back token's row while its step is within `steps`. "all" is what repeng's
ControlModel, llama.cpp's control vectors and steering-vectors' `apply()` do: every position.

Files: the task-vector formats (`core.vector`), kind "layer", format version 3 (an older
reader refuses it as newer instead of misreading it), tensors U, V (n_layers, d, r) and bias
(n_layers, d), and the header's "layer": {"layers": [...], "positions": "..."}. Pure data and
tensor maths; the files are read through `core.vector_files`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.core.fileio import atomic_write
from ltv_vllm.core.vector import (
    ALL,
    FORMAT,
    ModelIdentity,
    Provenance,
    check_identity,
    parse_steps,
)
from ltv_vllm.core.vector_files import VectorError, read_safetensors, torch_load

KIND = "layer"
FORMAT_VERSION = 3  # 3: layer tasks (a reader of 1–2 refuses the file as newer)
POSITIONS = ("last", "prompt", "generated", "all")  # the names; a count N is the fifth form


@dataclass(frozen=True)
class LayerPolicy:
    """Which positions a layer task shifts (module docstring): every prompt token or not,
    and how many token-producing rows (None: every one)."""

    prompt: bool = True
    steps: int | None = ALL

    def __post_init__(self) -> None:
        if self.prompt and self.steps == 0:
            # the prompt includes its last token, the first token-producing row: one spelling
            object.__setattr__(self, "steps", 1)
        if self.prompt and self.steps not in (1, ALL):
            raise ValueError("a policy that shifts the prompt shifts no generated token "
                             "('prompt') or every one ('all')")

    @classmethod
    def parse(cls, value: Any) -> LayerPolicy:
        """last | first | prompt | generated | all | N (a count ≥ 0, as `ltv_steps`); anything
        else is a ValueError naming the forms."""
        try:
            n = parse_steps(value)  # one vocabulary: the steps part, or a ValueError
        except ValueError:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ValueError("a layer task's positions are last, prompt, generated, all or a "
                             f"count of generated steps, got {shown}") from None
        return cls(value in ("prompt", "all") and isinstance(value, str), n)

    def __str__(self) -> str:
        if self.prompt:
            return "all" if self.steps is ALL else "prompt"
        return "generated" if self.steps is ALL else "last" if self.steps == 1 \
            else str(self.steps)

    def shifts_step(self, step: int) -> bool:
        """Whether the row producing generated token `step` (1: the last prompt token's) is
        shifted."""
        return self.steps is ALL or step <= self.steps


@dataclass(frozen=True)
class LayerTask:
    layers: tuple[int, ...]           # decoder-block indices, ascending, distinct
    bias: torch.Tensor | None         # (n_layers, d): the additive part per layer
    U: torch.Tensor | None            # (n_layers, d, r): the low-rank map's output side
    V: torch.Tensor | None            # (n_layers, d, r): its input side
    model: ModelIdentity              # the model it was made for (width, depth, LM head)
    policy: LayerPolicy = field(default_factory=LayerPolicy)
    label_token_ids: tuple[int, ...] = ()
    provenance: Provenance = field(default_factory=Provenance)

    def __post_init__(self) -> None:
        if isinstance(self.provenance, dict):
            object.__setattr__(self, "provenance", Provenance.from_dict(self.provenance))
        layers = tuple(self.layers)
        object.__setattr__(self, "layers", layers)
        if not layers:
            raise VectorError("a layer task needs at least one layer")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) \
                or list(layers) != sorted(set(layers)):
            raise VectorError(f"a layer task's layers are distinct block indices ≥ 0 in "
                              f"ascending order, got {list(layers)[:12]}")
        n, d = len(layers), self.model.hidden_size
        depth = self.model.num_layers
        if depth is not None and layers[-1] >= depth:
            raise VectorError(f"layer {layers[-1]} is past the last block of {self.model.name} "
                              f"({depth} layers: 0 to {depth - 1})")
        if (self.U is None) != (self.V is None):
            raise VectorError("a layer task's map needs both U and V (or neither)")
        if self.bias is None and self.U is None:
            raise VectorError("a layer task needs a bias, a map (U, V), or both")
        if self.bias is not None and tuple(self.bias.shape) != (n, d):
            raise VectorError(f"bias must have shape ({n}, {d}) for {n} layers of width {d}, "
                              f"got {tuple(self.bias.shape)}")
        if self.U is not None:
            assert self.V is not None
            if self.U.ndim != 3 or self.U.shape[:2] != (n, d) or self.V.shape != self.U.shape:
                raise VectorError(f"U and V must both have shape ({n}, {d}, r), got "
                                  f"{tuple(self.U.shape)} and {tuple(self.V.shape)}")
        for name in ("U", "V", "bias"):
            t = getattr(self, name)
            if t is not None and not bool(torch.isfinite(t).all()):
                raise VectorError(f"layer task {self.task_name!r}: {name} holds non-finite "
                                  "values (NaN or inf)")

    # -- reading it -------------------------------------------------------------------------
    @property
    def task_name(self) -> str:
        return str((self.provenance.task or {}).get("name", "?"))

    @property
    def rank(self) -> int:
        return 0 if self.U is None else int(self.U.shape[2])

    @property
    def additive(self) -> bool:
        """Only a bias: a constant per layer (what control vectors are), so tasks combine."""
        return self.U is None

    def delta(self, layer: int, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """scale · (U_ℓ (V_ℓᵀ h) + b_ℓ) for rows h (B, d) at block `layer` (one of `layers`).
        h must share the task's device and dtype (`to`)."""
        i = self.layers.index(layer)
        out = torch.zeros_like(h) if self.U is None else (h @ self.V[i]) @ self.U[i].T
        if self.bias is not None:
            out = out + self.bias[i]
        return out * scale if scale != 1.0 else out

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> LayerTask:
        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.to(device=device, dtype=dtype) if t is not None else None

        return replace(self, U=cast(self.U), V=cast(self.V), bias=cast(self.bias))

    def scaled(self, scale: float) -> LayerTask:
        """The same task with its whole shift (map and bias) multiplied by `scale`."""
        return replace(self, U=None if self.U is None else self.U * scale,
                       bias=None if self.bias is None else self.bias * scale)

    def check_model(self, ident: ModelIdentity) -> None:
        """Refuse a model this task does not fit (width, depth, LM head), in one line."""
        check_identity(self.model, ident, f"layer task {self.task_name!r}")

    def check_fits(self, hidden_size: int, num_layers: int, what: str) -> None:
        """Refuse a model whose width or depth does not fit this task's layers, in one line
        (a server checks this against the served model's config)."""
        if hidden_size != self.model.hidden_size:
            raise VectorError(f"{what} is for hidden size {self.model.hidden_size} "
                              f"({self.model.name}), the model has {hidden_size}")
        if self.layers[-1] >= num_layers:
            raise VectorError(f"{what} shifts block {self.layers[-1]}, the model has "
                              f"{num_layers} blocks (0 to {num_layers - 1})")

    # -- files ------------------------------------------------------------------------------
    def _header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "model": self.model.to_dict(),
            "label_token_ids": list(self.label_token_ids),
            "layer": {"layers": list(self.layers), "positions": str(self.policy)},
            "meta": self.provenance.to_dict(),
        }

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name in ("U", "V", "bias"):
            t = getattr(self, name)
            if t is not None:
                out[name] = t.float().contiguous()
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.suffix not in (".pt", ".safetensors"):
            raise VectorError(f"task-vector files end in .pt or .safetensors, got {path.name!r}")
        header = json.dumps(self._header())
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            return atomic_write(path, lambda tmp: save_file(self._tensors(), tmp,
                                                            metadata={"ltv_vllm": header}))
        return atomic_write(path, lambda tmp: torch.save(
            {"tensors": self._tensors(), "ltv_vllm": header}, tmp))


def combine(parts: list[tuple[LayerTask, float]]) -> LayerTask:
    """Several additive layer tasks, each with its scale, as one: per layer the sum of
    scale · b over the tasks that shift it (the union of their layers). Refused in one line
    where they cannot combine: a map (U, V) does not add to another's input, and tasks
    for different models or with different positions have no one sum."""
    if not parts:
        raise VectorError("nothing to combine")
    first = parts[0][0]
    if len(parts) == 1:
        return first.scaled(parts[0][1])
    for tv, _ in parts:
        if not tv.additive:
            raise VectorError(f"layer task {tv.task_name!r} is a map (U, V), which does not "
                              "combine with other tasks; only additive layer tasks combine")
        if tv.model.hidden_size != first.model.hidden_size or \
                tv.model.lm_head_fingerprint != first.model.lm_head_fingerprint:
            raise VectorError(f"layer tasks {first.task_name!r} and {tv.task_name!r} were "
                              "made for different models")
        if tv.policy != first.policy:
            raise VectorError(f"layer tasks {first.task_name!r} ({first.policy}) and "
                              f"{tv.task_name!r} ({tv.policy}) shift different positions")
    layers = sorted({ell for tv, _ in parts for ell in tv.layers})
    bias = torch.zeros(len(layers), first.model.hidden_size)
    for tv, scale in parts:
        assert tv.bias is not None
        for i, ell in enumerate(tv.layers):
            bias[layers.index(ell)] += scale * tv.bias[i].float()
    names = "+".join(tv.task_name for tv, _ in parts)
    return LayerTask(layers=tuple(layers), bias=bias, U=None, V=None, model=first.model,
                     policy=first.policy, provenance=Provenance(
                         method="combined", task={"name": names}))


def blocks_text(layers: tuple[int, ...]) -> str:
    """Block indices for a person, runs shortened: "1-29", or "3, 5, 8"."""
    runs: list[list[int]] = []
    for ell in layers:
        if runs and ell == runs[-1][-1] + 1:
            runs[-1].append(ell)
        else:
            runs.append([ell])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def is_layer_header(header: Any) -> bool:
    return isinstance(header, dict) and header.get("kind") == KIND


def _parse(header_json: Any, tensors: dict[str, Any], path: Path) -> LayerTask:
    try:
        header = json.loads(header_json) if header_json is not None else None
    except (TypeError, json.JSONDecodeError):
        raise VectorError(f"{path}: task header is not valid JSON") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise VectorError(f"{path}: not an ltv-vllm task file")
    if not is_layer_header(header):
        raise VectorError(f"{path}: a final-layer task vector (kind "
                          f"{str(header.get('kind'))[:20]!r}), not a layer task")
    if header.get("format_version", 0) > FORMAT_VERSION:
        raise VectorError(f"{path}: written by a newer ltv-vllm (format "
                          f"{header['format_version']}); upgrade")
    try:
        spec = header["layer"]
        layers = spec["layers"]
        if not isinstance(layers, list):
            raise VectorError("layer.layers: a list of block indices")
        try:
            policy = LayerPolicy.parse(str(spec.get("positions", "all")))
        except ValueError as e:
            raise VectorError(f"layer.positions: {e}") from None
        for name in ("U", "V", "bias"):
            if name in tensors and not isinstance(tensors[name], torch.Tensor):
                raise VectorError(f"tensor {name!r} is not a tensor")
        return LayerTask(
            layers=tuple(layers),
            bias=tensors["bias"].float() if "bias" in tensors else None,
            U=tensors["U"].float() if "U" in tensors else None,
            V=tensors["V"].float() if "V" in tensors else None,
            model=ModelIdentity.from_dict(header["model"]),
            policy=policy,
            label_token_ids=tuple(int(i) for i in header.get("label_token_ids", [])),
            provenance=Provenance.from_dict(header.get("meta")),
        )
    except VectorError as e:
        raise VectorError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise VectorError(f"{path}: malformed layer-task header ({e!r})") from None


def read_task_file(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """(header JSON, tensors) of a .pt or .safetensors task file, read without running code."""
    path = Path(path)
    if not path.is_file():
        raise VectorError(f"task-vector file not found: {path}")
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    if path.suffix == ".pt":
        obj = torch_load(path)
        if not isinstance(obj, dict) or not isinstance(obj.get("tensors"), dict):
            raise VectorError(f"{path}: not an ltv-vllm task file")
        return obj.get("ltv_vllm"), obj["tensors"]
    raise VectorError(f"task-vector files end in .pt or .safetensors, got {path.name!r}")


def load_layer_task(path: str | Path) -> LayerTask:
    """Read a layer task (.pt or .safetensors); anything else is refused in one line."""
    return _parse(*read_task_file(path), Path(path))


def load_any(path: str | Path) -> Any:
    """A task file of either kind: a `LayerTask`, or a final-layer `TaskVector`."""
    from ltv_vllm.core.vector import _parse as parse_vector

    header_json, tensors = read_task_file(path)
    try:
        header = json.loads(header_json) if header_json is not None else None
    except (TypeError, json.JSONDecodeError):
        header = None  # each parser says what is wrong with it
    parse = _parse if is_layer_header(header) else parse_vector
    return parse(header_json, tensors, Path(path))
