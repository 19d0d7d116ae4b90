"""Derived models: the first L decoder layers of another model, same tokenizer.

`derive_model` makes a smaller model that shares a tokenizer with a bigger one (for cross-model
transfer) by keeping only its first L decoder layers, copying tensors byte for byte from the
base's safetensors shards; nothing is instantiated.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ltv_vllm.models.cache import (
    DERIVED_FORMAT,
    DERIVED_MARKER,
    NAME,
    ModelError,
    derived_marker,
    model_path,
    publish,
)
from ltv_vllm.models.packaged import _CHUNK, MARKER, PACKAGED_MODELS
from ltv_vllm.models.resolve import resolve_model

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Config lists with one entry per decoder layer; truncated along with the layers.
_PER_LAYER_LISTS = ("layer_types", "no_rope_layers")
# Weights in any format, their indices and what we rewrite: everything else is copied as is.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
_NOT_COPIED = ("config.json", MARKER, DERIVED_MARKER)
# Bytes per element of safetensors dtypes; the writer orders tensors by it to keep each aligned.
_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
}  # fmt: skip
_MAX_HEADER = 100_000_000  # safetensors' own limit


@dataclass(frozen=True)
class _Tensor:
    """Where one tensor's bytes live in a source shard."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: Path
    start: int  # absolute byte offset in `source`
    nbytes: int


def _text_config(config: dict[str, Any], what: str) -> dict[str, Any]:
    """The (mutable) part of `config` that describes the decoder: flat or under text_config."""
    nested = config.get("text_config")
    text = nested if isinstance(nested, dict) and "num_hidden_layers" in nested else config
    n = text.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ModelError(f"{what}: config.json has no usable num_hidden_layers ({n!r})")
    return text


def _truncated_config(config: dict[str, Any], keep: int, what: str) -> dict[str, Any]:
    new = json.loads(json.dumps(config))  # deep copy
    text = _text_config(new, what)
    n = text["num_hidden_layers"]
    text["num_hidden_layers"] = keep
    for key in _PER_LAYER_LISTS:
        if isinstance(text.get(key), list):
            if len(text[key]) != n:
                raise ModelError(f"{what}: config {key} has {len(text[key])} entries, not {n}")
            text[key] = text[key][:keep]
    if isinstance(text.get("max_window_layers"), int):
        text["max_window_layers"] = min(text["max_window_layers"], keep)
    return new


