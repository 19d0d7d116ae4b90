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
    wanted = ([] if _tied(_read_config(path)) else ["lm_head.weight"]) + _EMBED_KEYS
    weight = _read_first(path, wanted)
    if weight is None:
        raise VectorError(f"{path}: no LM-head weight found in its safetensors files")
    return weight


def read_label_rows(path: str | Path,
                    label_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head's rows (and bias) at `label_ids`, float32: W_C (K, d), b_C (K,), sliced
    from the safetensors shards, so a 72B checkpoint's head (2.5 GB) is never read whole."""
    from safetensors import safe_open

    path = Path(path)
    tied = _tied(_read_config(path))
    wanted = ([] if tied else ["lm_head.weight"]) + _EMBED_KEYS
    rows: dict[str, torch.Tensor] = {}
    for key, bias in ((wanted, False), (["lm_head.bias"], True)):
        found = _find(path, key)
        if found is None:
            if not bias:
                raise VectorError(f"{path}: no LM-head weight found in its safetensors files")
            continue
        shard, name = found
        with safe_open(str(shard), framework="pt") as f:
            sl = f.get_slice(name)
            vocab = sl.get_shape()[0]
            bad = [i for i in label_ids if not 0 <= i < vocab]
            if bad:
                raise VectorError(f"{path}: label token id {bad[0]} outside the vocabulary "
                                  f"of {vocab}")
            rows["b" if bias else "w"] = torch.cat([sl[i:i + 1] for i in label_ids]).float()
    b = rows["b"].reshape(-1) if "b" in rows else torch.zeros(len(label_ids))
    return rows["w"], b


def read_lm_head_bias(path: str | Path) -> torch.Tensor | None:
    """The LM head's bias (vocab,) of an HF model directory, or None (most models have none)."""
    return _read_first(Path(path), ["lm_head.bias"])


def read_final_norm(path: str | Path) -> torch.Tensor:
    """The weight γ (d,) of the RMSNorm between the last decoder block and the LM head."""
    weight = _read_first(Path(path), ["model.norm.weight", "model.language_model.norm.weight"])
    if weight is None:
        raise VectorError(f"{path}: no final norm weight (model.norm.weight) in its "
                          "safetensors files")
    return weight


_EMBED_KEYS = ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight"]


def _tied(cfg: dict[str, Any]) -> bool:
    text_cfg = cfg.get("text_config", cfg)
    return bool(text_cfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))


def _find(path: Path, wanted: list[str]) -> tuple[Path, str] | None:
    """The shard and name of the first of `wanted` found in the directory's safetensors
    shards, in `wanted` order (a shard's header only is read)."""
    from safetensors import safe_open

    for key in wanted:
        for shard in sorted(path.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                if key in f.keys():
                    return shard, key
    return None


def _read_first(path: Path, wanted: list[str]) -> torch.Tensor | None:
    """The first of `wanted` found in the directory's safetensors shards, in `wanted` order."""
    from safetensors import safe_open

    found = _find(path, wanted)
    if found is None:
        return None
    with safe_open(str(found[0]), framework="pt") as f:
        return f.get_tensor(found[1])


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise VectorError(f"{path}: no readable config.json ({e})") from None


def context_length(path: str | Path) -> int | None:
    """The context in tokens an HF model directory's config states (None: it states none)."""
    cfg = _read_config(Path(path))
    return cfg.get("text_config", cfg).get("max_position_embeddings")


def model_type(path: str | Path) -> str | None:
    """The `model_type` an HF model directory's config states (a control vector's hint)."""
    cfg = _read_config(Path(path))
    return cfg.get("text_config", cfg).get("model_type") or cfg.get("model_type")


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
