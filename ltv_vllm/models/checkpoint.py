"""Reading an HF model directory without building the model: config, LM head, identity.

What a server or an export checks before any engine starts: the LM-head weight (and bias)
straight from the safetensors shards, and the `ModelIdentity` a task vector is checked against.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ltv_vllm.core.vector import ModelIdentity, VectorError, _num_layers, fingerprint_lm_head


def read_lm_head(path: str | Path) -> torch.Tensor:
    """The LM-head weight (vocab, d) of an HF model directory, read from its safetensors
    shards without building the model (the input embedding when the head is tied to it)."""

    path = Path(path)
    cfg = _read_config(path)
    text_cfg = cfg.get("text_config", cfg)
    tied = bool(text_cfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    wanted = ["lm_head.weight"] if not tied else []
    wanted += ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight"]
    weight = _read_first(path, wanted)
    if weight is None:
        raise VectorError(f"{path}: no LM-head weight found in its safetensors files")
    return weight


def read_lm_head_bias(path: str | Path) -> torch.Tensor | None:
    """The LM head's bias (vocab,) of an HF model directory, or None (most models have none)."""
    return _read_first(Path(path), ["lm_head.bias"])


def _read_first(path: Path, wanted: list[str]) -> torch.Tensor | None:
    """The first of `wanted` found in the directory's safetensors shards, in `wanted` order."""
    from safetensors import safe_open

    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            keys = set(f.keys())
            for key in wanted:
                if key in keys:
                    return f.get_tensor(key)
    return None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise VectorError(f"{path}: no readable config.json ({e})") from None


def identity_from_dir(path: str | Path, name: str | None = None) -> ModelIdentity:
    """ModelIdentity of an HF model directory: what a server checks before its engine starts."""
    path = Path(path)
    cfg = _read_config(path)
    weight = read_lm_head(path)
    text_cfg = cfg.get("text_config", cfg)
    return ModelIdentity(
        name=name or str(path),
        hidden_size=int(text_cfg["hidden_size"]),
        vocab_size=int(weight.shape[0]),
        lm_head_fingerprint=fingerprint_lm_head(weight),
        num_layers=_num_layers(text_cfg),
    )
