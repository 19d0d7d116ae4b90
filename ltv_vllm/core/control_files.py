"""The community's control vectors read into layer tasks (`core.layer_task`), additive, at
every position (policy "all") unless asked otherwise:

  * a GGUF control vector, as repeng's `ControlVector.export_gguf` writes it and llama.cpp's
    `--control-vector` loads it: architecture "controlvector", `controlvector.model_hint`
    (the model type it was made on), tensors `direction.N` — N the decoder block whose
    output gets the direction (llama.cpp adds tensor N after block N; repeng's ControlModel
    adds directions[N] to `model.layers[N]`'s output);
  * a repeng `ControlVector` object (`directions`: block → vector, `model_type`);
  * a steering-vectors `SteeringVector` (`layer_activations`: block → vector, `layer_type`
    "decoder_block"; applied by its `apply()` at every position from `min_token_index`,
    0 here), or a file holding one: torch.save of the object (rebuilt by the weights-only
    unpickler, allowed that one class) or of its `layer_activations` dict.

A vector's scale (repeng's `coeff`, steering-vectors' `multiplier`) is multiplied in. Every
misfit — another model type, another width, a block past the model's last — is one
VectorError line, before anything is written. File I/O at the edge; the model is described by
its identity, never loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ltv_vllm.core.layer_task import LayerPolicy, LayerTask
from ltv_vllm.core.vector import ModelIdentity, Provenance
from ltv_vllm.core.vector_files import VectorError, torch_load

GGUF_ARCH = "controlvector"
SOURCES = ("gguf", "steering-vectors")


def from_directions(directions: Mapping[Any, Any], ident: ModelIdentity, *, scale: float = 1.0,
                    policy: LayerPolicy | None = None, method: str, name: str,
                    where: str) -> LayerTask:
    """An additive layer task from {block: vector} (negative blocks count from the last, as
    both libraries allow), each vector times `scale`; `where` names the source in errors."""
    if not directions:
        raise VectorError(f"{where}: holds no direction")
    depth, d = ident.num_layers, ident.hidden_size
    rows: dict[int, torch.Tensor] = {}
    for key, vec in directions.items():
        try:
            ell = int(key)
        except (TypeError, ValueError):
            raise VectorError(f"{where}: a direction's layer is not an integer: "
                              f"{str(key)[:40]!r}") from None
        if ell < 0 and depth is not None:
            ell += depth
        if ell < 0 or (depth is not None and ell >= depth):
            raise VectorError(f"{where}: a direction for block {key}, but {ident.name} has "
                              f"{depth} blocks (0 to {(depth or 0) - 1})")
        t = (vec.detach().float().cpu() if isinstance(vec, torch.Tensor)
             else torch.from_numpy(np.array(vec, dtype=np.float32))).reshape(-1)
        if t.numel() != d:
            raise VectorError(f"{where}: its block-{ell} direction has width {t.numel()}, "
                              f"{ident.name} has hidden size {d} (a vector for another model)")
        if ell in rows:
            raise VectorError(f"{where}: two directions for block {ell}")
        rows[ell] = t
    layers = tuple(sorted(rows))
    bias = torch.stack([rows[ell] for ell in layers]) * float(scale)
    return LayerTask(layers=layers, bias=bias, U=None, V=None, model=ident,
                     policy=policy or LayerPolicy(prompt=True, steps=None),
                     provenance=Provenance(method=method, task={"name": name},
                                           extra={"import": {"scale": float(scale)}}))


def _check_hint(hint: str | None, model_type: str | None, where: str) -> None:
    if hint and model_type and hint != model_type:
        raise VectorError(f"{where}: made on a {hint!r} model, the model is {model_type!r}")


def read_gguf(path: Path) -> tuple[str | None, dict[int, np.ndarray]]:
    """(model hint, {block: direction}) of a GGUF control-vector file."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError, KeyError, IndexError, EOFError) as e:
        raise VectorError(f"{path}: not a readable GGUF file ({str(e)[:80]})") from None

    def text(key: str) -> str | None:
        f = reader.fields.get(key)
        if f is None or not f.data:
            return None
        return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")

    arch = text("general.architecture")
    if arch != GGUF_ARCH:
        raise VectorError(f"{path}: a GGUF file of architecture {str(arch)[:40]!r}, not a "
                          f"control vector ({GGUF_ARCH!r})")
    directions: dict[int, np.ndarray] = {}
    for t in reader.tensors:
        prefix, _, num = t.name.partition(".")
        if prefix != "direction" or not num.isascii() or not num.isdigit():
            raise VectorError(f"{path}: unexpected tensor {t.name[:40]!r} in a control vector "
                              "(its tensors are direction.N)")
        directions[int(num)] = np.asarray(t.data, dtype=np.float32)
    return text(f"{GGUF_ARCH}.model_hint"), directions


