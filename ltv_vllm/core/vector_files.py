"""Reading artifact files without running code: safetensors (a JSON header and raw
tensors), torch.save zips through torch.load(weights_only=True), and plain pickles refused
unread (their opcodes scanned, never executed). Every kind of damage is one VectorError line.
Pure I/O at the edge: task vectors (`core.vector`) and method artifacts are read through it.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import warnings
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.errors import UserError


class VectorError(UserError):
    """A task-vector file that is malformed or does not fit the model it is applied to."""


CORRUPT = "not a task-vector file: truncated or corrupt"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
PICKLE_PROTO = b"\x80"  # a plain pickle (protocol 2+) starts with the PROTO opcode
PICKLE_SCAN_BYTES = 64 << 20  # our files are zips: a plain pickle is read no further than this
# the opcodes that import or call something: what makes unpickling run code
_CODE_OPS = frozenset({"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "REDUCE"})
FORMATS = "task-vector files are safetensors or torch.save zip files"


def sniff_suffix(data: bytes) -> str:
    """The suffix a task-vector file's first bytes call for: ".safetensors" when they are a
    safetensors header (8 bytes of little-endian header length, then the JSON header's `{`),
    ".pt" for a zip (torch.save) or a plain pickle (refused on load, with its reason), else
    ".safetensors" (whose reader refuses it as corrupt). The header test comes first: a
    header of length 128 mod 256 starts with 0x80, a pickle's first byte."""
    if len(data) >= 9 and data[8:9] == b"{" and \
            int.from_bytes(data[:8], "little") <= len(data) - 8:
        return ".safetensors"
    return ".pt" if data.startswith(ZIP_MAGIC) or data.startswith(PICKLE_PROTO) else ".safetensors"


def refuse_plain_pickle(path: Path) -> None:
    """A .pt that is a plain pickle, not torch.save's zip: never ours. Say whether it would
    run code, from its opcodes alone (pickletools reads, never executes); not unpickled."""

    try:
        with open(path, "rb") as f:
            data = f.read(PICKLE_SCAN_BYTES)
    except OSError:
        raise VectorError(f"{path}: {CORRUPT}") from None
    if data.startswith(ZIP_MAGIC) or not data.startswith(PICKLE_PROTO):
        return  # torch.load's own checks (and its weights-only unpickler) take it from here
    try:
        for op, _arg, _pos in pickletools.genops(io.BytesIO(data)):
            if op.name in _CODE_OPS:
                raise VectorError(f"{path}: refused: a plain pickle that names Python objects "
                                  f"(code that would run on load); {FORMATS}")
    except VectorError:
        raise
    except Exception:  # noqa: BLE001 - any damage genops trips on (bad opcode, EOF)
        if len(data) < PICKLE_SCAN_BYTES:
            raise VectorError(f"{path}: {CORRUPT}") from None
        # cut off by our bound, not damaged: still a pickle with no code in what was read
    raise VectorError(f"{path}: a plain pickle, not a task-vector file ({FORMATS})")


def torch_load(path: Path, allow: tuple[type, ...] = ()) -> Any:
    """torch.load(weights_only=True), its failures in one line of ours; `allow`: classes the
    weights-only unpickler may rebuild besides tensors and containers (a steering-vectors
    `SteeringVector`: a dataclass of tensors, rebuilt from its fields, no code run).

    A pickle that names anything but tensors and plain containers (a class, a function:
    code that would run on load) is refused by torch's weights-only unpickler; say that,
    rather than torch's paragraph on how to load it anyway. A plain (non-zip) pickle is
    refused before torch sees it (`refuse_plain_pickle`).
    """

    refuse_plain_pickle(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.serialization.safe_globals(list(allow)):
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # "Unsupported global": the pickle names a callable (code); anything else the
        # weights-only unpickler trips on ("Unsupported operand", EOF) is damage
        if "unsupported global" in str(e).lower():
            raise VectorError(
                f"{path}: refused: the file contains code (pickled objects other than tensors), "
                "which a task-vector file never holds; it was not loaded"
            ) from None
        raise VectorError(f"{path}: {CORRUPT}") from None
    except Exception:  # noqa: BLE001 - bad zip, truncated data, wrong magic number, EOF
        raise VectorError(f"{path}: {CORRUPT}") from None


def read_safetensors(path: Path, key: str = "ltv_vllm") -> tuple[Any, dict[str, torch.Tensor]]:
    """The JSON header stored under metadata `key` (or None) and the tensors of a
    .safetensors file; any damage is one VectorError line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header_json = (f.metadata() or {}).get(key)
        return header_json, load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError):
        raise VectorError(f"{path}: {CORRUPT}") from None