def _read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, byte offset where the data starts) of a safetensors file."""
    with path.open("rb") as f:
        raw = f.read(8)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < size <= _MAX_HEADER:
            raise ModelError(f"{path}: not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise ModelError(f"{path}: unreadable safetensors header") from None
    return header, 8 + size


def _plan_tensors(
    base_path: Path, n_layers: int, keep: int
) -> tuple[list[_Tensor], int, dict[str, str] | None]:
    """(tensors to keep, how many dropped, the first shard's __metadata__)."""
    shards = sorted(base_path.glob("*.safetensors"))
    if not shards:
        raise ModelError(f"{base_path}: no *.safetensors weights to derive from")
    tensors: dict[str, _Tensor] = {}
    metadata: dict[str, str] | None = None
    for shard in shards:
        header, data_start = _read_safetensors_header(shard)
        meta = header.pop("__metadata__", None)
        metadata = meta if metadata is None and isinstance(meta, dict) else metadata
        for name, info in header.items():
            if name in tensors:
                raise ModelError(f"{base_path}: tensor {name} is in two shards")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            tensors[name] = _Tensor(
                name, info["dtype"], shape, shard, data_start + begin, end - begin
            )

    # The decoder stack is the one `layers.<i>.` prefix numbered exactly 0..n-1; other stacks
    # (a vision tower, say) are left whole.
    stacks: dict[str, set[int]] = {}
    for name in tensors:
        if m := _LAYER_KEY.search(name):
            stacks.setdefault(name[: m.start(1)], set()).add(int(m.group(1)))
    decoder = [prefix for prefix, idx in stacks.items() if idx == set(range(n_layers))]
    if len(decoder) != 1:
        found = {p: len(i) for p, i in stacks.items()} or "none"
        raise ModelError(
            f"{base_path}: expected one decoder layer stack numbered 0..{n_layers - 1} in the "
            f"weights, found {found}"
        )
    (prefix,) = decoder

    def dropped(name: str) -> bool:
        m = _LAYER_KEY.search(name)
        return m is not None and name[: m.start(1)] == prefix and int(m.group(1)) >= keep

    kept = [t for t in tensors.values() if not dropped(t.name)]
    return kept, len(tensors) - len(kept), metadata


def _write_safetensors(
    path: Path, tensors: list[_Tensor], metadata: dict[str, str] | None, bar: Any
) -> None:
    """Write `tensors` as one safetensors file, copying their bytes straight from the sources.

    Byte for byte, so every dtype (bfloat16 included) survives untouched and memory stays at one
    chunk whatever the model size. Like safetensors' own writer, the header is padded to 8 bytes
    and tensors go widest dtype first, so each one starts aligned to its element size.
    """
    order = sorted(tensors, key=lambda t: (-_ITEMSIZE.get(t.dtype, 1), t.name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in order:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as out, ExitStack() as stack:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        sources: dict[Path, Any] = {}
        for t in order:
            if t.source not in sources:
                sources[t.source] = stack.enter_context(t.source.open("rb"))
            src = sources[t.source]
            src.seek(t.start)
            left = t.nbytes
            while left:
                chunk = src.read(min(_CHUNK, left))
                if not chunk:
                    raise ModelError(f"{t.source}: truncated inside tensor {t.name}")
                out.write(chunk)
                left -= len(chunk)
                bar.update(len(chunk))


def _check_written(path: Path, tensors: list[_Tensor]) -> None:
    """Re-open the written file with safetensors itself: it checks every offset and size."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert got == {t.name: t.shape for t in tensors}, f"{path}: written tensors differ"


def derive_model(
    base: str,
    *,
    keep_layers: int,
    name: str | None = None,
    out: Path | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """A model made of the first `keep_layers` decoder layers of `base`; returns its directory.

    Embeddings, final norm, LM head and tokenizer are kept unchanged, so the result shares the
    base's tokenizer and vocabulary (cross-model transfer needs exactly that). Tensors are
    copied as bytes from the base's safetensors shards into one model.safetensors; nothing is
    instantiated. `base` is any spec `resolve_model` turns into a local directory. The result
    goes to `out`, or to the cache as `name` (default "<base name>-l<keep_layers>"), where
    `resolve_model(name)` finds it. An existing result for the same request is returned as is
    unless `force`.
    """
    if name is not None and out is not None:
        raise ModelError("give a name (a cache entry) or an output directory, not both")
    if isinstance(keep_layers, bool) or not isinstance(keep_layers, int) or keep_layers < 1:
        # before resolve_model, which may fetch and convert a packaged base
        raise ModelError(f"keep_layers must be at least 1, got {keep_layers!r}")
    base_path = Path(resolve_model(base))
    if not base_path.is_dir():
        raise ModelError(
            f"{base}: deriving needs a local model directory (a packaged alias, a derived name "
            "or a path); hub ids cannot be fetched here"
        )
    try:
        config = json.loads((base_path / "config.json").read_text())
    except ValueError as err:
        raise ModelError(f"{base_path}/config.json: {err}") from None
    n_layers = _text_config(config, base)["num_hidden_layers"]
    if isinstance(keep_layers, bool) or not isinstance(keep_layers, int):
        raise ModelError(f"keep_layers must be an integer, got {keep_layers!r}")
    if not 1 <= keep_layers < n_layers:
        raise ModelError(
            f"keep_layers must be between 1 and {n_layers - 1} ({base} has {n_layers} layers), "
            f"got {keep_layers}"
        )

    if out is None:
        stem = base if base in PACKAGED_MODELS else base_path.name
        name = name if name is not None else f"{stem}-l{keep_layers}"
        if not NAME.fullmatch(name) or name in PACKAGED_MODELS:
            raise ModelError(
                f"{name!r} cannot name a derived model: use letters, digits, '.', '_', '-' and "
                "no packaged alias"
            )
        final = model_path(name)
    else:
        final = Path(out).expanduser().absolute()
        name = final.name

    def is_complete(path: Path) -> bool:
        marker = derived_marker(path)
        return marker is not None and (marker.get("base_path"), marker.get("keep_layers")) == (
            str(base_path),
            keep_layers,
        )

    if final.exists():
        if not force and is_complete(final):
            return final
        # Replace only what this function wrote: never a user's folder that happens to be there.
        if not final.is_dir() or (any(final.iterdir()) and not (final / DERIVED_MARKER).is_file()):
            raise ModelError(f"{final} exists and is not a derived model; not replacing it")
        other = derived_marker(final)
        if other is not None and not force:
            raise ModelError(
                f"{final} already holds the first {other.get('keep_layers')} layers of "
                f"{other.get('base')}; pass force (--force) or choose another name"
            )

    tensors, n_dropped, metadata = _plan_tensors(base_path, n_layers, keep_layers)
    new_config = _truncated_config(config, keep_layers, base)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        built = work / "model"
        built.mkdir()
        for path in sorted(base_path.iterdir()):
            skip = path.name in _NOT_COPIED or path.name.endswith(".index.json")
            if path.is_file() and not skip and not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(path, built / path.name)
        (built / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
        weights = built / "model.safetensors"
        total = sum(t.nbytes for t in tensors)
        bar = tqdm(
            total=total, desc=f"deriving {name}", unit="B", unit_scale=True, disable=not progress
        )
        with bar:
            _write_safetensors(weights, tensors, metadata, bar)
        _check_written(weights, tensors)
        marker = {
            "format": DERIVED_FORMAT,
            "name": name,
            "base": base,
            "base_path": str(base_path),
            "keep_layers": keep_layers,
            "base_num_hidden_layers": n_layers,
            "dropped_tensors": n_dropped,
            "architecture": (config.get("architectures") or ["?"])[0],
        }
        (built / DERIVED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        publish(built, final, work, force, is_complete)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


