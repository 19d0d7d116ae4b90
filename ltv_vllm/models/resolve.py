"""Model specs → a local directory that `from_pretrained` and vLLM load.

A spec is a packaged alias (`packaged.py` fetches and converts it once), the name of a model
`derive.py` made, a local HF directory, or a hub id (returned unchanged).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ltv_vllm.models import packaged
from ltv_vllm.models.cache import (
    DEFAULT_MODEL,
    NAME,
    ModelError,
    cache_dir,
    derived_marker,
    model_path,
)
from ltv_vllm.models.packaged import PACKAGED_MODELS, is_complete


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
        return str(packaged.prepare_model(spec))  # via the module: tests replace it
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

