"""Files of the baselines' artifacts: safetensors tensors + a JSON header, checked on load.

LTV and the mean shift keep their own task-vector files (`ltv_vllm.core.vector`, served by vLLM);
every other method (tv, fv, sv, i2cl, mlp) saves an `Artifact`: its tensors (float32), the
parameters it was chosen with (a layer, a depth, heads, coefficients), the model it belongs
to and how it was made. Like task-vector files, loading runs no code (safetensors only), and
applying an artifact to a model it was not made on is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.core.fileio import atomic_write
from ltv_vllm.core.vector import (
    ModelIdentity,
    Provenance,
    TaskVector,
    VectorError,
    check_identity,
    load_task_vector,
)
from ltv_vllm.core.vector_files import read_safetensors

FORMAT = "ltv-vllm-method-artifact"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Artifact:
    method: str                       # "tv", "fv", "sv", "i2cl", "mlp"
    tensors: dict[str, torch.Tensor]  # float32, CPU
    params: dict[str, Any]            # JSON-able: layer, depth, heads, coefficients, ...
    model: ModelIdentity
    label_token_ids: tuple[int, ...]
    provenance: Provenance = field(default_factory=Provenance)

    def __post_init__(self) -> None:
        if isinstance(self.provenance, dict):
            object.__setattr__(self, "provenance", Provenance.from_dict(self.provenance))

    @property
    def task_name(self) -> str:
        return str((self.provenance.task or {}).get("name", "?"))

    def check_model(self, ident: ModelIdentity) -> None:
        check_identity(self.model, ident, f"{self.method} artifact {self.task_name!r}")

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        if path.suffix != ".safetensors":
            raise VectorError(f"{self.method} artifacts are .safetensors files, got {path.name!r}")
        header = json.dumps({
            "format": FORMAT, "format_version": FORMAT_VERSION, "method": self.method,
            "params": self.params, "model": self.model.to_dict(),
            "label_token_ids": list(self.label_token_ids), "meta": self.provenance.to_dict(),
        })
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in self.tensors.items()}
        return atomic_write(path, lambda tmp: save_file(tensors, tmp,
                                                        metadata={"ltv_vllm": header}))


def load_artifact(path: str | Path) -> Artifact | TaskVector:
    """Any method's file: a task vector (.pt / .safetensors) or a baseline's artifact."""
    path = Path(path)
    if not path.is_file():
        raise VectorError(f"artifact file not found: {path}")
    if path.suffix != ".safetensors":
        return load_task_vector(path)
    header_json, tensors = read_safetensors(path)
    try:
        header = json.loads(header_json) if header_json is not None else None
    except json.JSONDecodeError:
        raise VectorError(f"{path}: artifact header is not valid JSON") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return load_task_vector(path)  # a task vector, or its one-line refusal
    if header.get("format_version", 0) > FORMAT_VERSION:
        raise VectorError(f"{path}: written by a newer ltv-vllm (format "
                          f"{header['format_version']}); upgrade")
    try:
        return Artifact(
            method=str(header["method"]),
            tensors={k: v.float() for k, v in tensors.items()},
            params=dict(header["params"]),
            model=ModelIdentity.from_dict(header["model"]),
            label_token_ids=tuple(int(i) for i in header["label_token_ids"]),
            provenance=Provenance.from_dict(header.get("meta")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # any malformed header
        if isinstance(e, VectorError):  # already one line (a malformed `meta` field)
            raise VectorError(f"{path}: {e}") from None
        raise VectorError(f"{path}: malformed artifact header ({e!r})") from None
