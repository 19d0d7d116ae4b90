"""The model cache: where entries live, how one is published, how a finished one is known.

Every cache entry lives under `cache_dir()/models/` and is built in a temporary directory
next to its final place, then renamed into place with its completion marker already inside
(`publish`), so a crash or a concurrent builder never leaves a half-written entry behind.
Packaged models (`packaged.py`) and derived ones (`derive.py`) are both built this way;
`resolve.py` turns a user's spec into one of them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ltv_vllm.errors import UserError


class ModelError(UserError):
    """A model spec that cannot be resolved; the message is shown to the user as is."""


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



def model_path(alias: str) -> Path:
    return cache_dir() / "models" / alias



def publish(
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


DERIVED_MARKER = "ltv_vllm_derived.json"
DERIVED_FORMAT = 1
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a cache entry name, never a path


def derived_marker(path: Path) -> dict[str, Any] | None:
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