def from_repeng(cv: Any, ident: ModelIdentity, model_type: str | None, *, scale: float = 1.0,
                name: str = "control-vector", policy: LayerPolicy | None = None) -> LayerTask:
    """A repeng `ControlVector` (its `directions` and `model_type`), times `scale` (repeng's
    `coeff`), as ControlModel applies it: added to each block's output at every position."""
    where = f"repeng ControlVector {name!r}"
    _check_hint(getattr(cv, "model_type", None), model_type, where)
    return from_directions(cv.directions, ident, scale=scale, policy=policy, method="repeng",
                           name=name, where=where)


def from_steering_vector(sv: Any, ident: ModelIdentity, *, scale: float = 1.0,
                         name: str = "steering-vector",
                         policy: LayerPolicy | None = None) -> LayerTask:
    """A steering-vectors `SteeringVector`, times `scale` (its `multiplier`), as `apply()`
    with `min_token_index=0` adds it: to each decoder block's output at every position."""
    where = f"SteeringVector {name!r}"
    layer_type = getattr(sv, "layer_type", "decoder_block")
    if layer_type != "decoder_block":
        raise VectorError(f"{where}: steers {layer_type!r} modules; a layer task shifts the "
                          "decoder block's output (layer_type 'decoder_block')")
    return from_directions(sv.layer_activations, ident, scale=scale, policy=policy,
                           method="steering-vectors", name=name, where=where)


def read_steering_file(path: Path) -> Any:
    """A torch.save'd SteeringVector (or its `layer_activations` dict), read with the
    weights-only unpickler; returns an object with `layer_activations` and `layer_type`."""
    allow: tuple[type, ...] = ()
    try:
        from steering_vectors import SteeringVector

        allow = (SteeringVector,)
    except ImportError:
        pass
    try:
        obj = torch_load(path, allow=allow)
    except VectorError as e:
        if not allow and "contains code" in str(e):
            raise VectorError(f"{path}: a pickled object (a SteeringVector?): install "
                              "steering-vectors to read one, or save its layer_activations "
                              "dict instead") from None
        raise
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return _Activations(obj)
    if hasattr(obj, "layer_activations"):
        return obj
    raise VectorError(f"{path}: neither a SteeringVector nor a {{layer: tensor}} dict")


class _Activations:
    def __init__(self, acts: dict[Any, torch.Tensor]) -> None:
        self.layer_activations = acts
        self.layer_type = "decoder_block"


def import_file(path: str | Path, ident: ModelIdentity, model_type: str | None, *,
                scale: float = 1.0, source: str | None = None,
                policy: LayerPolicy | None = None, name: str | None = None) -> LayerTask:
    """A community control-vector file as a layer task for the model `ident`: `source` is
    "gguf" or "steering-vectors" (None: by suffix, .gguf or not)."""
    path = Path(path)
    if not path.is_file():
        raise VectorError(f"control-vector file not found: {path}")
    source = source or ("gguf" if path.suffix == ".gguf" else "steering-vectors")
    if source not in SOURCES:
        raise VectorError(f"unknown control-vector source {source!r}: {', '.join(SOURCES)}")
    name = name or path.stem
    if source == "gguf":
        hint, directions = read_gguf(path)
        _check_hint(hint, model_type, str(path))
        return from_directions(directions, ident, scale=scale, policy=policy, method="gguf",
                               name=name, where=str(path))
    return from_steering_vector(read_steering_file(path), ident, scale=scale, name=name,
                                policy=policy)
