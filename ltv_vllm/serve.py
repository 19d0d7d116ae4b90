"""Serving task vectors with vLLM: engine arguments, checks before the engine starts.

`engine_kwargs(model_dir, vector_path)` gives what `vllm.LLM(...)` / the OpenAI server need
to run the stock model class's LTV wrapper with the vector fused in: the wrapper is selected
with `hf_overrides={"architectures": [...]}` and finds its vector through the config key
`ltv_task_vector`. The vector is validated against the model directory first, so a wrong
file is refused with one line before any engine process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .vector import TaskVector, VectorError, identity_from_dir, load_task_vector


def base_architecture(model_dir: str | Path) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not archs:
        raise VectorError(f"{model_dir}: config.json names no architecture")
    return str(archs[0])


def checked_vector(model_dir: str | Path, vector_path: str | Path) -> TaskVector:
    """Load a vector and check it against the model directory (sizes and LM-head fingerprint)."""
    tv = load_task_vector(vector_path)
    tv.check_model(identity_from_dir(model_dir))
    return tv


def engine_kwargs(model_dir: str | Path, vector_path: str | Path) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `EngineArgs` serving `model_dir` with the vector fused."""
    from .vllm_ext import WRAPPERS

    vector_path = Path(vector_path).resolve()
    if vector_path.suffix == ".safetensors" and vector_path.parent == Path(model_dir).resolve():
        raise VectorError(
            f"{vector_path.name} is inside the model directory, where vLLM would load it as a "
            "weight shard; keep task vectors elsewhere"
        )
    checked_vector(model_dir, vector_path)
    arch = base_architecture(model_dir)
    if arch not in WRAPPERS:
        supported = ", ".join(sorted(WRAPPERS))
        raise VectorError(f"{model_dir}: architecture {arch} has no LTV wrapper (supported: {supported})")
    return {
        "model": str(model_dir),
        "hf_overrides": {
            "architectures": [WRAPPERS[arch]],
            "ltv_task_vector": str(vector_path),
        },
    }
